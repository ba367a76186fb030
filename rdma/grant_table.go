package rdma

// The receiver's grant table: opening grants, the busy spans that keep an
// open grant's destination from being granted again, the settled grants
// remembered for late frames, the expiry timer, and the quarantine watch.
// Grant (grant.go) is one entry's own state; the fences every grant runs
// through are in fence.go.

import (
	"container/heap"
	"context"
	"crypto/rand"
	"fmt"
	"log/slog"
	"slices"
	"time"
)

// tombstones is how many settled grants are remembered so that late frames
// get the precise reason (revoked, committed, expired) instead of
// ErrUnknownGrant.
const tombstones = 4096

// OpenGrant opens a grant over spec.Extents. The extents must lie in this
// engine's regions, be disjoint, and avoid forbidden ranges. The caller must
// not reuse the destination until the grant is Done (committed, or revoked:
// Revoke returns only when nothing can land).
func (e *Engine) OpenGrant(spec GrantSpec) (*Grant, error) {
	if spec.RequestID == 0 {
		return nil, ErrBadRequestID
	}
	if len(spec.Extents) == 0 || len(spec.Extents) > MaxExtents {
		return nil, fmt.Errorf("%w: grant needs 1..%d extents, got %d", ErrOutOfRange, MaxExtents, len(spec.Extents))
	}
	now := time.Now()
	deadline := spec.Deadline
	if deadline.IsZero() {
		deadline = now.Add(e.cfg.GrantTTL)
	}
	if !now.Before(deadline) {
		return nil, fmt.Errorf("%w: grant deadline %s already passed", ErrDeadline, deadline.Format(time.RFC3339Nano))
	}
	g := &Grant{
		e:      e,
		done:   make(chan struct{}),
		failed: make(chan struct{}),
		ended:  make(chan struct{}),
		due:    -1,
	}
	if n := len(spec.Extents); n <= len(g.dstRoom) {
		g.dst, g.ext = g.dstRoom[:n], g.extRoom[:n]
	} else {
		g.dst, g.ext = make([][]byte, n), make([]extState, n)
	}
	g.quiet.L = &g.mu
	var total uint64
	e.mu.RLock()
	if e.closed {
		e.mu.RUnlock()
		return nil, ErrClosed
	}
	for i, x := range spec.Extents {
		r, ok := e.regions[x.Region]
		if !ok {
			e.mu.RUnlock()
			return nil, fmt.Errorf("%w: extent %d names unknown region %d", ErrOutOfRange, i, x.Region)
		}
		if err := r.checkExtent(x, true); err != nil {
			e.mu.RUnlock()
			return nil, fmt.Errorf("extent %d: %w", i, err)
		}
		g.dst[i] = r.slice(x)
		if r.dev != nil {
			if g.dev == nil {
				g.dev = make([]devSpan, len(spec.Extents))
			}
			g.dev[i] = devSpan{a: r.dev, off: x.Offset}
		}
		g.ext[i].seq = true
		total += x.Length
	}
	e.mu.RUnlock()
	sorted, err := checkDisjoint(spec.Extents)
	if err != nil {
		return nil, err
	}
	g.ticket = Ticket{
		Agent:     e.cfg.Agent,
		RequestID: spec.RequestID,
		Extents:   slices.Clone(spec.Extents),
		Bytes:     total,
		Deadline:  deadline,
	}
	_, _ = rand.Read(g.ticket.Token[:])

	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil, ErrClosed
	}
	if len(e.grants) >= e.cfg.MaxGrants {
		e.mu.Unlock()
		return nil, fmt.Errorf("%w: %d open", ErrTooManyGrants, len(e.grants))
	}
	if err := e.checkBusyLocked(sorted); err != nil {
		e.mu.Unlock()
		return nil, err
	}
	g.id = e.nextGrant.Add(1)
	for !e.slotsFreeLocked(g.id) {
		g.id = e.nextGrant.Add(1)
	}
	g.epoch = e.newEpoch()
	g.ticket.Grant, g.ticket.Epoch = g.id, g.epoch
	// The grant is due before anyone can settle it (retire removes it).
	heap.Push(&e.expiry, g)
	e.armExpiryLocked(deadline)
	e.grants[g.id] = g
	e.markBusyLocked(sorted, g.id)
	for _, f := range e.fences {
		f.open(g)
	}
	e.mu.Unlock()

	e.stats.grantsOpened.Add(1)
	if e.log.Enabled(context.Background(), slog.LevelDebug) { // the arguments would allocate
		e.log.Debug("rdma: grant opened", "grant", g.id, "request", spec.RequestID, "extents", len(spec.Extents), "bytes", total, "deadline", deadline)
	}
	return g, nil
}

