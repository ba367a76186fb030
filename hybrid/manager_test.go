package hybrid

import (
	"math"
	"testing"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/stretchr/testify/require"
)

func testConfig(mbs, blocks int, adp bool) Config {
	return Config{
		KV: kvcache.Config{Layers: 2, KVHeads: 2, HeadDim: 4, ElemSize: 2, TokensPerBlock: 4, Blocks: blocks},
		Mamba: mambacache.Config{
			Layers: 2, DState: 4, DConv: 4, Heads: 2, HeadDim: 3, NGroups: 1,
			ConvElemSize: 2, SSMElemSize: 4, MaxBatchSize: mbs, AttentionDP: adp,
		},
	}
}

func newManager(t testing.TB, c Config) *Manager {
	t.Helper()
	m, err := New(c)
	require.NoError(t, err)
	return m
}

func TestNewValidates(t *testing.T) {
	c := testConfig(1, 8, false)
	c.KV.Layers = 0
	_, err := New(c)
	require.ErrorIs(t, err, kvcache.ErrInvalidConfig)
	c = testConfig(1, 8, false)
	c.Mamba.DConv = 1
	_, err = New(c)
	require.ErrorIs(t, err, mambacache.ErrInvalidConfig)
	_, err = New(testConfig(1, 1, true))
	require.ErrorIs(t, err, kvcache.ErrInvalidConfig)
	_, err = New(testConfig(1, 1, false))
	require.NoError(t, err)
}

func TestPrepareGrowFree(t *testing.T) {
	m := newManager(t, testConfig(2, 8, false))
	res, err := m.Prepare(1, 10)
	require.NoError(t, err)
	require.Equal(t, mambacache.Row(1), res.Row)
	require.Equal(t, []kvcache.Run{{Start: 0, Len: 3}}, res.Runs)

	res2, err := m.Prepare(1, 13)
	require.NoError(t, err, "prepare is idempotent and grows")
	require.Equal(t, res.Row, res2.Row)
	require.Equal(t, []kvcache.Run{{Start: 0, Len: 4}}, res2.Runs)
	require.NoError(t, m.Grow(1, 14))
	require.ErrorIs(t, m.Grow(2, 1), kvcache.ErrUnknownRequest)

	require.Equal(t, Stats{RowsFree: 1, RowsUsed: 1, RowsReserved: 1, BlocksFree: 4, BlocksAvailable: 4, BlocksUsed: 4, Requests: 1}, m.Stats())
	require.NoError(t, m.Free(1))
	err = m.Free(1)
	require.ErrorIs(t, err, kvcache.ErrUnknownRequest)
	require.ErrorIs(t, err, mambacache.ErrUnknownRequest)
	require.Equal(t, Stats{RowsFree: 2, RowsReserved: 1, BlocksFree: 8, BlocksAvailable: 8}, m.Stats())
}

func TestPrepareAllOrNothing(t *testing.T) {
	m := newManager(t, testConfig(2, 4, false))
	before := m.Stats()
	_, err := m.Prepare(1, 17) // 5 blocks > 4
	require.ErrorIs(t, err, kvcache.ErrNoFreeBlocks)
	require.Equal(t, before, m.Stats(), "the row taken first was rolled back")
	_, ok := m.Mamba().Row(1)
	require.False(t, ok)

	_, err = m.Prepare(1, 4)
	require.NoError(t, err)
	_, err = m.Prepare(2, 4)
	require.NoError(t, err)
	_, err = m.Prepare(3, 4)
	require.ErrorIs(t, err, mambacache.ErrNoFreeRows)
	require.False(t, m.CanAdmit(1))
	_, err = m.Prepare(1, 100)
	require.ErrorIs(t, err, kvcache.ErrNoFreeBlocks)
	_, ok = m.Mamba().Row(1)
	require.True(t, ok, "a failed grow of a held request keeps its row")
	_, err = m.Prepare(1, 0)
	require.ErrorIs(t, err, kvcache.ErrInvalidTokens)
}

