package kvcache

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// modelReq is the naive model's view of one request.
type modelReq struct {
	tokens, blocks int
	dummy          bool
}

// harness drives a Pool and a naive model with the same operations and
// checks, after every operation, that they agree and that the pool's
// invariants hold.
type harness struct {
	t       testing.TB
	p       *Pool
	model   map[uint64]*modelReq
	free    int
	total   int
	scratch []BlockID
	before  []BlockID
	runs    []Run
	owned   []bool
	ops     int
}

func newHarness(t testing.TB, blocks, tpb int) *harness {
	c := testConfig(blocks)
	c.TokensPerBlock = tpb
	p, err := New(c)
	require.NoError(t, err)
	return &harness{t: t, p: p, model: map[uint64]*modelReq{}, free: blocks, total: blocks}
}

// id maps a selector byte to a request id: mostly a small space, so that
// operations collide, plus a few extreme ids.
func harnessID(sel byte) uint64 {
	switch {
	case sel >= 250:
		return math.MaxUint64 - uint64(sel-250)
	case sel >= 240:
		return 0
	}
	return uint64(sel % 12)
}

// longestFree returns the longest stretch of blocks the model sees free.
func (h *harness) longestFree() int {
	if cap(h.owned) < h.total {
		h.owned = make([]bool, h.total)
	}
	owned := h.owned[:h.total]
	clear(owned)
	for id := range h.model {
		bs, err := h.p.Blocks(id, h.scratch[:0])
		require.NoError(h.t, err)
		for _, b := range bs {
			owned[b] = true
		}
		h.scratch = bs
	}
	best, cur := 0, 0
	for _, o := range owned {
		if o {
			cur = 0
			continue
		}
		cur++
		best = max(best, cur)
	}
	return best
}

func (h *harness) step(op, sel byte, arg uint16) {
	t := h.t
	id := harnessID(sel)
	m, exists := h.model[id]
	c := h.p.Config()
	tokens := int(arg%(uint16(c.TokensPerBlock)*20)) - 2 // occasionally invalid
	headroom := int(arg>>12) % 3
	var want error
	switch op % 6 {
	case 0, 4: // Allocate (op 4: with headroom)
		if op%6 == 0 {
			headroom = 0
		}
		need := c.BlocksFor(tokens)
		longest := h.longestFree()
		switch {
		case tokens < 1:
			want = ErrInvalidTokens
		case exists:
			want = ErrAlreadyExists
		case need+headroom > h.free:
			want = ErrNoFreeBlocks
		}
		err := h.p.AllocateWithHeadroom(id, tokens, headroom)
		h.expect(err, want, "allocate %d %d tokens headroom %d", id, tokens, headroom)
		if want == nil {
			h.model[id] = &modelReq{tokens: tokens, blocks: need}
			h.free -= need
			runs, err := h.p.Runs(id, h.runs[:0])
			require.NoError(t, err)
			h.runs = runs
			if need <= longest {
				require.Len(t, runs, 1, "op %d: %d blocks fit one free extent of %d: one run", h.ops, need, longest)
			}
		}
	case 1: // Grow
		if exists {
			tokens = m.tokens + int(arg%uint16(2*c.TokensPerBlock)) - 3
		}
		var need int
		switch {
		case tokens < 1:
			want = ErrInvalidTokens
		case !exists:
			want = ErrUnknownRequest
		default:
			need = max(c.BlocksFor(tokens)-m.blocks, 0)
			if need > 0 && need+headroom > h.free {
				want = ErrNoFreeBlocks
			}
		}
		if exists {
			bs, err := h.p.Blocks(id, h.before[:0])
			require.NoError(t, err)
			h.before = bs
		}
		err := h.p.GrowWithHeadroom(id, tokens, headroom)
		h.expect(err, want, "grow %d to %d headroom %d", id, tokens, headroom)
		if want == nil {
			m.blocks += need
			m.tokens = max(m.tokens, tokens)
			h.free -= need
			bs, err := h.p.Blocks(id, h.scratch[:0])
			require.NoError(t, err)
			h.scratch = bs
			require.Equal(t, h.before, bs[:len(h.before)], "growth keeps the earlier blocks in token order")
		}
	case 2: // AllocateDummy
		switch {
		case exists && m.dummy:
		case exists:
			want = ErrAlreadyExists
		case 1+headroom > h.free:
			want = ErrNoFreeBlocks
		}
		err := h.p.AllocateDummyWithHeadroom(id, headroom)
		h.expect(err, want, "dummy %d headroom %d", id, headroom)
		if want == nil && !exists {
			h.model[id] = &modelReq{tokens: 1, blocks: 1, dummy: true}
			h.free--
		}
	case 3, 5: // Free (op 5: a live id, when there is one)
		if op%6 == 5 && len(h.model) > 0 {
			ids := make([]uint64, 0, len(h.model))
			for k := range h.model {
				ids = append(ids, k)
			}
			slices.Sort(ids)
			id = ids[int(arg)%len(ids)]
			m, exists = h.model[id]
		}
		if !exists {
			want = ErrUnknownRequest
		}
		err := h.p.Free(id)
		h.expect(err, want, "free %d", id)
		if exists {
			h.free += m.blocks
			delete(h.model, id)
		}
	}
	h.ops++
	h.check(id)
}

func (h *harness) expect(err, want error, format string, args ...any) {
	if (want == nil && err == nil) || (want != nil && errors.Is(err, want)) {
		return
	}
	h.t.Helper()
	require.Failf(h.t, "unexpected result", "op %d: %s: got %v, want %v",
		h.ops, fmt.Sprintf(format, args...), err, want)
}

