package kvcache

import (
	"fmt"
	"slices"
)

// BlockHash names a full block by its whole prefix (BlockHash: the
// caller computes names; the pool only stores and compares them).
type BlockHash = [32]byte

// The prefix cache. A full block whose tokens a request has computed can be
// published under its prefix name (package prefix): it becomes read-only
// and shared, and outlives the request. Each cached block counts its
// holders; one nobody holds stays cached, on an LRU list, until a request
// needs the room, and is evicted then (oldest first). A request that hits
// holds the cached blocks of its prefix as the first blocks of its runs and
// never writes them (copy on read: it computes into blocks of its own from
// the first block it does not share).
//
// A cached block keeps the tokens it holds and the block it continues, and
// Match accepts a chain only block by block from the first: a name
// collision can make a block uncacheable, never serve another prefix's
// bytes (see package prefix).

const noBlock = int32(-1)

// cacheMeta is the cache's record of one block.
type cacheMeta struct {
	cached     bool
	owned      bool  // its publisher holds it still (as one of its own blocks)
	ref        int32 // holders of a cached block
	parent     int32 // cached block this one continues, noBlock for a first block
	hash       BlockHash
	parentHash BlockHash // parent's name when it was published (events)
	// gen counts the block's evictions; parentGen is the parent's gen when
	// this block was published under it. A block continues only the parent
	// it was published under, not a later prefix cached in the same block
	// (linked): once its parent is evicted it is unreachable until evicted
	// itself, as a router that saw the parent removed assumes.
	gen, parentGen uint32
	tokens         []int32 // the TokensPerBlock tokens it holds
	prev, next     int32   // LRU links while cached and unheld
}

// blockCache is the Pool's cache state, guarded by Pool.mu.
type blockCache struct {
	meta      []cacheMeta
	byHash    map[BlockHash]int32
	head      int32 // least recently released unheld cached block
	tail      int32
	evictable int // cached blocks no request holds
	unowned   int // cached blocks held only by requests that share them
	evictions uint64
}

func newBlockCache(n int) blockCache {
	c := blockCache{meta: make([]cacheMeta, n), byHash: make(map[BlockHash]int32), head: noBlock, tail: noBlock}
	for i := range c.meta {
		c.meta[i].parent, c.meta[i].prev, c.meta[i].next = noBlock, noBlock, noBlock
	}
	return c
}

func (c *blockCache) unlink(b int32) {
	m := &c.meta[b]
	if m.prev != noBlock {
		c.meta[m.prev].next = m.next
	} else {
		c.head = m.next
	}
	if m.next != noBlock {
		c.meta[m.next].prev = m.prev
	} else {
		c.tail = m.prev
	}
	m.prev, m.next = noBlock, noBlock
	c.evictable--
}

func (c *blockCache) pushBack(b int32) {
	m := &c.meta[b]
	m.prev, m.next = c.tail, noBlock
	if c.tail != noBlock {
		c.meta[c.tail].next = b
	} else {
		c.head = b
	}
	c.tail = b
	c.evictable++
}

// refreshAncestors moves b's unheld cached ancestors, nearest first, to
// the back of the eviction order. A request's chain continues blocks it
// never held when it computed a prefix another request had just published
// (Publish keeps the cached copy): let go after its own blocks, those
// ancestors would be evicted before them and leave them unreachable.
func (c *blockCache) refreshAncestors(b int32) {
	for {
		m := &c.meta[b]
		pb := m.parent
		if pb == noBlock || !c.linked(m, pb) {
			return
		}
		if c.meta[pb].ref == 0 {
			c.unlink(pb)
			c.pushBack(pb)
		}
		b = pb
	}
}

// linked reports whether cached block m continues block parent (noBlock:
// m is a first block) as it was when m was published.
func (c *blockCache) linked(m *cacheMeta, parent int32) bool {
	return m.parent == parent && (parent == noBlock || m.parentGen == c.meta[parent].gen)
}

// orphan reports whether cached m's parent was evicted since m was
// published under it: no prompt reaches m any more.
func (c *blockCache) orphan(m *cacheMeta) bool {
	return m.parent != noBlock && !c.linked(m, m.parent)
}

// hold adds a holder to cached block b.
func (c *blockCache) hold(b int32) {
	m := &c.meta[b]
	if m.ref == 0 {
		c.unlink(b)
		c.unowned++ // unheld, it had no publisher holding it
	}
	m.ref++
}

// Match returns how many leading blocks of tokens are cached: the longest
// k such that chain[:k] (prefix.Chain of tokens) names cached blocks that
// hold tokens[:k*TokensPerBlock], each continuing the one before.
func (p *Pool) Match(chain []BlockHash, tokens []int32) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	k, _ := p.match(chain, tokens, nil)
	return k
}

