package mambacache

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// harness drives a Pool and a naive model of TensorRT-LLM's slot manager
// (a Python list used as a stack, a dict, the reserved slots: one padding
// slot per reachable draft length, found by trying every batch size, and
// the ADP slot) with the same operations, and checks after every operation
// that they agree and that the pool's invariants hold.
type harness struct {
	t       testing.TB
	p       *Pool
	c       Config
	free    []Row // model stack
	index   map[uint64]Row
	padding Row         // speculation off: the one padding row
	pad     map[int]Row // speculation on: the padding row of each draft length
	adp     Row
	hasADP  bool
	ops     int
	list    []Row
	seen    []int
}

func newHarness(t testing.TB, c Config) *harness {
	p, err := New(c)
	require.NoError(t, err)
	h := &harness{t: t, p: p, c: c, index: map[uint64]Row{}}
	for r := range c.TotalRows() {
		h.free = append(h.free, Row(r))
	}
	h.pad = map[int]Row{}
	for _, dl := range naivePaddingLens(c) {
		h.pad[dl], h.free = h.free[len(h.free)-1], h.free[:len(h.free)-1]
	}
	h.padding = h.pad[0]
	if c.AttentionDP {
		h.adp, h.free, h.hasADP = h.free[len(h.free)-1], h.free[:len(h.free)-1], true
	}
	return h
}

// harnessID maps a selector byte to an id: a small space so operations
// collide, the ADP id, and ids around the padding sentinel range.
func harnessID(sel byte) uint64 {
	switch {
	case sel >= 240:
		return math.MaxUint64 - uint64(sel-240)%5 // MaxDraftTokens is 0..3 in tests
	case sel >= 200:
		return ADPDummyID
	}
	return uint64(sel % 10)
}

func (h *harness) isPadding(id uint64) bool {
	return id >= math.MaxUint64-uint64(h.c.MaxDraftTokens)
}

// naivePaddingLens is TensorRT-LLM's rule by brute force: the draft
// length of every batch size 1..MaxBatchSize, K without a schedule, 0
// with gating, in increasing order.
func naivePaddingLens(c Config) []int {
	if c.DraftTokens == 0 {
		return []int{0}
	}
	set := map[int]bool{}
	steps := c.DraftLenSchedule.Steps()
	if len(steps) == 0 {
		set[c.DraftTokens] = true
	}
	for b := 1; b <= c.MaxBatchSize && len(steps) > 0; b++ {
		dl := 0
		for _, e := range steps {
			if b <= e.MaxBatch {
				dl = e.DraftLen
				break
			}
		}
		set[dl] = true
	}
	if c.AcceptanceGating {
		set[0] = true
	}
	var lens []int
	for dl := range set {
		lens = append(lens, dl)
	}
	slices.Sort(lens)
	return lens
}

// paddingRow is the model's row for padding sentinel id.
func (h *harness) paddingRow(id uint64) (Row, bool) {
	if h.c.DraftTokens == 0 {
		return h.padding, true
	}
	r, ok := h.pad[int(math.MaxUint64-id)]
	return r, ok
}

func (h *harness) isReservedRow(r Row) bool {
	for _, p := range h.pad {
		if r == p {
			return true
		}
	}
	return h.hasADP && r == h.adp
}

func (h *harness) isDummy(id uint64) bool {
	return h.isPadding(id) || (h.hasADP && id == 0)
}

func (h *harness) popReal(id uint64) (Row, error) {
	if len(h.free) == 0 {
		return 0, ErrNoFreeRows
	}
	r := h.free[len(h.free)-1]
	h.free = h.free[:len(h.free)-1]
	h.index[id] = r
	return r, nil
}