// checkDisjoint refuses extents of one grant that overlap each other, and
// returns them sorted by region and offset (xs itself when it is one extent;
// the caller only reads the result).
func checkDisjoint(xs []Extent) ([]Extent, error) {
	if len(xs) == 1 {
		return xs, nil
	}
	s := slices.Clone(xs)
	slices.SortFunc(s, func(a, b Extent) int {
		if a.Region != b.Region {
			return int(a.Region) - int(b.Region)
		}
		switch {
		case a.Offset < b.Offset:
			return -1
		case a.Offset > b.Offset:
			return 1
		}
		return 0
	})
	for i := 1; i < len(s); i++ {
		p, c := s[i-1], s[i]
		if p.Region == c.Region && c.Offset < p.Offset+p.Length {
			return nil, fmt.Errorf("%w: extents [%d, +%d) and [%d, +%d) of region %d overlap", ErrOutOfRange, p.Offset, p.Length, c.Offset, c.Length, c.Region)
		}
	}
	return s, nil
}

// busySpan is a destination range held by an open grant.
type busySpan struct{ off, end, grant uint64 }

// checkBusyLocked refuses extents (sorted) that overlap an open grant's: a
// destination is reusable only once its grant is Done. e.mu is held.
func (e *Engine) checkBusyLocked(sorted []Extent) error {
	for i := 0; i < len(sorted); {
		r := sorted[i].Region
		busy := e.busy[r]
		j := 0
		for ; i < len(sorted) && sorted[i].Region == r; i++ {
			x := sorted[i]
			for j < len(busy) && busy[j].end <= x.Offset {
				j++
			}
			if j < len(busy) && busy[j].off < x.Offset+x.Length {
				b := busy[j]
				return fmt.Errorf("%w: [%d, +%d) of region %d overlaps [%d, %d) of open grant %d", ErrBusy, x.Offset, x.Length, r, b.off, b.end, b.grant)
			}
		}
	}
	return nil
}

// markBusyLocked merges a new grant's (sorted, checked) extents into the
// busy lists, in place from the back (a list keeps its capacity as grants
// come and go). e.mu is held.
func (e *Engine) markBusyLocked(sorted []Extent, grant uint64) {
	for start := 0; start < len(sorted); {
		r := sorted[start].Region
		end := start + 1
		for end < len(sorted) && sorted[end].Region == r {
			end++
		}
		spans := e.busy[r]
		n, k := len(spans), end-start
		spans = slices.Grow(spans, k)[:n+k]
		i, j := n-1, end-1
		for w := n + k - 1; j >= start; w-- {
			if x := sorted[j]; i >= 0 && spans[i].off >= x.Offset {
				spans[w] = spans[i]
				i--
			} else {
				spans[w] = busySpan{x.Offset, x.Offset + x.Length, grant}
				j--
			}
		}
		e.busy[r] = spans
		start = end
	}
}

// clearBusyLocked drops a settled grant's spans. e.mu is held.
func (e *Engine) clearBusyLocked(g *Grant) {
	for i, x := range g.ticket.Extents {
		if i > 0 && g.ticket.Extents[i-1].Region == x.Region {
			continue // consecutive extents of one region: filtered already
		}
		spans := e.busy[x.Region]
		kept := spans[:0]
		for _, s := range spans {
			if s.grant != g.id {
				kept = append(kept, s)
			}
		}
		clear(spans[len(kept):])
		e.busy[x.Region] = kept
	}
}

// lookupGrant finds an open or recently settled grant.
func (e *Engine) lookupGrant(id uint64) (*Grant, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if g := e.grants[id]; g != nil {
		return g, nil
	}
	if g := e.settled[id]; g != nil {
		return g, nil
	}
	if e.closed {
		return nil, ErrClosed
	}
	return nil, fmt.Errorf("%w: grant %d", ErrUnknownGrant, id)
}

