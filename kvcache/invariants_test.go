package kvcache

import (
	"fmt"
	"math/bits"
)

// checkInvariants verifies the pool's internal consistency. It checks that:
//   - runs are non-empty, inside the pool, and not adjacent within a request;
//   - no block belongs to two requests unless it is cached, a cached block
//     counts exactly its holders and is on the LRU list exactly when it
//     has none, and no held or cached block is free;
//   - the free extents are maximal, tagged at both ends, listed in the right
//     size class exactly once, and cover exactly the blocks nobody holds;
//   - the counters agree with the sets.
func (p *Pool) checkInvariants() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := int(p.idx.n)
	// state[b]: 0 not yet seen, 1 held, 2 free.
	const unseen, held, free = 0, 1, 2
	state := make([]uint8, n)
	holders := make([]int32, n)
	owners := make([]int32, n) // requests holding b as their own, not shared
	usedBlocks := 0
	liveSlab := make(map[int32]bool, len(p.reqs))
	for id, si := range p.reqs {
		if liveSlab[si] {
			return fmt.Errorf("slab entry %d shared", si)
		}
		liveSlab[si] = true
		r := p.slab[si]
		count := 0
		idx := 0 // token-order index of the block
		for k, run := range r.runs {
			if run.Len == 0 || int(run.End()) > n {
				return fmt.Errorf("id %d: bad run %+v", id, run)
			}
			if k > 0 && r.runs[k-1].End() == run.Start {
				return fmt.Errorf("id %d: adjacent runs %+v %+v not merged", id, r.runs[k-1], run)
			}
			for b := run.Start; b < run.End(); b++ {
				holders[b]++
				if idx >= r.shared {
					owners[b]++
				}
				idx++
				if state[b] != unseen && !p.cache.meta[b].cached {
					return fmt.Errorf("block %d held twice (second holder %d)", b, id)
				}
				if state[b] == unseen {
					usedBlocks++
				}
				state[b] = held
			}
			count += int(run.Len)
		}
		if count != r.blocks {
			return fmt.Errorf("id %d: %d blocks in runs, %d counted", id, count, r.blocks)
		}
		if want := p.cfg.BlocksFor(r.tokens); r.blocks < want {
			return fmt.Errorf("id %d: %d blocks for %d tokens", id, r.blocks, r.tokens)
		}
	}
	// The cache: names, holder counts, the LRU list.
	if err := p.checkCache(holders); err != nil {
		return err
	}
	unowned := 0
	for b := range n {
		m := p.cache.meta[b]
		if owners[b] > 1 || m.cached && m.owned != (owners[b] == 1) {
			return fmt.Errorf("block %d: %d own holders, owned %v", b, owners[b], m.owned)
		}
		if m.cached && m.ref > 0 && !m.owned {
			unowned++
		}
	}
	if unowned != p.cache.unowned {
		return fmt.Errorf("%d cached blocks held only as shared, counted %d", unowned, p.cache.unowned)
	}
	for b := range n {
		if m := p.cache.meta[b]; m.cached && state[b] == unseen {
			state[b] = held
			usedBlocks++
		}
	}
	for _, si := range p.freeSlab {
		if liveSlab[si] {
			return fmt.Errorf("slab entry %d both live and free", si)
		}
	}
	if len(p.freeSlab)+len(p.reqs) != len(p.slab) {
		return fmt.Errorf("slab: %d free + %d live != %d", len(p.freeSlab), len(p.reqs), len(p.slab))
	}
	// Free extents, walked through the class lists.
	freeBlocks, extents := 0, 0
	for c := range numClasses {
		if (p.idx.classMask&(1<<c) != 0) != (p.idx.classHead[c] != none) {
			return fmt.Errorf("class %d: mask and head disagree", c)
		}
		prev := int32(none)
		for s := p.idx.classHead[c]; s != none; s = p.idx.next[s] {
			if p.idx.prev[s] != prev {
				return fmt.Errorf("extent %d: prev link %d, want %d", s, p.idx.prev[s], prev)
			}
			prev = s
			l := p.idx.headLen[s]
			if l == 0 || bits.Len32(l)-1 != c {
				return fmt.Errorf("extent %d of length %d in class %d", s, l, c)
			}
			end := int(s) + int(l)
			if end > n || p.idx.tailStart[end-1] != uint32(s)+1 {
				return fmt.Errorf("extent %d: bad tail tag", s)
			}
			if s > 0 && p.idx.tailStart[s-1] != 0 || end < n && p.idx.headLen[end] != 0 {
				return fmt.Errorf("extent %d: touches another free extent", s)
			}
			for b := int(s); b < end; b++ {
				if state[b] != unseen {
					return fmt.Errorf("free block %d also held or listed twice", b)
				}
				state[b] = free
			}
			freeBlocks += int(l)
			extents++
		}
	}
	for b, st := range state {
		if st == unseen {
			return fmt.Errorf("block %d neither free nor held", b)
		}
		if st == held && (p.idx.headLen[b] != 0 || p.idx.tailStart[b] != 0) {
			return fmt.Errorf("held block %d carries a free tag", b)
		}
	}
	if freeBlocks != p.idx.free || extents != p.idx.extents || freeBlocks+usedBlocks != n {
		return fmt.Errorf("counts: free %d/%d extents %d/%d used %d total %d", freeBlocks, p.idx.free, extents, p.idx.extents, usedBlocks, n)
	}
	return nil
}

func (p *Pool) checkCache(holders []int32) error {
	c := &p.cache
	cached := 0
	for b, m := range c.meta {
		if !m.cached {
			if m.ref != 0 || len(m.tokens) != 0 {
				return fmt.Errorf("uncached block %d: ref %d, %d tokens", b, m.ref, len(m.tokens))
			}
			continue
		}
		cached++
		if m.ref != holders[b] {
			return fmt.Errorf("cached block %d: ref %d, %d holders", b, m.ref, holders[b])
		}
		if got, ok := c.byHash[m.hash]; !ok || got != int32(b) {
			return fmt.Errorf("cached block %d not indexed by its name", b)
		}
		if len(m.tokens) != p.tpb {
			return fmt.Errorf("cached block %d holds %d tokens", b, len(m.tokens))
		}
		if m.parent != noBlock && !c.meta[m.parent].cached {
			// A parent may be evicted before its child: the child is then
			// unreachable, which is allowed; but it must not point at itself.
			if m.parent == int32(b) {
				return fmt.Errorf("cached block %d continues itself", b)
			}
		}
	}
	if cached != len(c.byHash) {
		return fmt.Errorf("%d cached blocks, %d names", cached, len(c.byHash))
	}
	listed, prev := 0, noBlock
	for b := c.head; b != noBlock; b = c.meta[b].next {
		m := c.meta[b]
		if !m.cached || m.ref != 0 || m.prev != prev {
			return fmt.Errorf("lru: block %d cached %v ref %d prev %d (want %d)", b, m.cached, m.ref, m.prev, prev)
		}
		prev = b
		listed++
		if listed > len(c.meta) {
			return fmt.Errorf("lru: cycle")
		}
	}
	if prev != c.tail || listed != c.evictable {
		return fmt.Errorf("lru: %d listed, %d evictable, tail %d/%d", listed, c.evictable, prev, c.tail)
	}
	unheld := 0
	for _, m := range c.meta {
		if m.cached && m.ref == 0 {
			unheld++
		}
	}
	if unheld != listed {
		return fmt.Errorf("lru: %d unheld cached blocks, %d listed", unheld, listed)
	}
	return nil
}