// check verifies the pool's invariants, its counters against the model,
// and the request touched by the last operation against the model; every
// 16 operations it compares every request.
func (h *harness) check(touched uint64) {
	t := h.t
	if err := h.p.checkInvariants(); err != nil {
		require.NoError(t, err, "op %d", h.ops)
	}
	if h.free != h.p.FreeBlocks() || h.total-h.free != h.p.UsedBlocks() || len(h.model) != h.p.Requests() {
		require.Failf(t, "counters", "op %d: free %d/%d used %d requests %d/%d", h.ops,
			h.p.FreeBlocks(), h.free, h.p.UsedBlocks(), h.p.Requests(), len(h.model))
	}
	if m, ok := h.model[touched]; ok {
		h.checkReq(touched, m)
	} else if held, _ := h.p.Has(touched); held {
		require.Failf(t, "leak", "op %d: id %d holds blocks, model has none", h.ops, touched)
	}
	if h.ops%16 != 0 {
		return
	}
	for id, m := range h.model {
		h.checkReq(id, m)
	}
}

func (h *harness) checkReq(id uint64, m *modelReq) {
	bs, err := h.p.Blocks(id, h.scratch[:0])
	h.scratch = bs
	n, terr := h.p.Tokens(id)
	held, dummy := h.p.Has(id)
	if err != nil || terr != nil || len(bs) != m.blocks || n != m.tokens || !held || dummy != m.dummy {
		require.Failf(h.t, "model disagrees", "op %d id %d: blocks %d/%d tokens %d/%d dummy %v/%v (%v, %v)",
			h.ops, id, len(bs), m.blocks, n, m.tokens, dummy, m.dummy, err, terr)
	}
}

// drain frees everything and checks the pool is back to its initial state.
func (h *harness) drain() {
	for id := range h.model {
		require.NoError(h.t, h.p.Free(id))
		delete(h.model, id)
	}
	h.free = h.total
	h.ops = 0
	h.check(0)
	require.Equal(h.t, h.total, h.p.FreeBlocks())
	require.Equal(h.t, 1, h.p.FreeExtents(), "everything free merges back into one extent")
	require.NoError(h.t, h.p.Allocate(1, h.total*h.p.Config().TokensPerBlock))
	rs, err := h.p.Runs(1, nil)
	require.NoError(h.t, err)
	require.Equal(h.t, []Run{{0, uint32(h.total)}}, rs)
	require.NoError(h.t, h.p.Free(1))
}

// TestPropertyRandomOps runs 100k random operations per pool shape against
// the naive model, checking every invariant after each.
func TestPropertyRandomOps(t *testing.T) {
	const opsPerShape = 100_000 / 4
	shapes := []struct{ blocks, tpb int }{{1, 2}, {7, 4}, {40, 4}, {96, 16}}
	total := 0
	for i, s := range shapes {
		rng := rand.New(rand.NewPCG(uint64(i), 0x6b76))
		h := newHarness(t, s.blocks, s.tpb)
		for range opsPerShape {
			// Bias towards allocation and growth so pools fill and fragment.
			op := []byte{0, 0, 1, 1, 1, 2, 3, 4, 5, 5}[rng.IntN(10)]
			h.step(op, byte(rng.Uint32()), uint16(rng.Uint32()))
		}
		total += h.ops
		h.drain()
	}
	require.GreaterOrEqual(t, total, 100_000)
}

// FuzzPool drives a pool from bytes: the first byte sizes the pool, then each
// triple is (op, id selector, argument).
func FuzzPool(f *testing.F) {
	f.Add([]byte{8, 0, 1, 50, 1, 1, 80, 2, 240, 0, 3, 1, 0, 5, 0, 0})
	f.Add([]byte{3, 0, 1, 255, 0, 2, 255, 2, 3, 0, 1, 1, 9, 3, 2, 0, 3, 3, 0})
	f.Add([]byte{64, 0, 1, 200, 0, 2, 100, 0, 3, 150, 3, 2, 0, 0, 4, 255, 1, 4, 7})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		blocks := int(data[0]%64) + 1
		h := newHarness(t, blocks, 4)
		data = data[1:]
		for len(data) >= 3 && h.ops < 2000 {
			h.step(data[0], data[1], uint16(data[2])<<3|uint16(data[0]>>3))
			data = data[3:]
		}
		h.drain()
	})
}

func TestHarnessCatchesDisagreement(t *testing.T) {
	// The invariant checker must notice a corrupted index.
	p := newPool(t, 8)
	require.NoError(t, p.Allocate(1, 4))
	require.NoError(t, p.checkInvariants())
	p.idx.headLen[1]++ // corrupt: extent [1,8) claims one more block
	require.Error(t, p.checkInvariants())
	p.idx.headLen[1]--
	p.idx.tailStart[7] = 0 // corrupt: lost tail tag
	require.Error(t, p.checkInvariants())
	p.idx.tailStart[7] = 2
	p.idx.free++ // corrupt: counter
	require.Error(t, p.checkInvariants())
	p.idx.free--
	p.slab[p.reqs[1]].runs[0].Len = 2 // a held run overlapping the free extent
	require.Error(t, p.checkInvariants())
	p.slab[p.reqs[1]].runs[0].Len = 1
	require.NoError(t, p.checkInvariants())
	require.True(t, errors.Is(p.Free(2), ErrUnknownRequest))
}
