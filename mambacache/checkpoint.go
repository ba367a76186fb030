package mambacache

import (
	"fmt"
)

// State checkpoints, for the prefix cache. A checkpoint is a whole state row
// (conv and SSM, every layer) after exactly L tokens of one prefix. It lives
// on a checkpoint row: rows TotalRows .. ArenaRows-1, a role of their own,
// outside the real capacity (Capacity, FreeRows), never a reserved row,
// never handed to a dummy, never a request's. A request that hits copies
// the checkpoint into its own real row (copy on read), so a checkpoint row
// is written only while it is being filled.
//
// A checkpoint row is free, filling (taken by NewCheckpoint, its bytes
// being copied in, invisible to lookups), or ready (FillCheckpoint: named
// and found by FindCheckpoint). A ready checkpoint may be pinned (being
// copied out): it is never evicted while pinned, so eviction never tears
// one. Ready unpinned checkpoints sit on an LRU list; NewCheckpoint evicts
// the oldest when no row is free.
//
// A checkpoint is named by its prefix cut at its last full KV block: the
// name of those full blocks (Parent, a prefix.Hash the caller computes) and
// the tokens after them (Partial, fewer than one block, stored and compared
// token by token), so L = full blocks x block size + len(Partial).

// PrefixHash is the name of a prefix of full KV blocks (prefix.Hash).
type PrefixHash = [32]byte

type ckState uint8

const (
	ckFree ckState = iota
	ckFilling
	ckReady
)

// CheckpointState counts checkpoint rows by state.
type CheckpointState struct {
	Free, Filling, Ready, Pinned int
}

type checkpoint struct {
	state      ckState
	pins       int32
	parent     PrefixHash
	tokens     int     // L
	partial    []int32 // tokens after the parent's last full block
	prev, next int     // LRU links (indexes into Pool.ck), -1 at the ends
}

// checkpoints is the Pool's checkpoint state, guarded by Pool.mu.
type checkpoints struct {
	ck         []checkpoint
	free       []int // indexes of free checkpoint rows, LIFO
	byParent   map[PrefixHash][]int
	head, tail int // LRU of ready unpinned checkpoints, oldest first
	evictions  uint64
	events     stateJournal
}

func newCheckpoints(n int) checkpoints {
	c := checkpoints{ck: make([]checkpoint, n), free: make([]int, 0, n), byParent: map[PrefixHash][]int{}, head: -1, tail: -1}
	for i := n - 1; i >= 0; i-- {
		c.ck[i].prev, c.ck[i].next = -1, -1
		c.free = append(c.free, i)
	}
	return c
}

func (c *checkpoints) unlink(i int) {
	k := &c.ck[i]
	if k.prev >= 0 {
		c.ck[k.prev].next = k.next
	} else {
		c.head = k.next
	}
	if k.next >= 0 {
		c.ck[k.next].prev = k.prev
	} else {
		c.tail = k.prev
	}
	k.prev, k.next = -1, -1
}

func (c *checkpoints) pushBack(i int) {
	k := &c.ck[i]
	k.prev, k.next = c.tail, -1
	if c.tail >= 0 {
		c.ck[c.tail].next = i
	} else {
		c.head = i
	}
	c.tail = i
}

func (c *checkpoints) pushFront(i int) {
	k := &c.ck[i]
	k.prev, k.next = -1, c.head
	if c.head >= 0 {
		c.ck[c.head].prev = i
	} else {
		c.tail = i
	}
	c.head = i
}

// drop removes ready checkpoint i from its index and the LRU list and frees it.
func (c *checkpoints) drop(i int) {
	k := &c.ck[i]
	c.events.add(false, k)
	c.unlink(i)
	list := c.byParent[k.parent]
	for j, x := range list {
		if x == i {
			list[j] = list[len(list)-1]
			list = list[:len(list)-1]
			break
		}
	}
	if len(list) == 0 {
		delete(c.byParent, k.parent)
	} else {
		c.byParent[k.parent] = list
	}
	k.state, k.parent, k.tokens, k.partial = ckFree, PrefixHash{}, 0, k.partial[:0]
	c.free = append(c.free, i)
}

func (p *Pool) ckIndex(r Row) (int, bool) {
	if !p.cfg.IsCheckpointRow(r) {
		return 0, false
	}
	return int(r) - p.cfg.TotalRows(), true
}

func (p *Pool) ckRow(i int) Row { return Row(p.cfg.TotalRows() + i) }

// NewCheckpoint takes a checkpoint row to fill: a free one, else the
// oldest ready unpinned checkpoint, evicted (evicted reports it: whatever
// the caller kept beside it, such as its partial KV block, is to be let
// go). The row stays invisible until FillCheckpoint or AbortCheckpoint.
// Errors: ErrNoCheckpointRow.
func (p *Pool) NewCheckpoint() (r Row, evicted bool, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := &p.cks
	if len(c.free) == 0 {
		if c.head < 0 {
			return 0, false, fmt.Errorf("%w: %d checkpoint rows, all filling or pinned", ErrNoCheckpointRow, len(c.ck))
		}
		c.drop(c.head)
		c.evictions++
		evicted = true
	}
	i := c.free[len(c.free)-1]
	c.free = c.free[:len(c.free)-1]
	c.ck[i].state = ckFilling
	return p.ckRow(i), evicted, nil
}

