package mambacache

// State events: which checkpoints a pool holds, in the order that changed,
// for a router (package kvevents), as kvcache's cache events are for
// blocks. While recording (RecordEvents), a checkpoint made ready
// (FillCheckpoint) is recorded as stored and one evicted as removed; the
// owner takes them (TakeEvents). The journal is bounded like kvcache's:
// past its bound it says so at the next take, and the consumer starts over
// from Snapshot.

// StateEvent is one change to the pool's ready checkpoints.
type StateEvent struct {
	// Stored: the checkpoint became ready; otherwise it was evicted.
	Stored bool
	// Parent names the checkpoint's full KV blocks, Partial the tokens
	// after them (the event's own copy), Tokens its length: Partial and
	// Tokens identify it under Parent, as FindCheckpoint does.
	Parent  PrefixHash
	Partial []int32
	Tokens  int
}

// stateJournal is the pool's event record, guarded by Pool.mu.
type stateJournal struct {
	max      int // events kept at most; 0: not recording
	events   []StateEvent
	overflow bool
}

func (j *stateJournal) add(stored bool, k *checkpoint) {
	if j.max == 0 || j.overflow {
		return
	}
	if len(j.events) >= j.max {
		j.overflow, j.events = true, nil
		return
	}
	j.events = append(j.events, StateEvent{Stored: stored, Parent: k.parent, Partial: append([]int32(nil), k.partial...), Tokens: k.tokens})
}

// RecordEvents starts recording state events, keeping at most max of them
// until they are taken (0 stops recording and drops what was kept).
func (p *Pool) RecordEvents(max int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cks.events = stateJournal{max: max}
}

// TakeEvents returns the state events recorded since the last take, oldest
// first, appended to dst. overflow is true when more happened than the
// journal keeps: no events are returned then, and the consumer must start
// over from Snapshot.
func (p *Pool) TakeEvents(dst []StateEvent) (events []StateEvent, overflow bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	j := &p.cks.events
	dst = append(dst, j.events...)
	overflow = j.overflow
	j.events, j.overflow = j.events[:0], false
	return dst, overflow
}

// Snapshot returns a stored event for every ready checkpoint, appended to
// dst. It leaves the journal alone (as kvcache's Snapshot does).
func (p *Pool) Snapshot(dst []StateEvent) []StateEvent {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := range p.cks.ck {
		if k := &p.cks.ck[i]; k.state == ckReady {
			dst = append(dst, StateEvent{Stored: true, Parent: k.parent, Partial: append([]int32(nil), k.partial...), Tokens: k.tokens})
		}
	}
	return dst
}
