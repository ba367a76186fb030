package mambacache

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

// The scenarios of TensorRT-LLM's tests for PR #14853
// (test_mamba_cache_manager.py, test_mamba_transfer.py).

// test_python_mamba_resource_count_excludes_reserved_dummy_slots[adp=False/True]
func TestCapacityExcludesReservedRows(t *testing.T) {
	for _, adp := range []bool{false, true} {
		for _, mbs := range []int{1, 2, 8} {
			p := newPool(t, testConfig(mbs, adp))
			require.Equal(t, mbs, p.Capacity(), "adp=%v mbs=%d", adp, mbs)
			require.Equal(t, mbs, p.FreeRows())
			require.Equal(t, mbs, len(p.FreeList(nil)))
			require.Equal(t, 0, p.UsedRows())
			for _, r := range p.FreeList(nil) {
				require.False(t, p.IsReserved(r))
			}
			reserved := 0
			for r := Row(0); int(r) < p.Config().TotalRows(); r++ {
				if p.IsReserved(r) {
					reserved++
				}
			}
			require.Equal(t, p.ReservedRows(), reserved)
		}
	}
}

// test_attention_dp_dummy_has_reserved_slot_with_batch_size_one and
// test_mamba_disagg_attention_dp_dummy_with_batch_size_one: one request in
// transfer holds the only real row; the ADP dummy still gets its row.
func TestADPDummyHasReservedRowWithBatchSizeOne(t *testing.T) {
	c := testConfig(1, true)
	c.MaxDraftTokens = 0
	p := newPool(t, c)
	adpRow, ok := c.ADPRow()
	require.True(t, ok)
	require.Equal(t, Row(1), adpRow)
	require.Equal(t, Row(2), c.PaddingRow())

	real, err := p.Allocate(100)
	require.NoError(t, err)
	require.Equal(t, Row(0), real)
	require.Empty(t, p.FreeList(nil))

	r, err := p.AddDummy(ADPDummyID)
	require.NoError(t, err)
	require.Equal(t, adpRow, r)
	require.NotEqual(t, real, r)
	require.Empty(t, p.FreeList(nil))
	got, ok := p.Row(ADPDummyID)
	require.True(t, ok)
	require.Equal(t, adpRow, got)

	require.NoError(t, p.Free(ADPDummyID))
	require.NotContains(t, p.FreeList(nil), adpRow, "the reserved row never returns to the free list")
	require.Empty(t, p.FreeList(nil))
	_, ok = p.Row(ADPDummyID)
	require.False(t, ok, "the id is unmapped")

	// The next idle iteration re-adds the dummy: the same reserved row.
	for range 3 {
		r, err = p.AddDummy(ADPDummyID)
		require.NoError(t, err)
		require.Equal(t, adpRow, r)
		r, err = p.AddDummy(ADPDummyID)
		require.NoError(t, err)
		require.Equal(t, adpRow, r, "re-adding while mapped keeps the row")
		require.NoError(t, p.Free(ADPDummyID))
	}
	require.Equal(t, 1, p.UsedRows())
	require.NoError(t, p.Free(100))
	require.Equal(t, []Row{0}, p.FreeList(nil))
}

// TestOriginalBugWithoutADP is the failure PR #14853 fixed, kept as it is
// without attention DP: dummy id 0 has no reserved row, takes a real row like
// any dummy, and fails once every real row is held.
func TestOriginalBugWithoutADP(t *testing.T) {
	p := newPool(t, testConfig(1, false))
	_, err := p.Allocate(100)
	require.NoError(t, err)
	_, err = p.AddDummy(ADPDummyID)
	require.ErrorIs(t, err, ErrNoFreeRows)
	require.EqualError(t, err, "mambacache: run out of mamba cache blocks: id 0, 1 real rows all held")
	_, ok := p.Row(ADPDummyID)
	require.False(t, ok)

	// With a free row it takes a real row and returns it when freed.
	require.NoError(t, p.Free(100))
	r, err := p.AddDummy(ADPDummyID)
	require.NoError(t, err)
	require.False(t, p.IsReserved(r))
	require.Equal(t, 1, p.UsedRows())
	require.NoError(t, p.Free(ADPDummyID))
	require.Equal(t, 1, p.FreeRows())
}

func TestPaddingSentinelsShareOneRow(t *testing.T) {
	c := testConfig(2, true) // MaxDraftTokens 2
	p := newPool(t, c)
	for d := uint64(0); d <= 2; d++ {
		r, err := p.AddDummy(math.MaxUint64 - d)
		require.NoError(t, err)
		require.Equal(t, c.PaddingRow(), r)
		require.True(t, p.IsReserved(r))
	}
	require.Equal(t, 2, p.FreeRows(), "padding never consumes the free list")
	_, err := p.Allocate(math.MaxUint64 - 1)
	require.ErrorIs(t, err, ErrDummyID)
	_, err = p.Allocate(ADPDummyID)
	require.ErrorIs(t, err, ErrDummyID)
	for d := uint64(0); d <= 2; d++ {
		require.NoError(t, p.Free(math.MaxUint64-d))
	}
	require.Equal(t, []Row{0, 1}, p.FreeList(nil))

	// A warm-up dummy outside the sentinel range takes a real row.
	r, err := p.AddDummy(math.MaxUint64 - 3)
	require.NoError(t, err)
	require.Equal(t, Row(1), r)
	require.NoError(t, p.Free(math.MaxUint64-3))
	require.Equal(t, []Row{0, 1}, p.FreeList(nil))
}
