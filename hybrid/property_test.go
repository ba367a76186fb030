package hybrid

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/stretchr/testify/require"
)

// modelReq is the naive model's view of one id.
type modelReq struct {
	reserved bool // on a reserved row
	blocks   int
	tokens   int
	kvDummy  bool
}

// harness drives a Manager and a naive counting model with the same
// operations and checks, after every operation, that they agree and that
// the manager's invariants hold.
type harness struct {
	t          testing.TB
	m          *Manager
	c          Config
	model      map[uint64]*modelReq
	rowsFree   int
	blocksFree int
	initial    Stats
	ops        int
	blocks     []kvcache.BlockID
	runs       []kvcache.Run
	owner      map[kvcache.BlockID]uint64
	rowOwner   map[mambacache.Row]uint64
}

func newHarness(t testing.TB, c Config) *harness {
	m, err := New(c)
	require.NoError(t, err)
	return &harness{
		t: t, m: m, c: c, model: map[uint64]*modelReq{},
		rowsFree: c.Mamba.RealRows(), blocksFree: c.KV.NumBlocks(), initial: m.Stats(),
		owner: map[kvcache.BlockID]uint64{}, rowOwner: map[mambacache.Row]uint64{},
	}
}

func harnessID(sel byte) uint64 {
	switch {
	case sel >= 245:
		return math.MaxUint64 - uint64(sel-245)%3 // MaxDraftTokens 1: two padding ids, one warm-up id
	case sel >= 215:
		return mambacache.ADPDummyID
	}
	return uint64(sel % 10)
}

func (h *harness) headroom() int {
	if _, placed := h.model[mambacache.ADPDummyID]; h.c.Mamba.AttentionDP && !placed {
		return 1
	}
	return 0
}

func (h *harness) step(op, sel byte, arg uint16) {
	id := harnessID(sel)
	r, exists := h.model[id]
	mc := h.c.Mamba
	tpb := h.c.KV.TokensPerBlock
	tokens := int(arg%uint16(12*tpb)) - 1
	hr := h.headroom()
	var want, got error
	var res Resources
	switch op % 6 {
	case 0: // Prepare
		need := h.c.KV.BlocksFor(tokens)
		if exists {
			need = max(need-r.blocks, 0)
		}
		switch {
		case tokens < 1:
			want = kvcache.ErrInvalidTokens
		case mc.IsDummyID(id):
			want = mambacache.ErrDummyID
		case !exists && h.rowsFree == 0:
			want = mambacache.ErrNoFreeRows
		case need > 0 && need+hr > h.blocksFree:
			want = kvcache.ErrNoFreeBlocks
		}
		res, got = h.m.PrepareTo(id, tokens, h.runs[:0])
		if want == nil {
			if !exists {
				r = &modelReq{}
				h.model[id] = r
				h.rowsFree--
			}
			r.blocks += need
			r.tokens = max(r.tokens, tokens)
			h.blocksFree -= need
			h.runs = res.Runs
		}
	case 1: // Grow
		if exists {
			tokens = r.tokens + int(arg%uint16(2*tpb)) - 2
		}
		if id == mambacache.ADPDummyID && mc.AttentionDP {
			hr = 0
		}
		var need int
		switch {
		case tokens < 1:
			want = kvcache.ErrInvalidTokens
		case !exists:
			want = kvcache.ErrUnknownRequest
		default:
			need = max(h.c.KV.BlocksFor(tokens)-r.blocks, 0)
			if need > 0 && need+hr > h.blocksFree {
				want = kvcache.ErrNoFreeBlocks
			}
		}
		got = h.m.Grow(id, tokens)
		if want == nil {
			r.blocks += need
			r.tokens = max(r.tokens, tokens)
			h.blocksFree -= need
		}
	case 2, 5: // AddDummy (op 5: the ADP pad, which must always succeed with attention DP)
		if op%6 == 5 {
			id = mambacache.ADPDummyID
			r, exists = h.model[id]
		}
		if id == mambacache.ADPDummyID && mc.AttentionDP {
			hr = 0
		}
		reserved := mc.IsDummyID(id)
		switch {
		case exists && r.kvDummy:
		case exists:
			want = kvcache.ErrAlreadyExists
		case !reserved && h.rowsFree == 0:
			want = mambacache.ErrNoFreeRows
		case 1+hr > h.blocksFree:
			want = kvcache.ErrNoFreeBlocks
		}
		if op%6 == 5 && mc.AttentionDP {
			require.NoError(h.t, want, "op %d: the model says the ADP pad cannot be placed", h.ops)
		}
		got = h.m.AddDummy(id)
		if want == nil && !exists {
			h.model[id] = &modelReq{reserved: reserved, blocks: 1, tokens: 1, kvDummy: true}
			h.blocksFree--
			if !reserved {
				h.rowsFree--
			}
		}
	case 3, 4: // Free (op 4: a live id when there is one)
		if op%6 == 4 && len(h.model) > 0 {
			ids := make([]uint64, 0, len(h.model))
			for k := range h.model {
				ids = append(ids, k)
			}
			slices.Sort(ids)
			id = ids[int(arg)%len(ids)]
			r, exists = h.model[id]
		}
		if !exists {
			want = kvcache.ErrUnknownRequest
		}
		got = h.m.Free(id)
		if exists {
			delete(h.model, id)
			h.blocksFree += r.blocks
			if !r.reserved {
				h.rowsFree++
			}
		}
	}
	if (want == nil) != (got == nil) || (want != nil && !errors.Is(got, want)) {
		require.Failf(h.t, "model disagrees", "op %d (%d on id %d, %d tokens): got %v, want %v",
			h.ops, op%6, id, tokens, got, want)
	}
	h.ops++
	if err := h.checkInvariants(int(arg >> 4)); err != nil {
		require.NoError(h.t, err, "op %d", h.ops)
	}
}