func (h *harness) step(op, sel byte, arg byte) {
	id := harnessID(sel)
	var (
		wantRow Row
		wantErr error
		gotRow  Row
		gotErr  error
	)
	switch op % 4 {
	case 0: // Allocate
		r, ok := h.index[id]
		switch {
		case h.isDummy(id):
			wantErr = ErrDummyID
		case ok:
			wantRow = r
		default:
			wantRow, wantErr = h.popReal(id)
		}
		gotRow, gotErr = h.p.Allocate(id)
	case 1: // AddDummy
		r, ok := h.index[id]
		switch {
		case ok:
			wantRow = r
		case h.isPadding(id):
			var ok bool
			if wantRow, ok = h.paddingRow(id); ok {
				h.index[id] = wantRow
			} else {
				wantErr = ErrNoPaddingRow
			}
		case h.hasADP && id == ADPDummyID:
			wantRow = h.adp
			h.index[id] = wantRow
		default:
			wantRow, wantErr = h.popReal(id)
		}
		gotRow, gotErr = h.p.AddDummy(id)
	case 2, 3: // Free (op 3: a live id when there is one)
		if op%4 == 3 && len(h.index) > 0 {
			ids := make([]uint64, 0, len(h.index))
			for k := range h.index {
				ids = append(ids, k)
			}
			slices.Sort(ids)
			id = ids[int(arg)%len(ids)]
		}
		r, ok := h.index[id]
		if !ok {
			wantErr = ErrUnknownRequest
		} else {
			delete(h.index, id)
			if !h.isReservedRow(r) {
				h.free = append(h.free, r)
			}
		}
		gotErr = h.p.Free(id)
	}
	if (wantErr == nil) != (gotErr == nil) || (wantErr != nil && !errors.Is(gotErr, wantErr)) || (wantErr == nil && gotRow != wantRow) {
		require.Failf(h.t, "model disagrees", "op %d (%d on id %d): got row %d, %v; want row %d, %v",
			h.ops, op%4, id, gotRow, gotErr, wantRow, wantErr)
	}
	h.ops++
	h.check()
}

func (h *harness) check() {
	if err := h.checkInvariants(); err != nil {
		require.NoError(h.t, err, "op %d", h.ops)
	}
}

func (h *harness) checkInvariants() error {
	p := h.p
	total := h.c.TotalRows()
	h.list = p.FreeList(h.list[:0])
	if !slices.Equal(h.list, h.free) {
		return fmt.Errorf("free stack %v, model %v", h.list, h.free)
	}
	if cap(h.seen) < total {
		h.seen = make([]int, total)
	}
	seen := h.seen[:total]
	clear(seen)
	for _, r := range h.list {
		if p.IsReserved(r) {
			return fmt.Errorf("reserved row %d on the free stack", r)
		}
		seen[r]++
	}
	held := 0
	for id, r := range h.index {
		got, ok := p.Row(id)
		if !ok || got != r {
			return fmt.Errorf("id %d: row %d %v, model %d", id, got, ok, r)
		}
		if p.IsReserved(r) {
			if !h.c.IsDummyID(id) {
				return fmt.Errorf("real id %d on reserved row %d", id, r)
			}
			want, ok := h.paddingRow(id)
			if h.c.IsPaddingID(id) && (!ok || r != want) || !h.c.IsPaddingID(id) && h.isReservedRow(r) && r != h.adp {
				return fmt.Errorf("id %d on the wrong reserved row %d", id, r)
			}
			if role, _ := h.c.RoleOf(r); role.Transferable() {
				return fmt.Errorf("reserved row %d has role %s", r, role)
			}
			continue
		}
		if h.c.IsDummyID(id) {
			return fmt.Errorf("dummy id %d on real row %d", id, r)
		}
		seen[r]++
		held++
	}
	for r, n := range seen {
		reserved := p.IsReserved(Row(r))
		if reserved && n != 0 || !reserved && n != 1 {
			return fmt.Errorf("row %d: on the stack or held %d times", r, n)
		}
	}
	if p.FreeRows() != len(h.free) || p.UsedRows() != held || p.FreeRows()+p.UsedRows() != p.Capacity() ||
		p.Capacity() != h.c.MaxBatchSize*h.c.pp() || p.Requests() != len(h.index) {
		return fmt.Errorf("counts: free %d used %d cap %d requests %d", p.FreeRows(), p.UsedRows(), p.Capacity(), p.Requests())
	}
	return nil
}

func (h *harness) drain() {
	for id := range h.index {
		require.NoError(h.t, h.p.Free(id))
	}
	require.Equal(h.t, h.c.RealRows(), h.p.FreeRows())
	require.Equal(h.t, 0, h.p.UsedRows())
	require.Equal(h.t, 0, h.p.Requests())
	for _, r := range h.p.FreeList(nil) {
		require.False(h.t, h.p.IsReserved(r))
	}
}

