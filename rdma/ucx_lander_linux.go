//go:build linux && cgo && ucx

package rdma

// The ucx receiver's landings: a data message's admission (its pieces, in
// the grants' extents), its staging buffer, and who ends its landing (the
// receive's completion or a fence).

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/handoff-io/handoff/internal/ucx"
)

// ucxPiece is one run of a data message's payload: [off, off+n) of
// extent ext.
type ucxPiece struct {
	ext    uint32
	off, n uint64
}

// admitData admits a data message as a landing, as a tcp data frame is
// admitted (token, epoch, state, deadline, extent bounds), and lets UCX
// pull its payload into a staging buffer.
func (s *ucxServer) admitData(h *header, lid uint64, m ucx.Message) (ucx.Admission, error) {
	return s.admitPieces(h, lid, m, []ucxPiece{{h.index, h.offset, h.length}})
}

// admitPacked admits a packed message (framePacked: small pieces, of one
// grant, in one payload): its header is a data header whose index counts
// the pieces and whose length is the payload's, and its tail lists the
// pieces in payload order, ucxPackEntry bytes each (extent, offset,
// length). Each piece is admitted as a tcp data frame is; one refused
// refuses the message.
func (s *ucxServer) admitPacked(b []byte, lid uint64, tail []byte, m ucx.Message) (ucx.Admission, error) {
	hb := [headerSize]byte(b[:headerSize])
	hb[4] = frameData
	h, err := decodeHeader(hb[:])
	count := int(h.index)
	if err != nil || h.offset != 0 || count < 1 || count > ucxPackMax || len(tail) != count*ucxPackEntry {
		s.e.stats.framesRefused.Add(1)
		return ucx.Admission{}, ucx.ErrRejected
	}
	pieces := make([]ucxPiece, count)
	var total uint64
	for i := range pieces {
		e := tail[i*ucxPackEntry:]
		p := ucxPiece{ext: binary.LittleEndian.Uint32(e), off: binary.LittleEndian.Uint64(e[4:]), n: binary.LittleEndian.Uint64(e[12:])}
		if p.n == 0 || p.n > ucxPackBytes {
			s.e.stats.framesRefused.Add(1)
			return ucx.Admission{}, ucx.ErrRejected
		}
		pieces[i], total = p, total+p.n
	}
	if total != h.length {
		s.e.stats.framesRefused.Add(1)
		return ucx.Admission{}, ucx.ErrRejected
	}
	return s.admitPieces(&h, lid, m, pieces)
}

// admitPieces admits the pieces of a data message of grant h.grant as
// landings of one lander, and lets UCX pull the payload into a staging
// buffer; its Done copies each piece into its destination.
func (s *ucxServer) admitPieces(h *header, lid uint64, m ucx.Message, pieces []ucxPiece) (ucx.Admission, error) {
	r := s.link(lid)
	if r == nil || uint64(m.Length) != h.length {
		s.e.stats.framesRefused.Add(1)
		return ucx.Admission{}, ucx.ErrRejected
	}
	g, err := s.e.lookupGrant(h.grant)
	ab := &ucxLander{s: s, g: g}
	fail := false
	if err == nil {
		ab.mu.Lock()
		now := time.Now()
		for _, p := range pieces {
			var ld landing
			ld, fail, err = g.admitLand(now, h.epoch, &h.token, p.ext, p.off, p.n, ab)
			if err == nil && ld.dst == nil {
				g.endLand(&ld, false, ab)
				err = fmt.Errorf("%w: ucx into device memory", ErrUnsupported)
			}
			if err != nil {
				break
			}
			ab.lds = append(ab.lds, ld)
		}
		if err == nil {
			ab.stage, err = ucxStage(int(h.length))
		}
		// A fence may have abandoned the lander meanwhile (it is in the
		// grant's landers from its first landing): its abort, waiting for
		// ab.mu, then ends every landing admitted, and ending them here too
		// would end them twice. Whoever moves the state ends them.
		if err != nil && ab.state.CompareAndSwap(ucxReceiving, ucxAbandoned) {
			for i := range ab.lds {
				g.endLand(&ab.lds[i], false, ab)
			}
		}
		ab.mu.Unlock()
	}
	s.mu.Lock()
	if err != nil {
		if _, ok := r.refused[h.grant]; !ok && len(r.refused) < maxRefusals {
			r.refused[h.grant] = err
		}
	} else {
		r.touched[g.id] = g
	}
	s.mu.Unlock()
	if err != nil {
		s.e.stats.framesRefused.Add(1)
		if fail {
			s.spawn(func() { g.terminate(err) })
		}
		return ucx.Admission{}, ucx.ErrRejected
	}
	return ucx.Admission{Dest: ab.stage, Token: ucx.Token(g.id), Done: func(rerr error) {
		s.spawn(func() { ab.received(r, rerr) })
	}}, nil
}