// TestADPDummyAlwaysPlaced is the disaggregated scenario of PR #14853 through
// the manager: the only real row and every block but the headroom are held
// by a request in transfer, and the ADP dummy still gets a row and a block.
func TestADPDummyAlwaysPlaced(t *testing.T) {
	m := newManager(t, testConfig(1, 4, true))
	rows, blocks := m.Capacity()
	require.Equal(t, 1, rows)
	require.Equal(t, 3, blocks, "one block is kept for the ADP dummy")
	require.True(t, m.CanAdmit(12))
	require.False(t, m.CanAdmit(13))
	_, err := m.Prepare(100, 13)
	require.ErrorIs(t, err, kvcache.ErrNoFreeBlocks)
	_, err = m.Prepare(100, 12)
	require.NoError(t, err)
	require.ErrorIs(t, m.Grow(100, 13), kvcache.ErrNoFreeBlocks, "growth may not eat the headroom")
	require.Equal(t, 1, m.Stats().BlocksHeadroom)

	for range 3 {
		require.NoError(t, m.AddDummy(mambacache.ADPDummyID))
		r, ok := m.Mamba().Row(mambacache.ADPDummyID)
		require.True(t, ok)
		require.True(t, m.Mamba().IsReserved(r))
		require.Equal(t, 0, m.KV().FreeBlocks())
		require.NoError(t, m.Free(mambacache.ADPDummyID))
		require.Equal(t, 1, m.KV().FreeBlocks())
		require.Empty(t, m.Mamba().FreeList(nil))
	}
	require.NoError(t, m.Free(100))
	require.Equal(t, Stats{RowsFree: 1, RowsReserved: 2, BlocksFree: 4, BlocksAvailable: 4, BlocksHeadroom: 1}, m.Stats())
}

func TestAddDummyRollback(t *testing.T) {
	// Without ADP, a warm-up dummy takes a real row and a block; with no
	// block free the row is given back.
	m := newManager(t, testConfig(2, 1, false))
	_, err := m.Prepare(1, 4)
	require.NoError(t, err)
	err = m.AddDummy(7)
	require.ErrorIs(t, err, kvcache.ErrNoFreeBlocks)
	_, ok := m.Mamba().Row(7)
	require.False(t, ok)
	require.Equal(t, 1, m.Stats().RowsFree)
}

// TestOriginalBugWithoutADP is the failure TensorRT-LLM PR #14853 fixed,
// through the manager and kept as it is without attention DP: a request in
// transfer holds the only real row and the pad with dummy id 0 fails.
func TestOriginalBugWithoutADP(t *testing.T) {
	m := newManager(t, testConfig(1, 8, false))
	_, err := m.Prepare(100, 4)
	require.NoError(t, err)
	require.ErrorIs(t, m.AddDummy(mambacache.ADPDummyID), mambacache.ErrNoFreeRows)
	held, _ := m.KV().Has(mambacache.ADPDummyID)
	require.False(t, held, "mamba first: the KV block was never taken")
}

func TestDummyIDs(t *testing.T) {
	c := testConfig(2, 8, true)
	c.Mamba.MaxDraftTokens = 1
	m := newManager(t, c)
	for _, id := range []uint64{mambacache.ADPDummyID, math.MaxUint64, math.MaxUint64 - 1} {
		_, err := m.Prepare(id, 4)
		require.ErrorIs(t, err, mambacache.ErrDummyID, "id %d", id)
		require.NoError(t, m.AddDummy(id), "id %d", id)
		require.NoError(t, m.AddDummy(id), "id %d: re-adding is idempotent", id)
		r, ok := m.Mamba().Row(id)
		require.True(t, ok)
		require.True(t, m.Mamba().IsReserved(r))
	}
	s := m.Stats()
	require.Equal(t, 2, s.RowsFree, "dummies on reserved rows take no real row")
	require.Equal(t, 3, s.BlocksUsed, "each dummy holds one block")
	require.Equal(t, 0, s.BlocksHeadroom, "the ADP dummy is placed")

	// A warm-up dummy takes a real row; a real request cannot be a dummy.
	require.NoError(t, m.AddDummy(math.MaxUint64-2))
	require.Equal(t, 1, m.Stats().RowsFree)
	_, err := m.Prepare(5, 4)
	require.NoError(t, err)
	require.ErrorIs(t, m.AddDummy(5), kvcache.ErrAlreadyExists)
	_, ok := m.Mamba().Row(5)
	require.True(t, ok, "a failed AddDummy keeps the request's row")

	for _, id := range []uint64{mambacache.ADPDummyID, math.MaxUint64, math.MaxUint64 - 1, math.MaxUint64 - 2, 5} {
		require.NoError(t, m.Free(id))
	}
	require.Equal(t, Stats{RowsFree: 2, RowsReserved: 2, BlocksFree: 8, BlocksAvailable: 8, BlocksHeadroom: 1}, m.Stats())
}
