package mambacache

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

func ckConfig(mbs, cks int, adp bool) Config {
	c := testConfig(mbs, adp)
	c.CheckpointRows = cks
	return c
}

func TestCheckpointRowsAreARoleOfTheirOwn(t *testing.T) {
	c := ckConfig(2, 2, true)
	p := newPool(t, c)
	require.Equal(t, 4, c.TotalRows(), "TensorRT-LLM's rows are unchanged")
	require.Equal(t, 6, c.ArenaRows())
	require.Equal(t, Row(3), c.PaddingRow())
	require.Equal(t, 2, p.Capacity(), "checkpoint rows are not capacity")
	for _, r := range []Row{4, 5} {
		require.True(t, c.IsCheckpointRow(r))
		require.False(t, p.IsReserved(r))
	}
	for _, r := range []Row{0, 1, 2, 3} {
		require.False(t, c.IsCheckpointRow(r), "a real or reserved row is never a checkpoint row")
	}
	// Dummies and real requests never get a checkpoint row.
	for id := uint64(1); id <= 2; id++ {
		r, err := p.Allocate(id)
		require.NoError(t, err)
		require.False(t, c.IsCheckpointRow(r))
	}
	_, err := p.Allocate(3)
	require.ErrorIs(t, err, ErrNoFreeRows, "free checkpoint rows are not real rows")
	_, err = p.AddDummy(77)
	require.ErrorIs(t, err, ErrNoFreeRows, "nor are they a warm-up dummy's")
	r, err := p.AddDummy(ADPDummyID)
	require.NoError(t, err)
	require.Equal(t, Row(2), r)
	// A reserved row cannot be filled as a checkpoint.
	_, err = p.FillCheckpoint(c.PaddingRow(), PrefixHash{}, nil, 4)
	require.ErrorIs(t, err, ErrNotCheckpoint)
	_, err = p.FillCheckpoint(r, PrefixHash{}, nil, 4)
	require.ErrorIs(t, err, ErrNotCheckpoint)
}

func TestCheckpointFindsTheLongestExactPrefix(t *testing.T) {
	p := newPool(t, ckConfig(1, 4, false))
	parent := PrefixHash{1}
	fill := func(partial []int32, tokens int) Row {
		r, _, err := p.NewCheckpoint()
		require.NoError(t, err)
		dup, err := p.FillCheckpoint(r, parent, partial, tokens)
		require.NoError(t, err)
		require.False(t, dup)
		return r
	}
	a := fill([]int32{5}, 9)
	b := fill([]int32{5, 6, 7}, 11)
	r, n, ok := p.FindCheckpoint(parent, []int32{5, 6, 7, 8}, 4)
	require.True(t, ok)
	require.Equal(t, b, r)
	require.Equal(t, 3, n)
	r, n, ok = p.FindCheckpoint(parent, []int32{5, 6, 7}, 2)
	require.True(t, ok, "maxPartial keeps a token to compute")
	require.Equal(t, a, r)
	require.Equal(t, 1, n)
	_, _, ok = p.FindCheckpoint(parent, []int32{6}, 4)
	require.False(t, ok, "tokens are compared, not only the parent")
	_, _, ok = p.FindCheckpoint(PrefixHash{2}, []int32{5}, 4)
	require.False(t, ok)
	r, _, err := p.NewCheckpoint()
	require.NoError(t, err)
	dup, err := p.FillCheckpoint(r, parent, []int32{5}, 9)
	require.NoError(t, err)
	require.True(t, dup, "one checkpoint per prefix")
	require.Equal(t, CheckpointState{Free: 2, Ready: 2}, p.Checkpoints())
}

func TestCheckpointPinnedIsNeverEvicted(t *testing.T) {
	p := newPool(t, ckConfig(1, 2, false))
	var rows []Row
	for i := range 2 {
		r, _, err := p.NewCheckpoint()
		require.NoError(t, err)
		_, err = p.FillCheckpoint(r, PrefixHash{byte(i)}, nil, 4)
		require.NoError(t, err)
		rows = append(rows, r)
	}
	require.NoError(t, p.PinCheckpoint(rows[0])) // the oldest
	r, evicted, err := p.NewCheckpoint()
	require.NoError(t, err)
	require.True(t, evicted)
	require.Equal(t, rows[1], r, "the pinned one survives; the other goes")
	_, _, err = p.NewCheckpoint()
	require.ErrorIs(t, err, ErrNoCheckpointRow, "one filling, one pinned: nothing to take")
	require.NoError(t, p.AbortCheckpoint(r))
	require.NoError(t, p.UnpinCheckpoint(rows[0]))
	require.ErrorIs(t, p.UnpinCheckpoint(rows[0]), ErrNotCheckpoint)
	require.Equal(t, CheckpointState{Free: 1, Ready: 1}, p.Checkpoints())
}