// TestPropertyRandomOps runs 100k random operations over pool shapes with
// and without attention DP, checking every invariant after each.
func TestPropertyRandomOps(t *testing.T) {
	shapes := []struct {
		mbs, pp, draft int
		adp            bool
		k              int // speculation: DraftTokens (0: off)
		sched          string
		gating         bool
	}{
		{1, 0, 0, true, 0, "", false}, {1, 0, 0, false, 0, "", false}, {3, 2, 2, true, 0, "", false},
		{4, 1, 3, false, 0, "", false}, {8, 1, 1, true, 0, "", false},
		{8, 1, 3, true, 3, "1:3,2:2,4:1", false}, {1, 0, 3, true, 3, "1:3,4:1", true},
		{6, 1, 4, true, 2, "", true}, {5, 1, 3, false, 3, "2:3,4:0", false},
	}
	const opsPerShape = 100_000 / 8
	total := 0
	for i, s := range shapes {
		c := testConfig(s.mbs, s.adp)
		c.PPSize, c.MaxDraftTokens = s.pp, s.draft
		c.DraftTokens, c.AcceptanceGating = s.k, s.gating
		sched, err := ParseDraftSchedule(s.sched)
		require.NoError(t, err)
		c.DraftLenSchedule = sched
		h := newHarness(t, c)
		rng := rand.New(rand.NewPCG(uint64(i), 0x6d61))
		for range opsPerShape {
			h.step(byte(rng.IntN(4)), byte(rng.Uint32()), byte(rng.Uint32()))
		}
		total += h.ops
		h.drain()
	}
	require.GreaterOrEqual(t, total, 100_000)
}

// FuzzPool drives a pool from bytes: the first byte picks the shape, then
// each triple is (op, id selector, argument).
func FuzzPool(f *testing.F) {
	f.Add([]byte{0x11, 0, 1, 0, 1, 200, 0, 2, 200, 0, 1, 200, 0, 0, 200, 0})
	f.Add([]byte{0x00, 0, 1, 0, 1, 200, 0, 1, 255, 0, 3, 0, 0})
	f.Add([]byte{0x37, 0, 1, 0, 0, 2, 0, 0, 3, 0, 1, 241, 0, 1, 244, 0, 3, 9, 0})
	f.Add([]byte{0x0f, 0x07, 0, 1, 0, 1, 255, 0, 1, 254, 0, 1, 253, 0, 1, 252, 0, 3, 0, 0, 1, 200, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		c := testConfig(int(data[0]&7)+1, data[0]&8 != 0)
		c.PPSize = int(data[0]>>4) % 3
		c.MaxDraftTokens = int(data[0]>>6) % 4
		if len(data) > 1 && data[1]&1 != 0 { // speculation on
			c.MaxDraftTokens = 3
			c.DraftTokens, c.AcceptanceGating = 3, data[1]&2 != 0
			scheds := []string{"", "1:3,2:2,4:1", "2:3,4:0", "1:1"}
			c.DraftLenSchedule, _ = ParseDraftSchedule(scheds[int(data[1]>>2)%len(scheds)])
			data = data[1:]
		}
		h := newHarness(t, c)
		for data = data[1:]; len(data) >= 3 && h.ops < 5000; data = data[3:] {
			h.step(data[0], data[1], data[2])
		}
		h.drain()
	})
}

func TestHarnessCatchesLeaks(t *testing.T) {
	h := newHarness(t, testConfig(2, true))
	h.step(0, 5, 0) // Allocate(5)
	require.NoError(t, h.checkInvariants())
	h.p.free = append(h.p.free, h.p.adp) // a reserved row leaks onto the stack
	h.free = append(h.free, h.adp)
	require.ErrorContains(t, h.checkInvariants(), "reserved row")
	h.p.free, h.free = h.p.free[:len(h.p.free)-1], h.free[:len(h.free)-1]
	h.p.index[6] = h.p.index[5] // two ids share a real row
	h.index[6] = h.index[5]
	require.ErrorContains(t, h.checkInvariants(), "held 2 times")
}