// Unheld returns how many of the first k blocks Match found for tokens
// no request holds now: the blocks that sharing them would take out of
// the evictable ones.
func (p *Pool) Unheld(chain []BlockHash, tokens []int32, k int) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, blocks := p.match(chain[:min(k, len(chain))], tokens, p.scratch[:0])
	n := 0
	for _, b := range blocks {
		if p.cache.meta[b].ref == 0 {
			n++
		}
	}
	p.scratch = blocks[:0]
	return n
}

func (p *Pool) match(chain []BlockHash, tokens []int32, dst []int32) (int, []int32) {
	parent := noBlock
	for i, h := range chain {
		b, ok := p.cache.byHash[h]
		if !ok {
			return i, dst
		}
		m := &p.cache.meta[b]
		lo := i * p.tpb
		if !p.cache.linked(m, parent) || lo+p.tpb > len(tokens) || !slices.Equal(m.tokens, tokens[lo:lo+p.tpb]) {
			return i, dst // a collision, or a chain cached from another parent
		}
		dst = append(dst, b)
		parent = b
	}
	return len(chain), dst
}

// AllocateShared is AllocateWithHeadroom for a request whose first shared
// blocks are the cached blocks chain[:shared] names (Match must have found
// at least that many for tokens): they become the first blocks of its
// runs, held read-only, and the rest of room for total tokens comes from
// free blocks, evicting unheld cached blocks when too few are free. It
// fails with ErrNoFreeBlocks (pool unchanged) when the cache no longer
// holds the shared blocks or too few blocks are free or evictable.
func (p *Pool) AllocateShared(id uint64, chain []BlockHash, tokens []int32, shared, total, headroom int) error {
	if total < 1 || shared < 0 || shared > len(chain) || shared*p.tpb > total {
		return fmt.Errorf("%w: allocate %d: %d tokens, %d shared blocks", ErrInvalidTokens, id, total, shared)
	}
	if headroom < 0 {
		return fmt.Errorf("%w: allocate %d: headroom %d", ErrInvalidTokens, id, headroom)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.reqs[id]; ok {
		return fmt.Errorf("%w: id %d", ErrAlreadyExists, id)
	}
	k, blocks := p.match(chain[:shared], tokens, p.scratch[:0])
	p.scratch = blocks[:0]
	if k < shared {
		return fmt.Errorf("%w: id %d: %d of %d shared blocks are still cached", ErrNoFreeBlocks, id, k, shared)
	}
	for _, b := range blocks {
		p.cache.hold(b)
	}
	need := p.cfg.BlocksFor(total) - shared
	if err := p.makeRoom(need, headroom); err != nil {
		for _, b := range slices.Backward(blocks) { // as Free lets go: the chain's end first
			p.unhold(b)
		}
		return fmt.Errorf("%w: id %d", err, id)
	}
	i := p.newRequest()
	r := &p.slab[i]
	r.tokens = total
	for _, b := range blocks {
		if n := len(r.runs); n > 0 && r.runs[n-1].End() == BlockID(b) {
			r.runs[n-1].Len++
		} else {
			r.runs = append(r.runs, Run{Start: BlockID(b), Len: 1})
		}
	}
	r.blocks, r.shared = shared, shared
	if need > 0 {
		p.take(r, need)
	}
	p.reqs[id] = i
	return nil
}

// unhold drops a holder of cached block b; unheld, it joins the LRU list as
// the most recently used.
func (p *Pool) unhold(b int32) {
	m := &p.cache.meta[b]
	m.ref--
	if m.ref == 0 {
		p.cache.pushBack(b)
		p.cache.unowned--
	}
}

// disown marks cached block b as no longer held by its publisher, which is
// letting go of it (unhold follows).
func (p *Pool) disown(b int32) {
	m := &p.cache.meta[b]
	if m.owned {
		m.owned = false
		p.cache.unowned++
	}
}

// SharedOnlyBlocks returns the cached blocks that requests hold only as
// shared blocks (AllocateShared), their publisher gone: the blocks in use
// that no request took as its own. A scheduler that promises each request
// its own blocks only (shared blocks counted once) adds them to its
// promises to know what is still free to promise.
func (p *Pool) SharedOnlyBlocks() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cache.unowned
}

// makeRoom evicts unheld cached blocks, oldest first, until need blocks
// are free beyond headroom, or fails with ErrNoFreeBlocks having evicted
// nothing.
func (p *Pool) makeRoom(need, headroom int) error {
	short := need - (p.idx.free - headroom)
	if short <= 0 {
		return nil
	}
	if short > p.cache.evictable {
		return fmt.Errorf("%w: %d blocks (+%d headroom) needed, %d free, %d evictable",
			ErrNoFreeBlocks, need, headroom, p.idx.free, p.cache.evictable)
	}
	for range short {
		p.evict(p.cache.head)
	}
	return nil
}