// ucxLander is one admitted data message: its landing, the staging
// buffer UCX receives its payload into, and who ends the landing.
//
// UCX cannot cancel a receive (ucx.md §0.3: ucp_request_cancel does
// nothing to an AM rendezvous receive) and nothing else bounds what one
// stores (§0.4: a force-closed endpoint's cma GET runs on; over tcp the
// fragments of a writer that is stopped, but alive, simply stop coming, and
// the receive stays in flight until the writer resumes or dies, with no
// bound). A receive posted into the destination would therefore hold
// Revoke for as long as a frozen writer stays frozen, or leave it storing
// into a destination that was handed on. So UCX never receives into a
// destination: each message's payload goes into a staging buffer the
// receiver owns, and only the receiver's own copy, made after the receive
// completed and under the landing, stores into the destination (copying
// and summing in one pass, crc32c.CopyUpdate).
//
// The landing is one of two things that end it, whichever comes first (the
// state word decides): the receive's Done (the copy, then endLand), or the
// fence's abort, which abandons the receive at once: endLand, no copy. An
// abandoned receive goes on into its staging buffer, which nothing else
// uses until its Done ran, and whatever it completes with is dropped.
// Revoke therefore returns at once whatever the writer does (frozen,
// dead, live), and nothing lands after it: the destination's only writer
// is this process, under a landing the fence waited for. That holds on
// every UCX transport alike, tcp fragments, a cma GET, an RDMA READ, since
// none of them ever names the destination. The price is one extra copy per
// byte on the receiver (measured in docs/operating.md) and up to a window
// of staging buffers per writer, held while a stopped writer keeps its
// receives open.
type ucxLander struct {
	s     *ucxServer
	g     *Grant
	mu    sync.Mutex // held by admitData until lds and stage are set
	lds   []landing  // one, or a packed message's pieces in payload order
	stage []byte
	state atomic.Int32 // ucxReceiving, then ucxCopying or ucxAbandoned
}

const (
	ucxReceiving = iota
	ucxCopying   // the receive completed; its bytes are being copied in
	ucxAbandoned // a fence ended the landing; the receive's bytes are dropped
)

// ucxStages keeps staging buffers for reuse, one free list per size (a
// power of two from ucxStageMin to ucxChunk; a writer's message is never
// larger, and a larger one gets a buffer of its own). They are mmap'd, not
// Go memory: a buffer UCX fills is neither zeroed by Go on allocation nor
// scanned by its collector, and a sync.Pool's buffers, dropped at every
// collection, cost a receiver a quarter of its time in zeroing (measured).
var ucxStages struct {
	sync.Mutex
	free map[int][][]byte
}

const (
	ucxStageMin = 64 << 10
	// ucxStageKeep bounds the free buffers kept per size: two writers'
	// windows (at 8 MiB, 128 MiB that stays mapped once used; the rest
	// are unmapped as they come back).
	ucxStageKeep = 2 * ucxWindow
)

// ucxStageSize is the size of the buffer a message of n bytes takes.
func ucxStageSize(n int) int {
	if n > ucxChunk {
		return n
	}
	c := ucxStageMin
	for c < n {
		c <<= 1
	}
	return c
}

// ucxStage returns a staging buffer of n bytes, its capacity the whole
// mapping (freeStage recycles or unmaps by it).
func ucxStage(n int) ([]byte, error) {
	c := ucxStageSize(n)
	ucxStages.Lock()
	if l := ucxStages.free[c]; len(l) > 0 {
		b := l[len(l)-1]
		ucxStages.free[c] = l[:len(l)-1]
		ucxStages.Unlock()
		return b[:n], nil
	}
	ucxStages.Unlock()
	b, err := unix.Mmap(-1, 0, c, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("rdma: ucx: mapping a staging buffer of %d bytes: %w", c, err)
	}
	return b[:n], nil
}

// freeStage returns a staging buffer once no receive uses it any more. Its
// capacity is its mapping's size (ucxStage keeps it so): what is recycled
// by size, or unmapped whole.
func freeStage(b []byte) {
	if b == nil {
		return
	}
	b = b[:cap(b)]
	c := cap(b)
	ucxStages.Lock()
	if c == ucxStageSize(c) && c <= ucxChunk && len(ucxStages.free[c]) < ucxStageKeep {
		if ucxStages.free == nil {
			ucxStages.free = map[int][][]byte{}
		}
		ucxStages.free[c] = append(ucxStages.free[c], b)
		ucxStages.Unlock()
		return
	}
	ucxStages.Unlock()
	_ = unix.Munmap(b) // a whole mapping: it fails only for memory not ucxStage's
}

// abortLanding abandons the receive, unless its bytes are being copied in
// already (the fence then waits for that copy, this process's own store,
// which ends by itself). On a goroutine of its own: the fence calls it with
// the grant's lock held, which endLand takes.
func (l *ucxLander) abortLanding() {
	l.s.spawn(func() {
		if !l.state.CompareAndSwap(ucxReceiving, ucxAbandoned) {
			return
		}
		l.mu.Lock()
		lds := l.lds
		l.mu.Unlock()
		for i := range lds {
			l.g.endLand(&lds[i], false, l)
		}
	})
}

// received ends the landing once UCX completed the receive (rerr nil: all
// of it is in the staging buffer), and frees the buffer, unless the
// worker's Close left the receive in flight (ucx.ErrLeaked): the buffer
// is then UCX's for good.
func (l *ucxLander) received(r *ucxRx, rerr error) {
	if !errors.Is(rerr, ucx.ErrLeaked) {
		defer freeStage(l.stage)
	}
	if !l.state.CompareAndSwap(ucxReceiving, ucxCopying) {
		return // abandoned by a fence: the grant is out of its epoch
	}
	pos := 0
	for i := range l.lds {
		ld := &l.lds[i]
		if rerr == nil {
			src := l.stage[pos : pos+len(ld.dst)]
			for off := 0; off < len(ld.dst); off += landChunk {
				end := min(off+landChunk, len(ld.dst))
				ld.copyFill(ld.dst[off:end], src[off:end])
			}
		}
		pos += len(ld.dst)
		l.g.endLand(ld, rerr == nil, l)
	}
	if rerr != nil {
		l.g.terminate(fmt.Errorf("%w: ucx receive from %s: %w", ErrPeerClosed, r.agent, rerr))
	}
}
