package kvcache

import (
	"fmt"
	"sync"
)

// Pool is a paged block allocator. It owns no memory: it maps blocks to
// offsets of an arena of Config.ArenaBytes() bytes held by the caller.
//
// Pool is safe for concurrent use: one mutex guards all state and no
// method calls out while holding it. It starts no goroutines and does no IO.
type Pool struct {
	mu       sync.Mutex
	cfg      Config
	tpb      int
	idx      freeIndex
	reqs     map[uint64]int32 // request id -> index into slab
	slab     []request
	freeSlab []int32 // recycled slab entries, so steady state does not allocate
	cache    blockCache
	events   journal
	scratch  []int32
}

// request is one id's holding. runs are in token order.
type request struct {
	runs   []Run
	blocks int
	shared int // leading blocks held from the cache (AllocateShared)
	tokens int
	dummy  bool
}

// New returns a pool with every block free. It fails with ErrInvalidConfig
// when cfg does not validate.
func New(cfg Config) (*Pool, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	n := cfg.NumBlocks()
	return &Pool{
		cfg:   cfg,
		tpb:   cfg.TokensPerBlock,
		idx:   newFreeIndex(uint32(n)),
		reqs:  make(map[uint64]int32),
		cache: newBlockCache(n),
	}, nil
}

// Config returns the pool's config.
func (p *Pool) Config() Config { return p.cfg }

// Allocate gives request id room for tokens tokens: ceil(tokens /
// TokensPerBlock) blocks, as few runs as the free space allows (one run
// whenever a free extent is long enough). Errors: ErrInvalidTokens for
// tokens < 1, ErrAlreadyExists if id holds blocks, ErrNoFreeBlocks if too
// few blocks are free. On error the pool is unchanged.
func (p *Pool) Allocate(id uint64, tokens int) error {
	return p.AllocateWithHeadroom(id, tokens, 0)
}

