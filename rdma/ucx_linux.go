//go:build linux && cgo && ucx

package rdma

// The ucx transport: UCX active messages (internal/ucx), receiver-driven.
//
// A writer sends each contiguous source run of a write as one active
// message (at most ucxChunk bytes) whose header is a data frame's header
// (grant, epoch, token, extent index, offset, length); the receiver's
// admission (ucxServer.admit, on the UCX worker's goroutine) checks it
// against the grant exactly as a tcp data frame is checked, through
// Grant.admitLand, and answers with a staging buffer of its own. UCX then
// pulls the payload there itself: a GET by this process (cma:
// process_vm_readv; verbs: an RDMA READ) or fragments this process copies
// out (tcp). Once the receive completed, its Done copies the bytes into the
// destination and sums them in one pass, and ends the landing. A commit is
// a header-only message carrying the manifest (or the manifest as payload
// when the header cannot hold it), answered, like a hello or a flush, by a
// reply message to the writer's own worker: a UCX send completion is never
// taken for delivery, only the receiver's checked verdict.
//
// Why nothing lands after Revoke, on every UCX transport (tcp, cma/shm and
// verbs alike): bytes reach a destination only through this process's own
// copy out of a staging buffer, made under a landing that admission counted
// in flight on the grant; a writer never learns a destination address or
// key (no rkey ever leaves this engine, and no UCX receive is ever posted
// into a destination), so there is no one-sided store to stop and no
// receive into it to wait out. Revoke moves the grant out of its epoch
// first, so admission refuses every later message, then cuts the landings
// in flight: one whose receive is still under way is abandoned at once
// (ucxLander: UCX cannot cancel it, but it only fills the staging buffer,
// which stays out of use until it ends), one being copied in is waited
// for, and that copy ends without any peer's help. So Revoke returns at
// once even when the writer is stopped mid-message (SIGSTOP, a frozen
// cgroup: its tcp fragments stop coming and the receive would otherwise
// stay open until it resumes or dies), and no byte lands after it. The
// fence is therefore landings, as for tcp, and never quarantines.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/handoff-io/handoff/internal/ucx"
)

const ucxSupported = true

const (
	// ucxChunk bounds one message's payload, so that a receive in flight
	// (what a fence may have to wait out: a cma GET runs to its end) stays
	// short.
	ucxChunk = 8 << 20
	// ucxWindow is how many data messages a write keeps in flight: one
	// rendezvous round trip is ~250 µs, so a serial writer would idle.
	ucxWindow = 8
	// ucxWindowMsgs is how many messages a write of small pieces keeps in
	// flight, beyond ucxWindow while those hold less than ucxWindowSmall
	// bytes: a 4 KiB piece is a message of its own, and eight of them per
	// round trip left the link idle. Messages of 32 KiB and more keep to
	// ucxWindow (at 64 KiB, sixteen in flight moved less than eight).
	ucxWindowMsgs  = 64
	ucxWindowSmall = 256 << 10
	// ucxTail is what follows the frame header in every message: the
	// writer's link id and the exchange's sequence number, which a reply
	// names so that no answer is taken for another.
	ucxTail = 16
	// frameBye: a writer's link closing (not a frame of the tcp protocol).
	frameBye = 0x80
	// framePacked: a data message of several small pieces (admitPacked;
	// not a frame of the tcp protocol either). A write packs consecutive
	// pieces of at most ucxPackPiece bytes, up to ucxPackMax of them and
	// ucxPackBytes in all, so that a layer's many small runs cost a few
	// rendezvous instead of one each. Larger pieces go alone: the copy
	// into the packed payload would cost more than the messages it saves
	// (measured: 64 KiB pieces packed four to a message slowed a layer-wise
	// stream down).
	framePacked  = 0x81
	ucxPackPiece = 16 << 10
	ucxPackBytes = 256 << 10
	ucxPackMax   = 128
	ucxPackEntry = 20
	// ucxCallTimeout bounds control exchanges made on the engine's own
	// behalf (hello, goodbye, a connect back to a writer).
	ucxCallTimeout = 10 * time.Second
	// ucxReplyTimeout bounds the wait for a reply when the caller's
	// context has no deadline.
	ucxReplyTimeout = time.Minute
)