// slotsFreeLocked reports whether every slotted fence can file a grant of
// id now: the id selects a slot of a fixed table (id mod its size), and
// OpenGrant skips ids whose slot is busy. e.mu is held.
func (e *Engine) slotsFreeLocked(id uint64) bool {
	for _, f := range e.fences {
		if s, ok := f.(slotted); ok && !s.slotFree(id) {
			return false
		}
	}
	return true
}

// retire moves a settled grant to the tombstones and lets its fences
// release what it used (shm: its slot).
func (e *Engine) retire(g *Grant) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.grants[g.id] != g {
		return
	}
	delete(e.grants, g.id)
	if g.due >= 0 {
		heap.Remove(&e.expiry, g.due)
	}
	e.clearBusyLocked(g)
	for _, f := range e.fences {
		f.release(g)
	}
	e.settled[g.id] = g
	if len(e.ring) < tombstones {
		e.ring = append(e.ring, g.id)
	} else { // forget the oldest, in its place
		delete(e.settled, e.ring[e.ringAt])
		e.ring[e.ringAt] = g.id
		e.ringAt = (e.ringAt + 1) % tombstones
	}
}

// armExpiryLocked makes sure the expiry timer fires by at. e.mu is held.
func (e *Engine) armExpiryLocked(at time.Time) {
	switch {
	case e.expTimer == nil:
		e.expTimer = time.AfterFunc(time.Until(at), e.expire)
	case e.expArmed && !at.Before(e.expAt):
		return // it fires early enough, and looks again then
	default:
		e.expTimer.Reset(time.Until(at))
	}
	e.expAt, e.expArmed = at, true
}

// expire fails the grants whose deadline passed and sets the timer for the
// next one.
func (e *Engine) expire() {
	now := time.Now()
	var due []*Grant
	e.mu.Lock()
	e.expArmed = false
	for len(e.expiry) > 0 && !now.Before(e.expiry[0].ticket.Deadline) {
		due = append(due, heap.Pop(&e.expiry).(*Grant))
	}
	if len(e.expiry) > 0 && !e.closed {
		e.armExpiryLocked(e.expiry[0].ticket.Deadline)
	}
	e.mu.Unlock()
	for _, g := range due {
		g.terminate(g.deadlineErr())
	}
}

// grantHeap orders open grants by deadline (container/heap); Grant.due is a
// grant's index, -1 when it is not in the heap.
type grantHeap []*Grant

func (h grantHeap) Len() int { return len(h) }
func (h grantHeap) Less(i, j int) bool {
	return h[i].ticket.Deadline.Before(h[j].ticket.Deadline)
}
func (h grantHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].due, h[j].due = i, j
}
func (h *grantHeap) Push(x any) {
	g := x.(*Grant)
	g.due = len(*h)
	*h = append(*h, g)
}
func (h *grantHeap) Pop() any {
	old := *h
	g := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	g.due = -1
	return g
}

// watchQuarantine ends g's quarantine once every fence could fence it (shm:
// the writer's bracket ended or its process exited). Engine.Close ends it
// too (the regions are unmapped then).
func (e *Engine) watchQuarantine(g *Grant) {
	defer e.quarantines.Done()
	defer func() {
		e.mu.Lock()
		delete(e.watched, g)
		e.mu.Unlock()
	}()
	start, wait := time.Now(), time.Millisecond
	t := time.NewTimer(wait)
	defer t.Stop()
	for !e.fence(g, 0) {
		select {
		case <-t.C:
		case <-e.ctx.Done():
			e.log.Warn("rdma: engine closed with a grant quarantined", "grant", g.id, "request", g.ticket.RequestID, "for", time.Since(start))
			g.finish()
			return
		}
		wait = min(2*wait, 50*time.Millisecond)
		t.Reset(wait)
	}
	e.log.Info("rdma: grant quarantine over: its destination may be reused", "grant", g.id, "request", g.ticket.RequestID, "bytes", g.ticket.Bytes, "after", time.Since(start))
	g.finish()
}
