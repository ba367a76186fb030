package rdma

// Landing: how a receiver that stores a write's bytes itself (tcp data
// frames, cuda-ipc pulls, an in-process writer's copies) admits each piece
// against its grant, counts it in flight until its bytes are in place, and
// keeps the extent's crc32c as the bytes land.

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	"github.com/handoff-io/handoff/internal/crc32c"
)

// extState tracks what landed in one destination extent. The landings that
// continue the extent in order from offset 0 (the normal case for one
// writer) extend a running crc over data still in cache; a landing that
// starts elsewhere (another lane of a striped write) keeps a crc of its own,
// a segment. At commit the running crc and the segments, joined in offset
// order with crc32c.Combine, give the extent's crc without reading it again;
// when they do not tile the extent exactly the commit sums it.
type extState struct {
	landed uint64 // bytes landed, counting rewrites
	next   uint64 // offset the in-order crc has reached
	crc    uint32
	seq    bool      // the in-order crc is usable (no in-order landing failed)
	busy   bool      // an in-order landing is in flight
	segs   []segment // whole landings away from next, in landing order
}

// segment is a landing's own crc over [off, off+n) of its extent.
type segment struct {
	off, n uint64
	crc    uint32
}

// maxSegments bounds the segments an extent keeps, with one more per
// segmentBytes of the extent: a landing beyond them makes the commit sum
// the extent instead. A streamed write (Stream) lands an extent in many
// pieces out of order (each layer of each block of a run), and summing
// them as they land keeps the commit from reading the extent again; the
// bound keeps a writer from making the receiver hold more than a few bytes
// of bookkeeping per 16 KiB granted.
const (
	maxSegments  = 64
	segmentBytes = 16 << 10
)

// segmentCap is how many segments an extent of n bytes keeps.
func segmentCap(n uint64) int { return max(maxSegments, int(n/segmentBytes)) }

// crcOf returns the crc of an extent of n bytes from its in-order crc and
// segments, and false when they do not tile [0, n) exactly.
func (st *extState) crcOf(n uint64) (uint32, bool) {
	if !st.seq {
		return 0, false
	}
	if len(st.segs) == 0 {
		return st.crc, st.next == n
	}
	slices.SortFunc(st.segs, func(a, b segment) int { return cmp.Compare(a.off, b.off) })
	crc, pos := st.crc, st.next
	for _, s := range st.segs {
		if s.off != pos {
			return 0, false
		}
		crc, pos = crc32c.Combine(crc, s.crc, int64(s.n)), pos+s.n
	}
	return crc, pos == n
}

// lander is a connection landing bytes into a grant; abortLanding makes its
// blocked read return so that Revoke never waits on a stalled peer.
type lander interface{ abortLanding() }

// landing is one admitted data frame: the destination bytes and, when the
// frame continues its extent in order, the running crc32c the lander
// extends as it fills dst (while the bytes are still in cache).
type landing struct {
	idx   uint32
	off   uint64
	n     uint64
	dst   []byte // host destination; nil when dev is set
	dev   devSpan
	crc   uint32
	track bool
	seg   bool // tracked as a segment of its own, not the in-order crc
	// nosum: the bytes landed without passing through host memory (a
	// device-to-device copy); the commit sums the extent instead.
	nosum bool
}

// fill records that dst[:n] was filled, extending the crc when tracked.
func (l *landing) fill(b []byte) {
	if l.track {
		l.crc = crc32Update(l.crc, b)
	}
}

// copyFill copies src into dst, the next bytes of the landing, and extends
// the crc over them in the same pass when tracked.
func (l *landing) copyFill(dst, src []byte) {
	if l.track {
		l.crc = crc32c.CopyUpdate(l.crc, dst, src)
		return
	}
	copy(dst, src)
}

// beginLand admits one data frame: it checks token, epoch, state, deadline
// and that [off, off+n) lies inside extent idx, then registers the landing as
// in flight and returns it. The caller fills dst (calling fill on each
// filled chunk, in order) and calls endLand. ab (may be nil) is aborted when
// the grant is fenced. A frame with the right token but out of range fails
// the grant.
func (g *Grant) beginLand(epoch uint64, token *[16]byte, idx uint32, off, n uint64, ab lander) (landing, error) {
	return g.beginLandAt(time.Now(), epoch, token, idx, off, n, ab)
}

