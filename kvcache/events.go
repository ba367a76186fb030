package kvcache

// Cache events: what a router needs to know of the prefix cache, in the
// order it changed. While recording (RecordEvents), the pool appends a
// CacheEvent each time a block becomes cached (Publish) or stops being
// cached (eviction); the owner of the pool takes them (TakeEvents) and
// publishes them (package kvevents). The journal is bounded: past its
// bound it records nothing more and says so at the next take, and the
// consumer starts over from Snapshot. Nothing is recorded unless asked.

// CacheEvent is one change to the prefix cache.
type CacheEvent struct {
	// Stored: the block named Hash became cached; otherwise it was evicted.
	Stored bool
	// Hash names the block's whole prefix (package prefix).
	Hash BlockHash
	// Parent names the prefix it continues; HasParent is false for a first
	// block (its parent is the chain's root). Stored events only.
	Parent    BlockHash
	HasParent bool
	// Tokens are the block's tokens (stored events only; the caller may
	// keep them: they are the event's own).
	Tokens []int32
}

// journal is the pool's event record, guarded by Pool.mu.
type journal struct {
	max      int // events kept at most; 0: not recording
	events   []CacheEvent
	overflow bool
}

func (j *journal) add(e CacheEvent) {
	if j.max == 0 || j.overflow {
		return
	}
	if len(j.events) >= j.max {
		j.overflow, j.events = true, nil
		return
	}
	j.events = append(j.events, e)
}

// RecordEvents starts recording cache events, keeping at most max of them
// until they are taken (0 stops recording and drops what was kept).
func (p *Pool) RecordEvents(max int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.events = journal{max: max}
}

// TakeEvents returns the events recorded since the last take, oldest
// first, appended to dst. overflow is true when more happened than the
// journal keeps: the events returned are then none, and the consumer must
// start over from Snapshot.
func (p *Pool) TakeEvents(dst []CacheEvent) (events []CacheEvent, overflow bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	dst = append(dst, p.events.events...)
	overflow = p.events.overflow
	p.events.events, p.events.overflow = p.events.events[:0], false
	return dst, overflow
}

// Snapshot returns a stored event for every cached block a prompt can
// reach (each continuing the block it was published under, back to a first
// block: an orphan, whose parent was evicted, is left out), each after its
// parent, appended to dst. It leaves the journal alone: a consumer that
// applies the events taken after a snapshot on top of it may apply some
// twice, which changes nothing (a store or a removal sets, it does not
// toggle).
func (p *Pool) Snapshot(dst []CacheEvent) []CacheEvent {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := &p.cache
	// reach: 0 unknown, 1 reachable (emitted), 2 not reachable.
	reach := make(map[int32]uint8, len(c.byHash))
	var visit func(b int32) bool
	visit = func(b int32) bool {
		switch reach[b] {
		case 1:
			return true
		case 2:
			return false
		}
		m := &c.meta[b]
		ok := m.parent == noBlock || (c.meta[m.parent].cached && c.linked(m, m.parent) && visit(m.parent))
		reach[b] = 2
		if ok {
			reach[b] = 1
			dst = append(dst, p.storedEvent(b))
		}
		return ok
	}
	for _, b := range c.byHash {
		visit(b)
	}
	return dst
}

// storedEvent describes cached block b as stored.
func (p *Pool) storedEvent(b int32) CacheEvent {
	m := &p.cache.meta[b]
	e := CacheEvent{Stored: true, Hash: m.hash, Tokens: append([]int32(nil), m.tokens...)}
	if m.parent != noBlock {
		e.Parent, e.HasParent = m.parentHash, true
	}
	return e
}