// FillCheckpoint makes filling row r the ready checkpoint after tokens
// tokens of the prefix named by parent and partial. If a ready checkpoint
// of that prefix exists already, r is freed instead and dup is true.
// Errors: ErrNotCheckpoint.
func (p *Pool) FillCheckpoint(r Row, parent PrefixHash, partial []int32, tokens int) (dup bool, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.ckIndex(r)
	if !ok || p.cks.ck[i].state != ckFilling {
		return false, fmt.Errorf("%w: fill row %d", ErrNotCheckpoint, r)
	}
	c := &p.cks
	if tokens < len(partial) {
		return false, fmt.Errorf("%w: fill row %d: %d tokens, %d of them partial", ErrNotCheckpoint, r, tokens, len(partial))
	}
	for _, x := range c.byParent[parent] {
		if k := &c.ck[x]; k.tokens == tokens && equal(k.partial, partial) {
			c.ck[i].state = ckFree
			c.free = append(c.free, i)
			return true, nil
		}
	}
	k := &c.ck[i]
	k.state, k.parent, k.tokens = ckReady, parent, tokens
	k.partial = append(k.partial[:0], partial...)
	c.byParent[parent] = append(c.byParent[parent], i)
	c.pushBack(i)
	c.events.add(true, k)
	return false, nil
}

// AbortCheckpoint frees filling row r. Errors: ErrNotCheckpoint.
func (p *Pool) AbortCheckpoint(r Row) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.ckIndex(r)
	if !ok || p.cks.ck[i].state != ckFilling {
		return fmt.Errorf("%w: abort row %d", ErrNotCheckpoint, r)
	}
	p.cks.ck[i].state = ckFree
	p.cks.free = append(p.cks.free, i)
	return nil
}

// FindCheckpoint returns the ready checkpoint of the longest prefix that
// continues the full blocks named parent with the first tokens of rest,
// using at most maxPartial of them: its row and how many tokens of rest it
// covers. It changes nothing.
func (p *Pool) FindCheckpoint(parent PrefixHash, rest []int32, maxPartial int) (r Row, partial int, ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	best := -1
	for _, i := range p.cks.byParent[parent] {
		k := &p.cks.ck[i]
		n := len(k.partial)
		if n > maxPartial || n > len(rest) || !equal(k.partial, rest[:n]) {
			continue
		}
		if best < 0 || n > len(p.cks.ck[best].partial) {
			best = i
		}
	}
	if best < 0 {
		return 0, 0, false
	}
	return p.ckRow(best), len(p.cks.ck[best].partial), true
}

// PinCheckpoint keeps ready checkpoint r from eviction until UnpinCheckpoint.
// Pins count. Errors: ErrNotCheckpoint.
func (p *Pool) PinCheckpoint(r Row) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.ckIndex(r)
	if !ok || p.cks.ck[i].state != ckReady {
		return fmt.Errorf("%w: pin row %d", ErrNotCheckpoint, r)
	}
	k := &p.cks.ck[i]
	if k.pins == 0 {
		p.cks.unlink(i)
	}
	k.pins++
	return nil
}

// UnpinCheckpoint drops a pin of r; unpinned it becomes the most recently
// used. Errors: ErrNotCheckpoint.
func (p *Pool) UnpinCheckpoint(r Row) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.ckIndex(r)
	if !ok || p.cks.ck[i].state != ckReady || p.cks.ck[i].pins == 0 {
		return fmt.Errorf("%w: unpin row %d", ErrNotCheckpoint, r)
	}
	k := &p.cks.ck[i]
	k.pins--
	if k.pins == 0 {
		p.cks.pushBack(i)
	}
	return nil
}

// DemoteCheckpoint makes ready checkpoint r the least recently used, so
// that the next eviction takes it first (a longer state of the same
// conversation superseded it), and reports whether it did: a pinned one is
// left as it is. Errors: ErrNotCheckpoint.
func (p *Pool) DemoteCheckpoint(r Row) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.ckIndex(r)
	if !ok || p.cks.ck[i].state != ckReady {
		return false, fmt.Errorf("%w: demote row %d", ErrNotCheckpoint, r)
	}
	if p.cks.ck[i].pins > 0 {
		return false, nil
	}
	p.cks.unlink(i)
	p.cks.pushFront(i)
	return true, nil
}

// EvictCheckpoint evicts the oldest ready unpinned checkpoint that keeps
// partial tokens when withPartial (one that has a partial KV block beside
// it), or any when not, and returns its row.
func (p *Pool) EvictCheckpoint(withPartial bool) (Row, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := p.cks.head; i >= 0; i = p.cks.ck[i].next {
		if withPartial && len(p.cks.ck[i].partial) == 0 {
			continue
		}
		p.cks.drop(i)
		p.cks.evictions++
		return p.ckRow(i), true
	}
	return 0, false
}

// EvictableCheckpoints counts ready unpinned checkpoints, those with partial
// tokens apart.
func (p *Pool) EvictableCheckpoints() (all, withPartial int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := p.cks.head; i >= 0; i = p.cks.ck[i].next {
		all++
		if len(p.cks.ck[i].partial) > 0 {
			withPartial++
		}
	}
	return all, withPartial
}

// Checkpoints counts the checkpoint rows by state.
func (p *Pool) Checkpoints() CheckpointState {
	p.mu.Lock()
	defer p.mu.Unlock()
	var s CheckpointState
	for _, k := range p.cks.ck {
		switch {
		case k.state == ckFree:
			s.Free++
		case k.state == ckFilling:
			s.Filling++
		case k.pins > 0:
			s.Pinned++
		default:
			s.Ready++
		}
	}
	return s
}

// CheckpointEvictions counts the checkpoints evicted since New.
func (p *Pool) CheckpointEvictions() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cks.evictions
}

func equal(a, b []int32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
