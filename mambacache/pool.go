package mambacache

import (
	"fmt"
	"sync"
)

// Pool is the state row pool, with TensorRT-LLM's semantics: a LIFO free
// stack of rows, a request-id -> row map, and reserved rows popped at
// construction that are never handed to a real request and never return
// to the stack. It owns no memory: rows index an arena of
// Config.ArenaBytes() bytes held by the caller.
//
// Pool is safe for concurrent use: one mutex guards all state. It starts no
// goroutines and does no IO.
type Pool struct {
	mu      sync.Mutex
	cfg     Config
	free    []Row // LIFO stack: pop from the end, push on Free
	index   map[uint64]Row
	padding []Row // padding[i] pads draft length lens[i]
	lens    []int // PaddingDraftLens, increasing
	adp     Row
	hasADP  bool
	used    int // real rows held
	cks     checkpoints
}

// New builds the pool: rows 0..TotalRows-1 on the free stack, then pops
// the padding rows, one per reachable draft length in increasing order
// (TotalRows-1 first), and, with attention DP, the ADP row. What stays on
// the stack is the real capacity. It fails with ErrInvalidConfig when cfg
// does not validate.
func New(cfg Config) (*Pool, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	total := cfg.TotalRows()
	p := &Pool{
		cfg:   cfg,
		free:  make([]Row, total),
		index: make(map[uint64]Row, total),
		cks:   newCheckpoints(cfg.CheckpointRows),
	}
	for i := range p.free {
		p.free[i] = Row(i)
	}
	p.lens = cfg.PaddingDraftLens(nil)
	for range p.lens {
		p.padding = append(p.padding, p.pop())
	}
	if cfg.AttentionDP {
		p.adp, p.hasADP = p.pop(), true
	}
	return p, nil
}

func (p *Pool) pop() Row {
	n := len(p.free) - 1
	r := p.free[n]
	p.free = p.free[:n]
	return r
}

// Config returns the pool's config.
func (p *Pool) Config() Config { return p.cfg }

// Allocate gives real request id a row from the free stack. It is
// idempotent: an id that holds a row gets the same row back. Errors:
// ErrDummyID for a dummy id (see Config.IsDummyID), ErrNoFreeRows when the
// stack is empty (the pool is unchanged).
func (p *Pool) Allocate(id uint64) (Row, error) {
	if p.cfg.IsDummyID(id) {
		return 0, fmt.Errorf("%w: allocate %d", ErrDummyID, id)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if r, ok := p.index[id]; ok {
		return r, nil
	}
	return p.takeReal(id)
}

func (p *Pool) takeReal(id uint64) (Row, error) {
	if len(p.free) == 0 {
		return 0, fmt.Errorf("%w: id %d, %d real rows all held", ErrNoFreeRows, id, p.cfg.RealRows())
	}
	r := p.pop()
	p.index[id] = r
	p.used++
	return r, nil
}

// AddDummy places dummy request id, as TensorRT-LLM's add_dummy_requests:
// an id that holds a row keeps it; a padding sentinel id maps to the
// padding row of its draft length (PaddingSentinelID - id; with
// speculation off every sentinel shares the one padding row), and fails
// with ErrNoPaddingRow for a length with none; ADPDummyID maps to the ADP
// row when attention DP is on; any other id (a warm-up dummy, or
// ADPDummyID without attention DP) takes a real row and fails with
// ErrNoFreeRows when none is free.
func (p *Pool) AddDummy(id uint64) (Row, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r, ok := p.index[id]; ok {
		return r, nil
	}
	switch {
	case p.cfg.IsPaddingID(id):
		r, err := p.paddingRow(id)
		if err != nil {
			return 0, err
		}
		p.index[id] = r
		return r, nil
	case p.hasADP && id == ADPDummyID:
		p.index[id] = p.adp
		return p.adp, nil
	}
	return p.takeReal(id)
}

func (p *Pool) paddingRow(id uint64) (Row, error) {
	if p.cfg.DraftTokens <= 0 {
		return p.padding[0], nil
	}
	dl, _ := p.cfg.PaddingDraftLen(id)
	for i, l := range p.lens {
		if l == dl {
			return p.padding[i], nil
		}
	}
	return 0, fmt.Errorf("%w: id %d pads draft length %d, the pool pads %v", ErrNoPaddingRow, id, dl, p.lens)
}

// Free unmaps id. A real row goes back on top of the free stack; a
// reserved row stays reserved. Errors: ErrUnknownRequest.
func (p *Pool) Free(id uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	r, ok := p.index[id]
	if !ok {
		return fmt.Errorf("%w: free %d", ErrUnknownRequest, id)
	}
	delete(p.index, id)
	if !p.isReserved(r) {
		p.free = append(p.free, r)
		p.used--
	}
	return nil
}

// Row returns the row id holds.
func (p *Pool) Row(id uint64) (Row, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	r, ok := p.index[id]
	return r, ok
}

// IsReserved reports whether r is a padding row or the ADP row. A
// transfer must never name a reserved row.
func (p *Pool) IsReserved(r Row) bool { return p.isReserved(r) }

// The reserved rows are the top TotalRows-RealRows rows.
func (p *Pool) isReserved(r Row) bool {
	return int64(r) >= int64(p.cfg.RealRows()) && int64(r) < int64(p.cfg.TotalRows())
}

// Transferable reports whether r may be named by a transfer: a real row
// (Config.RoleOf). Reserved, checkpoint and scratch rows, and rows outside
// the arena, never may.
func (p *Pool) Transferable(r Row) bool {
	role, ok := p.cfg.RoleOf(r)
	return ok && role.Transferable()
}

// Capacity returns the real rows: what the scheduler may admit.
func (p *Pool) Capacity() int { return p.cfg.RealRows() }

// FreeRows returns the real rows on the free stack.
func (p *Pool) FreeRows() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.free)
}

// UsedRows returns the real rows held (by real requests or by dummies that
// took a real row).
func (p *Pool) UsedRows() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.used
}

// ReservedRows returns the number of reserved rows: the padding rows plus
// 1 with attention DP.
func (p *Pool) ReservedRows() int { return p.cfg.ReservedRows() }

// Requests returns the number of mapped ids, dummies on reserved rows
// included.
func (p *Pool) Requests() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.index)
}

// FreeList appends the free stack, bottom first (the next row handed out
// is the last), to dst and returns it.
func (p *Pool) FreeList(dst []Row) []Row {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append(dst, p.free...)
}