// AllocateWithHeadroom is Allocate, but fails with ErrNoFreeBlocks unless
// at least headroom blocks stay free afterwards. A caller uses it to keep
// blocks aside for a request that must always be placeable.
func (p *Pool) AllocateWithHeadroom(id uint64, tokens, headroom int) error {
	if tokens < 1 {
		return fmt.Errorf("%w: allocate %d: %d tokens", ErrInvalidTokens, id, tokens)
	}
	if headroom < 0 {
		return fmt.Errorf("%w: allocate %d: headroom %d", ErrInvalidTokens, id, headroom)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.allocate(id, tokens, headroom, false)
}

// AllocateDummy gives dummy request id one block. Dummies (attention-DP
// padding, warm-up, CUDA-graph padding) hold one block like a one-token
// request. It is idempotent for an id that already holds a dummy; it fails
// with ErrAlreadyExists for an id held by a real request and with
// ErrNoFreeBlocks when nothing is free.
func (p *Pool) AllocateDummy(id uint64) error {
	return p.AllocateDummyWithHeadroom(id, 0)
}

// AllocateDummyWithHeadroom is AllocateDummy, but fails with
// ErrNoFreeBlocks unless at least headroom blocks stay free afterwards.
func (p *Pool) AllocateDummyWithHeadroom(id uint64, headroom int) error {
	if headroom < 0 {
		return fmt.Errorf("%w: dummy %d: headroom %d", ErrInvalidTokens, id, headroom)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if i, ok := p.reqs[id]; ok {
		if p.slab[i].dummy {
			return nil
		}
		return fmt.Errorf("%w: dummy %d is a real request", ErrAlreadyExists, id)
	}
	return p.allocate(id, 1, headroom, true)
}

func (p *Pool) allocate(id uint64, tokens, headroom int, dummy bool) error {
	if _, ok := p.reqs[id]; ok {
		return fmt.Errorf("%w: id %d", ErrAlreadyExists, id)
	}
	need := p.cfg.BlocksFor(tokens)
	if err := p.makeRoom(need, headroom); err != nil {
		return fmt.Errorf("%w: id %d", err, id)
	}
	i := p.newRequest()
	r := &p.slab[i]
	r.tokens, r.dummy = tokens, dummy
	p.take(r, need)
	p.reqs[id] = i
	return nil
}

// Grow ensures request id has room for tokens tokens in total, taking blocks
// as decode appends tokens. It prefers the blocks right after the request's
// last run, so a request growing on a quiet pool stays one run. A count at
// or below the current one only keeps the larger count. Errors:
// ErrInvalidTokens, ErrUnknownRequest, ErrNoFreeBlocks (pool unchanged).
func (p *Pool) Grow(id uint64, tokens int) error {
	return p.GrowWithHeadroom(id, tokens, 0)
}

// GrowWithHeadroom is Grow, but fails with ErrNoFreeBlocks unless at least
// headroom blocks stay free afterwards.
func (p *Pool) GrowWithHeadroom(id uint64, tokens, headroom int) error {
	if tokens < 1 {
		return fmt.Errorf("%w: grow %d: %d tokens", ErrInvalidTokens, id, tokens)
	}
	if headroom < 0 {
		return fmt.Errorf("%w: grow %d: headroom %d", ErrInvalidTokens, id, headroom)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.reqs[id]
	if !ok {
		return fmt.Errorf("%w: grow %d", ErrUnknownRequest, id)
	}
	r := &p.slab[i]
	need := p.cfg.BlocksFor(tokens) - r.blocks
	if need > 0 {
		if err := p.makeRoom(need, headroom); err != nil {
			return fmt.Errorf("%w: grow %d", err, id)
		}
		p.take(r, need)
	}
	r.tokens = max(r.tokens, tokens)
	return nil
}

// take moves k free blocks (k <= free) to r: first the extent right after
// r's last run, then one extent that fits the rest, then the largest
// extents until done.
func (p *Pool) take(r *request, k int) {
	left := uint32(k)
	if n := len(r.runs); n > 0 {
		end := uint32(r.runs[n-1].End())
		if end < p.idx.n && p.idx.headLen[end] != 0 {
			got := p.idx.takeFront(end, min(left, p.idx.headLen[end]))
			r.runs[n-1].Len += got.Len
			left -= got.Len
		}
	}
	for left > 0 {
		s := p.idx.fit(left)
		var got Run
		if s != none {
			got = p.idx.takeFront(uint32(s), left)
		} else {
			s = p.idx.largest()
			got = p.idx.takeFront(uint32(s), min(left, p.idx.headLen[s]))
		}
		if n := len(r.runs); n > 0 && r.runs[n-1].End() == got.Start {
			r.runs[n-1].Len += got.Len
		} else {
			r.runs = append(r.runs, got)
		}
		left -= got.Len
	}
	r.blocks += k
}

func (p *Pool) newRequest() int32 {
	if n := len(p.freeSlab); n > 0 {
		i := p.freeSlab[n-1]
		p.freeSlab = p.freeSlab[:n-1]
		return i
	}
	p.slab = append(p.slab, request{})
	return int32(len(p.slab) - 1)
}

// Free returns every block of request id to the pool, merging them with
// free neighbours. Errors: ErrUnknownRequest.
func (p *Pool) Free(id uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.reqs[id]
	if !ok {
		return fmt.Errorf("%w: free %d", ErrUnknownRequest, id)
	}
	r := &p.slab[i]
	k := 0           // the block's index in token order
	first := noBlock // r's first cached block
	for _, run := range r.runs {
		for b := run.Start; b < run.End(); b++ {
			if p.cache.meta[b].cached {
				if first == noBlock {
					first = int32(b)
				}
				if k >= r.shared {
					p.disown(int32(b)) // published by r
				}
			}
			k++
		}
	}
	// Last block first: a chain's cached blocks join the eviction order
	// tail first, so eviction takes a prefix's end before its start. Taken
	// from the start, the rest of the chain would stay cached but
	// unreachable (a match walks from the first block), holding room and
	// stopping the prefix from being published again.
	for j := len(r.runs) - 1; j >= 0; j-- {
		p.release(r.runs[j])
	}
	if first != noBlock {
		p.cache.refreshAncestors(first)
	}
	*r = request{runs: r.runs[:0]}
	delete(p.reqs, id)
	p.freeSlab = append(p.freeSlab, i)
	return nil
}

// release lets go of a run of a request, last block first: its cached
// blocks lose a holder, the others return to the free set.
func (p *Pool) release(run Run) {
	end := run.End()
	for b := run.End(); b > run.Start; {
		b--
		if !p.cache.meta[b].cached {
			continue
		}
		if b+1 < end {
			p.idx.release(Run{Start: b + 1, Len: uint32(end - b - 1)})
		}
		p.unhold(int32(b))
		end = b
	}
	if end > run.Start {
		p.idx.release(Run{Start: run.Start, Len: uint32(end - run.Start)})
	}
}

// Runs appends request id's runs, in token order, to dst and returns it.
func (p *Pool) Runs(id uint64, dst []Run) ([]Run, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.reqs[id]
	if !ok {
		return dst, fmt.Errorf("%w: runs of %d", ErrUnknownRequest, id)
	}
	return append(dst, p.slab[i].runs...), nil
}

// Blocks appends request id's blocks, in token order, to dst and returns it.
func (p *Pool) Blocks(id uint64, dst []BlockID) ([]BlockID, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.reqs[id]
	if !ok {
		return dst, fmt.Errorf("%w: blocks of %d", ErrUnknownRequest, id)
	}
	for _, r := range p.slab[i].runs {
		for b := r.Start; b < r.End(); b++ {
			dst = append(dst, b)
		}
	}
	return dst, nil
}

// Tokens returns the token count request id has room for: the largest
// count passed to Allocate or Grow (1 for a dummy).
func (p *Pool) Tokens(id uint64) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.reqs[id]
	if !ok {
		return 0, fmt.Errorf("%w: tokens of %d", ErrUnknownRequest, id)
	}
	return p.slab[i].tokens, nil
}

// HeldBlocks returns how many blocks request id holds, shared ones
// included; 0 for an unknown id. It allocates nothing (Blocks lists them).
func (p *Pool) HeldBlocks(id uint64) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.reqs[id]
	if !ok {
		return 0
	}
	return p.slab[i].blocks
}

// Has reports whether id holds blocks, and whether it holds them as a dummy.
func (p *Pool) Has(id uint64) (held, dummy bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.reqs[id]
	if !ok {
		return false, false
	}
	return true, p.slab[i].dummy
}

// FreeBlocks returns the number of free blocks.
func (p *Pool) FreeBlocks() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.idx.free
}

// UsedBlocks returns the number of blocks that are not free: held by
// requests or cached.
func (p *Pool) UsedBlocks() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return int(p.idx.n) - p.idx.free
}

// TotalBlocks returns the number of blocks of the pool.
func (p *Pool) TotalBlocks() int { return int(p.idx.n) }

// FreeExtents returns the number of maximal free extents: 1 on an idle
// pool, higher as the pool fragments.
func (p *Pool) FreeExtents() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.idx.extents
}

// Requests returns the number of ids holding blocks, dummies included.
func (p *Pool) Requests() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.reqs)
}