// ucxServer is an engine's UCX worker, serving both roles: it admits the
// messages of writers' links (receiver) and carries this engine's own links
// and their replies (writer).
type ucxServer struct {
	landings
	e    *Engine
	w    *ucx.Worker
	addr []byte
	// ready is closed once w and addr are set: the worker's callbacks,
	// which may run before (a peer that already had our address from a
	// previous life), wait for it, and it orders those fields before them.
	ready chan struct{}

	mu     sync.Mutex
	closed bool
	rx     map[uint64]*ucxRx // writers' links, by link id
	rxByEP map[ucx.EndpointID]*ucxRx
	tx     map[uint64]*ucxLink // our links, by link id
	txByEP map[ucx.EndpointID]*ucxLink
	wg     sync.WaitGroup // goroutines spawned from the worker's callbacks
}

var _ fence = (*ucxServer)(nil)

// ucxRx is the receiving end of one writer's link: the endpoint back to the
// writer's worker (replies go there, and its failure says the writer is
// gone), and what the link landed in since its last commit.
type ucxRx struct {
	id      uint64
	agent   AgentID
	addr    []byte // the writer's worker
	ep      ucx.EndpointID
	touched map[uint64]*Grant
	refused map[uint64]error
}

func startUCX(e *Engine) (*ucxServer, error) {
	s := &ucxServer{e: e, rx: map[uint64]*ucxRx{}, rxByEP: map[ucx.EndpointID]*ucxRx{},
		tx: map[uint64]*ucxLink{}, txByEP: map[ucx.EndpointID]*ucxLink{}, ready: make(chan struct{})}
	w, err := ucx.New(ucx.Config{Name: string(e.cfg.Agent), Admit: s.admit, OnPeerError: s.peerError, Options: e.cfg.UCX})
	if err != nil {
		return nil, fmt.Errorf("rdma: ucx: %w", err)
	}
	s.w, s.addr = w, w.Address()
	close(s.ready)
	return s, nil
}

// close ends the worker: every receive in flight ends (its Done runs), and
// UCX touches no memory it was given afterwards.
func (s *ucxServer) close() {
	s.mu.Lock()
	s.closed = true
	rxs := make([]*ucxRx, 0, len(s.rx))
	for _, r := range s.rx {
		rxs = append(rxs, r)
	}
	clear(s.rx)
	clear(s.rxByEP)
	s.mu.Unlock()
	if err := s.w.Close(); err != nil {
		// Receives UCX never ended: their staging buffers stay UCX's.
		s.e.log.Warn("rdma: ucx worker closed with receives in flight", "err", err)
	}
	s.wg.Wait()
	for _, r := range rxs {
		s.e.writerDown(r.agent, false)
	}
}

// spawn runs f on a goroutine of its own: the worker's callbacks must not
// block, and a commit or a fence waits for landings that end on the worker.
func (s *ucxServer) spawn(f func()) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		f()
	}()
}

// ucxHeader builds a message header: frame header h, then link id and seq,
// then tail.
func ucxHeader(h *header, link, seq uint64, tail ...[]byte) []byte {
	n := headerSize + ucxTail
	for _, t := range tail {
		n += len(t)
	}
	b := make([]byte, headerSize+ucxTail, n)
	h.put(b)
	binary.LittleEndian.PutUint64(b[headerSize:], link)
	binary.LittleEndian.PutUint64(b[headerSize+8:], seq)
	for _, t := range tail {
		b = append(b, t...)
	}
	return b
}