// beginLandAt is beginLand with the deadline checked against now, for a
// writer that lands many small pieces and reads the clock once per batch.
func (g *Grant) beginLandAt(now time.Time, epoch uint64, token *[16]byte, idx uint32, off, n uint64, ab lander) (landing, error) {
	l, fail, err := g.admitLand(now, epoch, token, idx, off, n, ab)
	if fail {
		g.terminate(err)
	}
	return l, err
}

// admitLand is beginLandAt without failing the grant: fail reports that
// the frame must fail it (expired, or out of range with the right token),
// which the caller does with g.terminate where it may block. A receiver
// whose admission runs where it must not block (the UCX worker's own
// goroutine, which the fence waits on) fails the grant from elsewhere.
func (g *Grant) admitLand(now time.Time, epoch uint64, token *[16]byte, idx uint32, off, n uint64, ab lander) (l landing, fail bool, err error) {
	g.mu.Lock()
	if err := g.checkLocked(epoch, token); err != nil {
		g.mu.Unlock()
		return landing{}, false, err
	}
	if g.expired(now) {
		g.mu.Unlock()
		return landing{}, true, g.deadlineErr()
	}
	if int(idx) >= len(g.dst) || off > g.ticket.Extents[idx].Length || n > g.ticket.Extents[idx].Length-off || n == 0 {
		g.mu.Unlock()
		var err error
		if int(idx) >= len(g.dst) {
			err = fmt.Errorf("%w: extent index %d, grant %d has %d", ErrOutOfRange, idx, g.id, len(g.dst))
		} else {
			err = fmt.Errorf("%w: [%d, +%d) outside extent %d of %d bytes (grant %d)", ErrOutOfRange, off, n, idx, g.ticket.Extents[idx].Length, g.id)
		}
		return landing{}, true, err
	}
	l = landing{idx: idx, off: off, n: n}
	if g.dev != nil && g.dev[idx].a != nil {
		l.dev = devSpan{a: g.dev[idx].a, off: g.dev[idx].off + off}
	} else {
		l.dst = g.dst[idx][off : off+n : off+n]
	}
	st := &g.ext[idx]
	switch {
	case g.e.cfg.SkipCRC || !st.seq:
	case !st.busy && off == st.next:
		l.track, l.crc = true, st.crc
		st.busy = true
	case len(st.segs) < segmentCap(g.ticket.Extents[idx].Length):
		l.track, l.seg = true, true
	default:
		st.seq = false
	}
	g.inflight++
	if ab != nil {
		g.landers = append(g.landers, ab)
	}
	g.mu.Unlock()
	return l, false, nil
}

// cutLandings aborts the landings in flight (each lander's blocked read or
// copy returns) and waits until none is: from then on nothing beginLand
// admitted lands in g. The grant has left its epoch, so beginLand admits
// none any more. It is the fence of the transports whose receiver stores
// every byte itself (landings, fence.go).
func (g *Grant) cutLandings() {
	g.mu.Lock()
	for _, l := range g.landers {
		l.abortLanding()
	}
	if f := g.e.testHooks().fenceWaits; f != nil && g.inflight > 0 {
		f(g)
	}
	for g.inflight > 0 {
		g.quiet.Wait()
	}
	g.mu.Unlock()
}

// endLand ends a landing started by beginLand; ok reports whether all of dst
// was filled.
func (g *Grant) endLand(l *landing, ok bool, ab lander) {
	g.mu.Lock()
	st := &g.ext[l.idx]
	if ok {
		st.landed += l.n
	}
	switch {
	case l.nosum:
		if l.track && !l.seg {
			st.busy = false
		}
		st.seq = false // the extent is summed at commit
	case l.track && !ok:
		if !l.seg {
			st.busy = false
		}
		st.seq = false // the extent is summed at commit
	case l.seg:
		st.segs = append(st.segs, segment{l.off, l.n, l.crc})
	case l.track:
		st.busy = false
		st.crc = l.crc
		st.next += l.n
	}
	if ab != nil {
		for i, x := range g.landers {
			if x == ab {
				last := len(g.landers) - 1
				g.landers[i] = g.landers[last]
				g.landers[last] = nil
				g.landers = g.landers[:last]
				break
			}
		}
	}
	g.inflight--
	if g.inflight == 0 {
		g.quiet.Broadcast()
	}
	g.mu.Unlock()
}