func (h *harness) checkInvariants(probeTokens int) error {
	m := h.m
	s := m.Stats()
	hr := h.headroom()
	want := Stats{
		RowsFree: h.rowsFree, RowsUsed: h.c.Mamba.RealRows() - h.rowsFree, RowsReserved: h.c.Mamba.ReservedRows(),
		BlocksFree: h.blocksFree, BlocksUsed: h.c.KV.NumBlocks() - h.blocksFree, BlocksHeadroom: hr,
		Requests: len(h.model), BlocksAvailable: h.blocksFree,
	}
	if s != want {
		return fmt.Errorf("stats %+v, model %+v", s, want)
	}
	// The attention-DP dummy can always be placed.
	if h.c.Mamba.AttentionDP && hr > 0 && s.BlocksFree < 1 {
		return fmt.Errorf("ADP dummy not placed and no block free")
	}
	if m.KV().Requests() != len(h.model) || m.Mamba().Requests() != len(h.model) {
		return fmt.Errorf("pools hold %d and %d ids, model %d", m.KV().Requests(), m.Mamba().Requests(), len(h.model))
	}
	clear(h.owner)
	clear(h.rowOwner)
	for id, r := range h.model {
		row, ok := m.Mamba().Row(id)
		if !ok || m.Mamba().IsReserved(row) != r.reserved {
			return fmt.Errorf("id %d: row %d %v, model reserved %v", id, row, ok, r.reserved)
		}
		if !r.reserved {
			if o, dup := h.rowOwner[row]; dup {
				return fmt.Errorf("row %d held by %d and %d", row, o, id)
			}
			h.rowOwner[row] = id
		}
		bs, err := m.KV().Blocks(id, h.blocks[:0])
		h.blocks = bs
		if err != nil || len(bs) != r.blocks {
			return fmt.Errorf("id %d: %d blocks (%v), model %d", id, len(bs), err, r.blocks)
		}
		for _, b := range bs {
			if o, dup := h.owner[b]; dup {
				return fmt.Errorf("block %d held by %d and %d", b, o, id)
			}
			h.owner[b] = id
		}
	}
	if len(h.owner) != s.BlocksUsed || len(h.rowOwner) != s.RowsUsed {
		return fmt.Errorf("held blocks %d rows %d, stats %+v", len(h.owner), len(h.rowOwner), s)
	}
	rows, blocks := m.Capacity()
	if rows != h.c.Mamba.RealRows() || blocks != h.c.KV.NumBlocks()-boolInt(h.c.Mamba.AttentionDP) {
		return fmt.Errorf("capacity %d rows %d blocks", rows, blocks)
	}
	probe := probeTokens%(8*h.c.KV.TokensPerBlock) + 1
	wantAdmit := h.rowsFree > 0 && h.blocksFree-hr >= h.c.KV.BlocksFor(probe)
	if m.CanAdmit(probe) != wantAdmit {
		return fmt.Errorf("CanAdmit(%d) = %v, model %v", probe, !wantAdmit, wantAdmit)
	}
	return nil
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (h *harness) drain() {
	for id := range h.model {
		require.NoError(h.t, h.m.Free(id))
		delete(h.model, id)
	}
	require.Equal(h.t, h.initial, h.m.Stats(), "counts return to initial")
	require.Equal(h.t, 1, h.m.KV().FreeExtents())
}

// TestPropertyRandomOps runs 100k random operations over manager shapes,
// with and without attention DP, checking every invariant after each.
func TestPropertyRandomOps(t *testing.T) {
	shapes := []struct {
		mbs, blocks int
		adp         bool
	}{{1, 2, true}, {1, 4, false}, {2, 6, true}, {4, 24, true}, {4, 24, false}}
	const opsPerShape = 100_000 / 5
	total := 0
	for i, s := range shapes {
		c := testConfig(s.mbs, s.blocks, s.adp)
		c.Mamba.MaxDraftTokens = 1
		h := newHarness(t, c)
		rng := rand.New(rand.NewPCG(uint64(i), 0x6879))
		for range opsPerShape {
			op := []byte{0, 0, 0, 1, 1, 2, 3, 4, 4, 5}[rng.IntN(10)]
			h.step(op, byte(rng.Uint32()), uint16(rng.Uint32()))
		}
		total += h.ops
		h.drain()
	}
	require.GreaterOrEqual(t, total, 100_000)
}

// FuzzManager drives a manager from bytes: the first byte picks the shape,
// then each triple is (op, id selector, argument).
func FuzzManager(f *testing.F) {
	f.Add([]byte{0x09, 0, 100, 13, 5, 0, 0, 3, 215, 0, 5, 0, 0, 4, 0, 0})
	f.Add([]byte{0x00, 0, 1, 4, 2, 215, 0, 2, 7, 0, 3, 7, 0})
	f.Add([]byte{0x5b, 0, 1, 40, 0, 2, 40, 1, 1, 90, 2, 245, 0, 2, 246, 0, 2, 247, 0, 4, 0, 1})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		c := testConfig(int(data[0]&3)+1, int(data[0]>>4)+2, data[0]&8 != 0)
		c.Mamba.MaxDraftTokens = 1
		h := newHarness(t, c)
		for data = data[1:]; len(data) >= 3 && h.ops < 3000; data = data[3:] {
			h.step(data[0], data[1], uint16(data[2])|uint16(data[0]&0xf8)<<5)
		}
		h.drain()
	})
}