// admit decides an arriving message, on the worker's goroutine: it must
// not block (no Grant.terminate, no commit; those are spawned).
func (s *ucxServer) admit(m ucx.Message) (ucx.Admission, error) {
	<-s.ready
	b := m.Header
	if len(b) < headerSize+ucxTail {
		return ucx.Admission{}, ucx.ErrRejected
	}
	lid := binary.LittleEndian.Uint64(b[headerSize:])
	seq := binary.LittleEndian.Uint64(b[headerSize+8:])
	tail := b[headerSize+ucxTail:]
	if b[4] == frameBye {
		s.spawn(func() { s.bye(lid) })
		return ucx.Admission{}, nil
	}
	if b[4] == framePacked {
		return s.admitPacked(b, lid, tail, m)
	}
	h, err := decodeHeader(b[:headerSize])
	if err != nil {
		return ucx.Admission{}, ucx.ErrRejected
	}
	if h.typ == frameData {
		return s.admitData(&h, lid, m)
	}
	if h.typ == frameCommit {
		return s.admitCommit(&h, lid, seq, tail, m)
	}
	if m.Length != 0 {
		return ucx.Admission{}, ucx.ErrRejected
	}
	tail = append([]byte(nil), tail...)
	switch h.typ {
	case frameHello:
		s.spawn(func() { s.hello(&h, lid, seq, tail) })
	case frameFlush:
		s.spawn(func() { s.flush(&h, lid, seq) })
	case frameAbort:
		s.spawn(func() { s.abort(&h, lid, seq, tail) })
	case frameReply:
		if seq == 0 {
			s.spawn(func() { s.cutNotice(lid) })
			break
		}
		s.deliver(lid, seq, ucxReply{h: h, msg: string(tail)})
	default:
		return ucx.Admission{}, ucx.ErrRejected
	}
	return ucx.Admission{}, nil
}

// notifyCut tells writer link r that the receiver gave up on what it sends
// (a reply with sequence 0): the writer closes its endpoint, ending its
// sends in flight and the exchanges waiting for an answer.
func (s *ucxServer) notifyCut(ctx context.Context, r *ucxRx, grant uint64) {
	h := header{typ: frameReply, index: codeOf(ErrRevoked), grant: grant}
	if o, err := s.w.Post(r.ep, ucxHeader(&h, r.id, 0), nil); err == nil {
		_ = o.Wait(ctx)
	}
}

// cutNotice takes a receiver's word that it cut link lid's endpoint.
func (s *ucxServer) cutNotice(lid uint64) {
	s.mu.Lock()
	l := s.tx[lid]
	s.mu.Unlock()
	if l != nil {
		l.mu.Lock()
		ep := l.ep
		l.mu.Unlock()
		l.reset(ep)
	}
}

func (s *ucxServer) link(lid uint64) *ucxRx {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rx[lid]
}

// admitCommit takes a commit: its manifest is in the header, or (for many
// extents) its payload, received only for a commit whose token and epoch
// match an open grant.
func (s *ucxServer) admitCommit(h *header, lid, seq uint64, tail []byte, m ucx.Message) (ucx.Admission, error) {
	r := s.link(lid)
	if r == nil {
		return ucx.Admission{}, ucx.ErrRejected
	}
	if m.Length == 0 {
		mb := append([]byte(nil), tail...)
		s.spawn(func() { s.commit(r, h, seq, mb) })
		return ucx.Admission{}, nil
	}
	g, err := s.e.lookupGrant(h.grant)
	if err == nil {
		g.mu.Lock()
		err = g.checkLocked(h.epoch, &h.token)
		g.mu.Unlock()
	}
	if err == nil && uint64(m.Length) != h.length {
		err = malformed("commit payload %d bytes, want %d", m.Length, h.length)
	}
	if err != nil {
		hh := *h
		s.spawn(func() { s.settle(r, hh.grant); s.reply(r, seq, hh.grant, hh.epoch, err) })
		return ucx.Admission{}, ucx.ErrRejected
	}
	buf := make([]byte, m.Length)
	hh := *h
	return ucx.Admission{Dest: buf, Done: func(rerr error) {
		s.spawn(func() {
			if rerr != nil {
				s.settle(r, hh.grant)
				s.reply(r, seq, hh.grant, hh.epoch, fmt.Errorf("%w: receiving a manifest: %w", ErrPeerClosed, rerr))
				return
			}
			s.commit(r, &hh, seq, buf)
		})
	}}, nil
}

// commit verifies a commit against what landed and replies.
func (s *ucxServer) commit(r *ucxRx, h *header, seq uint64, mb []byte) {
	s.mu.Lock()
	err := r.refused[h.grant]
	s.mu.Unlock()
	var g *Grant
	if err == nil {
		g, err = s.e.lookupGrant(h.grant)
	}
	var man Manifest
	if err == nil {
		err = decodeManifest(mb, int(h.index), &man)
	}
	if err == nil {
		err = g.commit(h.epoch, &h.token, &man, true, h.flags&flagNoCRC == 0)
	}
	if err != nil {
		s.e.log.Debug("rdma: commit refused", "peer", string(r.agent), "grant", h.grant, "err", err)
	}
	s.settle(r, h.grant)
	s.reply(r, seq, h.grant, h.epoch, err)
}