// TestCheckpointDemotedIsEvictedFirst: a demoted checkpoint goes before
// older ones; a pinned one is not moved, and a free row is refused.
func TestCheckpointDemotedIsEvictedFirst(t *testing.T) {
	p := newPool(t, ckConfig(1, 3, false))
	var rows []Row
	for i := range 3 {
		r, _, err := p.NewCheckpoint()
		require.NoError(t, err)
		_, err = p.FillCheckpoint(r, PrefixHash{byte(i)}, nil, 4)
		require.NoError(t, err)
		rows = append(rows, r)
	}
	demoted, err := p.DemoteCheckpoint(rows[2]) // the newest
	require.NoError(t, err)
	require.True(t, demoted)
	r, evicted, err := p.NewCheckpoint()
	require.NoError(t, err)
	require.True(t, evicted)
	require.Equal(t, rows[2], r, "the demoted one goes first")
	_, err = p.DemoteCheckpoint(r)
	require.ErrorIs(t, err, ErrNotCheckpoint, "a filling row is no ready checkpoint")
	require.NoError(t, p.AbortCheckpoint(r))

	require.NoError(t, p.PinCheckpoint(rows[1]))
	demoted, err = p.DemoteCheckpoint(rows[1]) // pinned: stays off the list
	require.NoError(t, err)
	require.False(t, demoted)
	r, _, err = p.NewCheckpoint()
	require.NoError(t, err)
	r2, evicted, err := p.NewCheckpoint()
	require.NoError(t, err)
	require.True(t, evicted)
	require.Equal(t, rows[0], r2, "the pinned one survives its demotion")
	require.NoError(t, p.AbortCheckpoint(r))
	require.NoError(t, p.AbortCheckpoint(r2))
	require.NoError(t, p.UnpinCheckpoint(rows[1]))
}

// TestCheckpointProperty runs random checkpoint operations against a
// reference model: a found checkpoint is always ready, of that parent and
// those tokens, and the longest; pinned ones survive; the counts add up;
// real and reserved rows are untouched throughout.
func TestCheckpointProperty(t *testing.T) {
	const n = 6
	c := ckConfig(3, n, true)
	p := newPool(t, c)
	type ref struct {
		parent  PrefixHash
		partial []int32
		pins    int
		filling bool
	}
	model := map[Row]*ref{}
	rng := rand.New(rand.NewPCG(3, 5))
	randPartial := func() []int32 {
		out := make([]int32, rng.IntN(4))
		for i := range out {
			out[i] = int32(rng.IntN(2))
		}
		return out
	}
	ops := 100_000
	if testing.Short() {
		ops = 20_000
	}
	for op := range ops {
		switch rng.IntN(6) {
		case 0, 1:
			r, evicted, err := p.NewCheckpoint()
			if err != nil {
				require.ErrorIs(t, err, ErrNoCheckpointRow)
				for _, m := range model {
					require.True(t, m.filling || m.pins > 0, "op %d: refused with an evictable checkpoint", op)
				}
				break
			}
			require.True(t, c.IsCheckpointRow(r))
			if evicted {
				m := model[r]
				require.NotNil(t, m)
				require.False(t, m.filling)
				require.Zero(t, m.pins, "op %d: a pinned checkpoint was evicted", op)
			} else {
				require.Nil(t, model[r])
			}
			model[r] = &ref{filling: true}
		case 2:
			for r, m := range model {
				if !m.filling {
					continue
				}
				if rng.IntN(4) == 0 {
					require.NoError(t, p.AbortCheckpoint(r))
					delete(model, r)
					break
				}
				parent, partial := PrefixHash{byte(rng.IntN(3))}, randPartial()
				dup, err := p.FillCheckpoint(r, parent, partial, 8+len(partial))
				require.NoError(t, err)
				var exists bool
				for _, o := range model {
					exists = exists || (!o.filling && o.parent == parent && equal(o.partial, partial))
				}
				require.Equal(t, exists, dup)
				if dup {
					delete(model, r)
				} else {
					m.filling, m.parent, m.partial = false, parent, partial
				}
				break
			}
		case 3:
			parent, rest := PrefixHash{byte(rng.IntN(3))}, randPartial()
			maxP := rng.IntN(4)
			r, got, ok := p.FindCheckpoint(parent, rest, maxP)
			best := -1
			for _, o := range model {
				if !o.filling && o.parent == parent && len(o.partial) <= maxP && len(o.partial) <= len(rest) && equal(o.partial, rest[:len(o.partial)]) {
					best = max(best, len(o.partial))
				}
			}
			require.Equal(t, best >= 0, ok)
			if ok {
				m := model[r]
				require.False(t, m.filling)
				require.Equal(t, parent, m.parent)
				require.Equal(t, rest[:got], m.partial)
				require.Equal(t, best, got)
			}
		case 4:
			for r, m := range model {
				if !m.filling {
					require.NoError(t, p.PinCheckpoint(r))
					m.pins++
					break
				}
			}
		case 5:
			for r, m := range model {
				if m.pins > 0 {
					require.NoError(t, p.UnpinCheckpoint(r))
					m.pins--
					break
				}
			}
		}
		var want CheckpointState
		for _, m := range model {
			switch {
			case m.filling:
				want.Filling++
			case m.pins > 0:
				want.Pinned++
			default:
				want.Ready++
			}
		}
		want.Free = n - len(model)
		require.Equal(t, want, p.Checkpoints(), "op %d", op)
	}
	require.Equal(t, 3, p.FreeRows(), "real rows untouched")
	require.Equal(t, 0, p.UsedRows())
}