func (p *Pool) evict(b int32) {
	c := &p.cache
	c.unlink(b)
	m := &c.meta[b]
	delete(c.byHash, m.hash)
	p.events.add(CacheEvent{Hash: m.hash})
	m.cached, m.owned, m.parent, m.hash, m.tokens = false, false, noBlock, BlockHash{}, m.tokens[:0]
	m.gen++
	c.evictions++
	p.idx.release(Run{Start: BlockID(b), Len: 1})
}

// Publish makes the first blocks of request id cached, named by chain (its
// prompt's prefix.Chain) and holding tokens: block i of the request gets
// chain[i] once its tokens are computed and final. Blocks the request
// shares are cached already. It stops at the first name another block
// holds with other tokens or another parent (a collision), and at the
// request's last block. A block whose prefix is cached already (the same
// prefix computed twice: a prompt that shares a cached prefix it could not
// resume from) stays the request's own, and the blocks after it continue
// the cached one. An orphan under one of the names (a block whose parent
// was evicted: unreachable, though named until it is evicted) gives way:
// evicted when no request holds it, taken back under the new parent when
// it is the request's own (as if evicted and published again), so that it
// does not keep the prefix from being cached past it. It returns how many
// of the request's leading blocks are now named in the cache. Errors:
// ErrUnknownRequest.
func (p *Pool) Publish(id uint64, chain []BlockHash, tokens []int32) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.reqs[id]
	if !ok {
		return 0, fmt.Errorf("%w: publish %d", ErrUnknownRequest, id)
	}
	r := &p.slab[i]
	n, parent := 0, noBlock
	for _, run := range r.runs {
		for b := int32(run.Start); b < int32(run.End()); b++ {
			if n >= len(chain) || (n+1)*p.tpb > len(tokens) {
				return n, nil
			}
			m := &p.cache.meta[b]
			if !m.cached {
				if d, dup := p.cache.byHash[chain[n]]; dup {
					// The same prefix computed twice: the cached copy
					// stays the name's block and this one the request's
					// own, and the chain goes on from the cached one.
					dm := &p.cache.meta[d]
					if p.cache.linked(dm, parent) && slices.Equal(dm.tokens, tokens[n*p.tpb:(n+1)*p.tpb]) {
						parent = d
						n++
						continue
					}
					if !p.cache.orphan(dm) || dm.ref > 0 {
						return n, nil // a collision, or an orphan its publisher still holds
					}
					p.evict(d)
				}
				m.cached, m.owned, m.ref, m.parent, m.hash = true, true, 1, parent, chain[n]
				m.tokens = append(m.tokens[:0], tokens[n*p.tpb:(n+1)*p.tpb]...)
				m.parentHash, m.parentGen = BlockHash{}, 0
				if parent != noBlock {
					m.parentHash, m.parentGen = p.cache.meta[parent].hash, p.cache.meta[parent].gen
				}
				p.cache.byHash[chain[n]] = b
				p.events.add(p.storedEvent(b))
			} else if m.hash != chain[n] || !p.cache.linked(m, parent) && !p.adopt(b, parent) {
				return n, nil
			}
			parent = b
			n++
		}
	}
	return n, nil
}

// adopt takes the request's own cached block b, an orphan, back under
// parent: its name is removed and stored again, and its generation moves
// on, so that what was published under it stays orphaned, as it would
// after an eviction (and as the events' consumers hold it). It reports
// whether b was an orphan.
func (p *Pool) adopt(b, parent int32) bool {
	m := &p.cache.meta[b]
	if !p.cache.orphan(m) {
		return false
	}
	p.events.add(CacheEvent{Hash: m.hash})
	m.gen++
	m.parent, m.parentHash, m.parentGen = parent, BlockHash{}, 0
	if parent != noBlock {
		m.parentHash, m.parentGen = p.cache.meta[parent].hash, p.cache.meta[parent].gen
	}
	p.events.add(p.storedEvent(b))
	return true
}

// CachedBlocks returns the number of cached blocks, held or not.
func (p *Pool) CachedBlocks() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.cache.byHash)
}

// EvictableBlocks returns the number of cached blocks no request holds:
// free for the taking once evicted.
func (p *Pool) EvictableBlocks() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cache.evictable
}

// AvailableBlocks is FreeBlocks + EvictableBlocks: what an allocation may
// take now.
func (p *Pool) AvailableBlocks() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.idx.free + p.cache.evictable
}

// Evictions returns how many cached blocks were evicted since New.
func (p *Pool) Evictions() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cache.evictions
}

// IsCached reports whether block b is cached (read-only until evicted).
func (p *Pool) IsCached(b BlockID) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return int64(b) < int64(len(p.cache.meta)) && p.cache.meta[b].cached
}