// abort fails a grant on its writer's request (a write cut by its context:
// the link goes on serving the writer's other writes) and replies with
// the reason.
func (s *ucxServer) abort(h *header, lid, seq uint64, msg []byte) {
	r := s.link(lid)
	if r == nil {
		return
	}
	msg = msg[:min(uint64(len(msg)), h.length)]
	g, err := s.e.lookupGrant(h.grant)
	if err == nil {
		g.mu.Lock()
		err = g.checkLocked(h.epoch, &h.token)
		g.mu.Unlock()
	}
	if err == nil {
		err = writerAborted(string(r.agent), h, msg)
		g.terminate(err)
	}
	s.settle(r, h.grant)
	s.reply(r, seq, h.grant, h.epoch, err)
}

// settle forgets what link r landed in and had refused for grant.
func (s *ucxServer) settle(r *ucxRx, grant uint64) {
	s.mu.Lock()
	delete(r.touched, grant)
	delete(r.refused, grant)
	s.mu.Unlock()
}

// flush answers the end of a streamed write: the writer sent it after every
// data message of the write completed at its end, so each was admitted
// before; once the grant's landings are over they have all landed, or the
// reply says why not.
func (s *ucxServer) flush(h *header, lid, seq uint64) {
	r := s.link(lid)
	if r == nil {
		return
	}
	s.mu.Lock()
	err := r.refused[h.grant]
	s.mu.Unlock()
	if err == nil {
		var g *Grant
		if g, err = s.e.lookupGrant(h.grant); err == nil {
			g.waitLandings()
			g.mu.Lock()
			err = g.checkLocked(h.epoch, &h.token)
			g.mu.Unlock()
		}
	}
	s.settle(r, h.grant)
	s.reply(r, seq, h.grant, h.epoch, err)
}

// hello takes a writer's link: it connects back to the writer's worker
// (replies go there, and its failure tells the writer gone) and counts the
// writer (writerUp).
func (s *ucxServer) hello(h *header, lid, seq uint64, tail []byte) {
	if uint64(len(tail)) < h.length {
		return
	}
	from, to, _ := strings.Cut(string(tail[:h.length]), "\n")
	addr := tail[h.length:]
	ctx, cancel := context.WithTimeout(s.e.ctx, ucxCallTimeout)
	defer cancel()
	ep, err := s.w.Connect(ctx, addr)
	if err != nil {
		s.e.log.Warn("rdma: ucx: cannot connect back to a writer", "writer", from, "err", err)
		return
	}
	r := &ucxRx{id: lid, agent: AgentID(from), addr: addr, ep: ep, touched: map[uint64]*Grant{}, refused: map[uint64]error{}}
	if AgentID(to) != s.e.cfg.Agent {
		s.reply(r, seq, 0, 0, fmt.Errorf("%w: writer %s asked for agent %q, this is %q", ErrWrongPeer, from, to, s.e.cfg.Agent))
		_ = s.w.CloseEndpoint(ctx, ep, ucx.CloseFlush)
		return
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	old := s.rx[lid]
	s.rx[lid] = r
	s.rxByEP[ep] = r
	if old != nil {
		delete(s.rxByEP, old.ep)
	}
	s.mu.Unlock()
	s.e.writerUp(r.agent)
	if old != nil {
		s.e.writerDown(old.agent, false)
		// The writer reset the link (its endpoint is closed): it gave up
		// what it landed without committing, as a tcp writer that closes a
		// connection mid-write does, and the old endpoint back to it goes
		// as a goodbye's would.
		s.spawn(func() {
			s.failTouched(old, fmt.Errorf("%w: the writer reset its link", ErrPeerClosed))
			s.closeEP(old.ep, ucx.CloseFlush)
		})
	}
	s.reply(r, seq, 0, 0, nil)
}

// closeEP closes ep, waiting up to a second: an endpoint no link uses any
// more (its writer said goodbye or reset, or it failed). The worker keeps
// a failed one, naming its failure, until it is closed.
func (s *ucxServer) closeEP(ep ucx.EndpointID, mode ucx.CloseMode) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = s.w.CloseEndpoint(ctx, ep, mode)
}

// bye ends a writer's link that its writer closed: like the last tcp
// connection of a writer closing, the writer is reported gone when it held
// no other link, and what the link landed without committing fails.
func (s *ucxServer) bye(lid uint64) {
	s.mu.Lock()
	r := s.rx[lid]
	if r != nil {
		delete(s.rx, lid)
		delete(s.rxByEP, r.ep)
	}
	s.mu.Unlock()
	if r == nil {
		return
	}
	s.gone(r, ErrPeerClosed)
	s.closeEP(r.ep, ucx.CloseFlush)
}

// gone fails what r landed without committing and reports its writer.
func (s *ucxServer) gone(r *ucxRx, cause error) {
	s.failTouched(r, cause)
	s.e.writerDown(r.agent, true)
}

// failTouched fails the grants r landed in without committing.
func (s *ucxServer) failTouched(r *ucxRx, cause error) {
	s.mu.Lock()
	touched := make([]*Grant, 0, len(r.touched))
	for _, g := range r.touched {
		touched = append(touched, g)
	}
	clear(r.touched)
	s.mu.Unlock()
	for _, g := range touched {
		g.terminate(fmt.Errorf("ucx link from %s closed before commit: %w", r.agent, cause))
	}
}

// peerError is the worker's report that an endpoint failed (on its
// goroutine): a writer's worker that died or reset (the endpoint back to
// it), or a receiver's (one of our links).
func (s *ucxServer) peerError(ep ucx.EndpointID, err error) {
	<-s.ready
	s.mu.Lock()
	r := s.rxByEP[ep]
	if r != nil {
		delete(s.rxByEP, ep)
		delete(s.rx, r.id)
	}
	l := s.txByEP[ep]
	delete(s.txByEP, ep)
	s.mu.Unlock()
	if r != nil {
		s.spawn(func() { s.gone(r, fmt.Errorf("%w: %w", ErrPeerClosed, err)) })
	}
	if l != nil {
		l.broke(ep, err)
	}
	// Whoever used it, or none (a link replaced since): the failed
	// endpoint is done with. A write still posting on it fails all the
	// same (ErrPeerClosed).
	s.spawn(func() { s.closeEP(ep, ucx.CloseForce) })
}

// reply answers exchange seq of link r.
func (s *ucxServer) reply(r *ucxRx, seq, grant, epoch uint64, err error) {
	var msg string
	if err != nil {
		msg = err.Error()
		if len(msg) > maxMsgLen {
			msg = msg[:maxMsgLen]
		}
	}
	h := header{typ: frameReply, index: codeOf(err), grant: grant, epoch: epoch, length: uint64(len(msg))}
	if _, perr := s.w.Post(r.ep, ucxHeader(&h, r.id, seq, []byte(msg)), nil); perr != nil && !errors.Is(perr, ucx.ErrClosed) {
		s.e.log.Warn("rdma: ucx: cannot answer a writer", "writer", string(r.agent), "err", perr)
	}
}

// ucxReply is a receiver's answer, or err when none can come.
type ucxReply struct {
	h   header
	msg string
	err error
}

// deliver hands a reply to the exchange waiting for it (worker goroutine).
func (s *ucxServer) deliver(lid, seq uint64, rep ucxReply) {
	s.mu.Lock()
	l := s.tx[lid]
	s.mu.Unlock()
	if l == nil {
		return
	}
	l.wmu.Lock()
	ch := l.waits[seq]
	delete(l.waits, seq)
	l.wmu.Unlock()
	if ch != nil {
		ch <- rep
	}
}

// waitLandings waits until no landing of g is in flight: every frame
// admitted so far has landed or failed (a UCX flush: the writer's earlier
// messages were all admitted before it).
func (g *Grant) waitLandings() {
	g.mu.Lock()
	for g.inflight > 0 {
		g.quiet.Wait()
	}
	g.mu.Unlock()
}
