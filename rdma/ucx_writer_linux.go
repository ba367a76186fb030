//go:build linux && cgo && ucx

package rdma

// The ucx transport's writer side: a link to one peer's UCX worker
// (ucx_linux.go has the receiver and the protocol).

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/handoff-io/handoff/internal/ucx"
)

// ucxLink is the writer side of ucx to one peer: one endpoint to its
// worker, replaced once it failed.
type ucxLink struct {
	s    *ucxServer
	peer Descriptor
	id   uint64
	seq  atomic.Uint64

	mu     sync.Mutex // held while (re)connecting
	ep     ucx.EndpointID
	up     bool
	closed bool

	wmu   sync.Mutex
	waits map[uint64]chan ucxReply
}

func dialUCX(ctx context.Context, e *Engine, peer Descriptor) (link, error) {
	var id [8]byte
	_, _ = rand.Read(id[:])
	l := &ucxLink{s: e.ucx, peer: peer, id: binary.LittleEndian.Uint64(id[:]), waits: map[uint64]chan ucxReply{}}
	l.s.mu.Lock()
	if l.s.closed {
		l.s.mu.Unlock()
		return nil, ErrClosed
	}
	l.s.tx[l.id] = l
	l.s.mu.Unlock()
	if _, err := l.endpoint(ctx); err != nil {
		l.close()
		return nil, err
	}
	return l, nil
}

func (l *ucxLink) transport() Transport { return TransportUCX }

// endpoint returns the link's endpoint, connecting (and saying hello) when
// it has none.
func (l *ucxLink) endpoint(ctx context.Context) (ucx.EndpointID, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return 0, ErrClosed
	}
	if l.up {
		return l.ep, nil
	}
	return l.connectLocked(ctx)
}

// connectLocked makes a new endpoint to the peer and says hello on it;
// l.mu is held.
func (l *ucxLink) connectLocked(ctx context.Context) (ucx.EndpointID, error) {
	ep, err := l.s.w.Connect(ctx, l.peer.UCXAddr)
	if err != nil {
		return 0, fmt.Errorf("rdma: ucx connect to %s: %w", l.peer.Agent, err)
	}
	l.s.mu.Lock()
	l.s.txByEP[ep] = l
	l.s.mu.Unlock()
	hello := string(l.s.e.cfg.Agent) + "\n" + string(l.peer.Agent)
	h := header{typ: frameHello, index: protocolVersion, length: uint64(len(hello))}
	hctx, cancel := context.WithTimeout(ctx, helloTimeout)
	defer cancel()
	rep, err := l.exchange(hctx, ep, &h, []byte(hello), l.s.addr)
	if err == nil && rep.h.index != codeOK {
		err = &RemoteError{Agent: l.peer.Agent, Code: rep.h.index, Msg: rep.msg}
	}
	if err != nil {
		l.drop(ep)
		return 0, fmt.Errorf("hello to %s over ucx: %w", l.peer.Agent, err)
	}
	l.ep, l.up = ep, true
	return ep, nil
}

// drop closes ep by force (its operations fail at once) and forgets it.
func (l *ucxLink) drop(ep ucx.EndpointID) {
	l.s.mu.Lock()
	delete(l.s.txByEP, ep)
	l.s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), ucxCallTimeout)
	defer cancel()
	_ = l.s.w.CloseEndpoint(ctx, ep, ucx.CloseForce)
}

// broke marks ep failed (worker goroutine: must not block) and ends the
// exchanges waiting on it.
func (l *ucxLink) broke(ep ucx.EndpointID, err error) {
	if l.mu.TryLock() {
		if l.ep == ep {
			l.up = false
		}
		l.mu.Unlock()
	} else {
		// A (re)connect holds mu; its exchange fails below and it drops
		// the endpoint itself.
		l.s.spawn(func() {
			l.mu.Lock()
			if l.ep == ep {
				l.up = false
			}
			l.mu.Unlock()
		})
	}
	l.failWaits(fmt.Errorf("%w: ucx endpoint to %s failed: %w", ErrPeerClosed, l.peer.Agent, err))
}

// failWaits ends every exchange waiting for a reply with err: the endpoint
// it went by is gone, so no reply comes.
func (l *ucxLink) failWaits(err error) {
	l.wmu.Lock()
	waits := l.waits
	l.waits = map[uint64]chan ucxReply{}
	l.wmu.Unlock()
	for _, ch := range waits {
		ch <- ucxReply{err: err}
	}
}

// reset replaces an endpoint whose operations must end now (a write or an
// exchange cut by its context, a receiver's cut notice): it closes ep by
// force, which ends its sends in flight and the exchanges waiting on it.
//
// It says hello on a new endpoint first. The receiver takes the failure of
// its endpoint back to this worker, which UCX brings down with ep (the two
// share a tcp connection), for this writer gone (Engine.OnWriterGone); the
// hello moves the link to a new endpoint pair before that, as a tcp writer
// connects again before it lets its last connection go. A hello that fails
// within ucxReconnectWait leaves the link down (the next write connects)
// and the receiver free to count the writer gone: it did not answer.
func (l *ucxLink) reset(ep ucx.EndpointID) {
	l.mu.Lock()
	if l.ep != ep || !l.up {
		l.mu.Unlock()
		return
	}
	l.up = false
	l.failWaits(fmt.Errorf("%w: ucx endpoint to %s was cut", ErrPeerClosed, l.peer.Agent))
	if !l.closed {
		ctx, cancel := context.WithTimeout(l.s.e.ctx, ucxReconnectWait)
		_, _ = l.connectLocked(ctx) // up again on success
		cancel()
	}
	l.mu.Unlock()
	l.drop(ep)
}

// ucxReconnectWait bounds the hello that reset says before it cuts an
// endpoint: the caller (a cancelled write) waits for it.
const ucxReconnectWait = time.Second

// exchange posts one header-only message (or one with payload) and waits
// for the receiver's reply naming it.
// It is the hello of an endpoint being connected (l.mu held): a cut one
// is dropped directly, not through reset.
func (l *ucxLink) exchange(ctx context.Context, ep ucx.EndpointID, h *header, tail []byte, more []byte) (ucxReply, error) {
	return l.exchangeOn(ctx, ep, l.drop, h, nil, tail, more)
}

func (l *ucxLink) exchangePayload(ctx context.Context, ep ucx.EndpointID, h *header, payload []byte, tail ...[]byte) (ucxReply, error) {
	return l.exchangeOn(ctx, ep, l.reset, h, payload, tail...)
}

// exchangeOn posts one message and waits for its reply; cut ends ep when
// the wait is given up, so that the send in flight ends too.
func (l *ucxLink) exchangeOn(ctx context.Context, ep ucx.EndpointID, cut func(ucx.EndpointID), h *header, payload []byte, tail ...[]byte) (ucxReply, error) {
	seq := l.seq.Add(1)
	ch := make(chan ucxReply, 1)
	l.wmu.Lock()
	l.waits[seq] = ch
	l.wmu.Unlock()
	defer func() {
		l.wmu.Lock()
		delete(l.waits, seq)
		l.wmu.Unlock()
	}()
	op, err := l.s.w.Post(ep, ucxHeader(h, l.id, seq, tail...), payload)
	if err != nil {
		return ucxReply{}, fmt.Errorf("%w: %w", ErrPeerClosed, err)
	}
	opDone := op.Done()
	// A receiver that forgot this link (its endpoint back to us failed)
	// drops what the link sends without an answer: bound the wait when
	// the caller did not, and start afresh (hello) on the next write.
	var silence <-chan time.Time
	if _, ok := ctx.Deadline(); !ok {
		tm := time.NewTimer(ucxReplyTimeout)
		defer tm.Stop()
		silence = tm.C
	}
	for {
		select {
		case <-silence:
			cut(ep)
			if opDone != nil {
				<-opDone
			}
			return ucxReply{}, fmt.Errorf("%w: no reply from %s over ucx in %s", ErrPeerClosed, l.peer.Agent, ucxReplyTimeout)
		case rep := <-ch:
			if rep.err != nil {
				return rep, rep.err
			}
			if opDone != nil {
				<-opDone // the payload is in use until then
			}
			return rep, nil
		case <-opDone:
			opDone = nil
			if err := op.Err(); err != nil && !errors.Is(err, ucx.ErrRejected) {
				return ucxReply{}, fmt.Errorf("%w: ucx send to %s: %w", ErrPeerClosed, l.peer.Agent, err)
			}
		case <-ctx.Done():
			if opDone != nil {
				// The message's send is let end by itself first (a
				// manifest the receiver is fetching): cutting it resets
				// the link, which every write to the peer shares.
				t := time.NewTimer(ucxCutWait)
				select {
				case <-opDone:
				case <-t.C:
					cut(ep)
					<-opDone
				}
				t.Stop()
			}
			return ucxReply{}, fmt.Errorf("rdma: exchange with %s: %w", l.peer.Agent, ctx.Err())
		}
	}
}

// write posts each piece as messages of up to ucxChunk bytes, at most
// ucxWindow in flight (up to ucxWindowMsgs while they are small), summing
// each chunk while UCX moves it; then the commit (or, for one write of a
// stream, a flush), whose reply is the verdict.
func (l *ucxLink) write(ctx context.Context, op *writeOp) error {
	if op.dev {
		return fmt.Errorf("%w: ucx from device memory", ErrUnsupported)
	}
	ep, err := l.endpoint(ctx)
	if err != nil {
		return err
	}
	hk := op.testHooks()
	var inflight []*ucx.Op
	var sizes []int // of inflight's messages
	inBytes := 0
	rejected := false
	var fatal error
	var cut ucxCut
	wait := func(o *ucx.Op) {
		if err := o.Wait(ctx); err != nil {
			switch {
			case ctx.Err() != nil:
				if fatal == nil {
					fatal = fmt.Errorf("rdma: write to %s: %w", l.peer.Agent, ctx.Err())
				}
				cut.end(l, ep, o)
			case errors.Is(err, ucx.ErrRejected):
				rejected = true
			case fatal == nil:
				fatal = fmt.Errorf("%w: ucx send to %s: %w", ErrPeerClosed, l.peer.Agent, err)
			}
		}
	}
	var packs [][]byte // of inflight's messages: a packed payload to free once sent, or nil
	done := func() {
		wait(inflight[0])
		freeStage(packs[0])
		inflight, inBytes, sizes, packs = inflight[1:], inBytes-sizes[0], sizes[1:], packs[1:]
	}
	post := func(b, payload, pack []byte) bool {
		o, err := l.s.w.Post(ep, b, payload)
		if err != nil {
			freeStage(pack)
			fatal = fmt.Errorf("%w: ucx send to %s: %w", ErrPeerClosed, l.peer.Agent, err)
			return false
		}
		inflight, sizes, packs = append(inflight, o), append(sizes, len(payload)), append(packs, pack)
		inBytes += len(payload)
		for len(inflight) >= ucxWindowMsgs || (len(inflight) >= ucxWindow && inBytes >= ucxWindowSmall) {
			done()
		}
		return true
	}
	maxPack := min(ucxPackMax, (l.s.w.MaxHeader()-headerSize-ucxTail)/ucxPackEntry)
	h := header{typ: frameData, grant: op.t.Grant, epoch: op.t.Epoch, token: op.t.Token}
	var carried uint64
	for i := 0; i < len(op.pieces) && fatal == nil && !rejected; i++ {
		if n := packable(op.pieces[i:], maxPack); n > 1 {
			pk := op.pieces[i : i+n]
			if hk.writing != nil {
				hk.writing(op.t, carried)
			}
			b, payload, err := packPieces(&h, l.id, pk)
			if err != nil {
				fatal = err
				break
			}
			for j := range pk {
				op.sum(&pk[j], pk[j].src)
				carried += uint64(len(pk[j].src))
			}
			post(b, payload, payload)
			i += n - 1
			continue
		}
		p := &op.pieces[i]
		for off := 0; off < len(p.src) && fatal == nil && !rejected; {
			n := min(len(p.src)-off, ucxChunk)
			chunk := p.src[off : off+n]
			h.index, h.offset, h.length = p.ext, p.off+uint64(off), uint64(n)
			if hk.writing != nil {
				hk.writing(op.t, carried)
			}
			if !post(ucxHeader(&h, l.id, 0), chunk, nil) {
				break
			}
			op.sum(p, chunk)
			off += n
			carried += uint64(n)
		}
	}
	for len(inflight) > 0 {
		done()
	}
	if fatal == nil && ctx.Err() != nil {
		// Cut once its data went out (a wait that found the send done
		// may not have looked at ctx): no commit follows, as for a cut
		// mid-data.
		fatal = fmt.Errorf("rdma: write to %s: %w", l.peer.Agent, ctx.Err())
	}
	if fatal != nil {
		if ctx.Err() != nil {
			cut.abort(l, ep, op, fatal)
		}
		return fatal
	}
	var rep ucxReply
	if op.partial {
		h = header{typ: frameFlush, grant: op.t.Grant, epoch: op.t.Epoch, token: op.t.Token}
		rep, err = l.exchangePayload(ctx, ep, &h, nil)
	} else {
		m := len(op.manifest.Bytes)
		mb := make([]byte, m*manifestEntrySize)
		putManifest(mb, op.manifest)
		h = header{typ: frameCommit, flags: op.commitFlags(), grant: op.t.Grant, epoch: op.t.Epoch, token: op.t.Token, index: uint32(m), length: uint64(len(mb))}
		if hk.commit != nil {
			hk.commit(op.t)
		}
		if hk.sent != nil {
			defer hk.sent(op.t.Grant)
		}
		if headerSize+ucxTail+len(mb) <= l.s.w.MaxHeader() {
			rep, err = l.exchangePayload(ctx, ep, &h, nil, mb)
		} else {
			rep, err = l.exchangePayload(ctx, ep, &h, mb)
		}
	}
	if err != nil {
		if ctx.Err() != nil {
			// Cut waiting for the verdict: the receiver may have
			// committed; if not, the abort fails the grant now rather
			// than at its deadline.
			cut.abort(l, ep, op, err)
		}
		return err
	}
	if rep.h.grant != op.t.Grant || rep.h.epoch != op.t.Epoch {
		return malformed("ucx reply for grant %d epoch %d answers grant %d epoch %d", rep.h.grant, rep.h.epoch, op.t.Grant, op.t.Epoch)
	}
	if rep.h.index != codeOK {
		return &RemoteError{Agent: l.peer.Agent, Code: rep.h.index, Msg: rep.msg}
	}
	if rejected {
		return fmt.Errorf("%w: %s refused data of grant %d", ErrPeerClosed, l.peer.Agent, op.t.Grant)
	}
	return nil
}

// ucxCutWait bounds how long a write cut by its context lets its sends in
// flight end by themselves, and then its abort's reply, before it resets
// the link.
const ucxCutWait = time.Second

// ucxCut ends a write that its context cut. The link is shared by every
// write to the peer, so the cut write's sends in flight are let end (they
// are at most a window) and an abort tells the receiver to fail its grant
// alone: the peer's other writes go on. A peer that does not take the sends
// or answer the abort within ucxCutWait gets the link reset, which ends
// every operation on it and fails what each write landed uncommitted.
type ucxCut struct {
	by    time.Time // zero until the first send waited for
	reset bool
}

// end waits for o, a send of the cut write, until the bound, then resets.
func (c *ucxCut) end(l *ucxLink, ep ucx.EndpointID, o *ucx.Op) {
	if c.by.IsZero() {
		c.by = time.Now().Add(ucxCutWait)
	}
	if !c.reset {
		t := time.NewTimer(time.Until(c.by))
		select {
		case <-o.Done():
		case <-t.C:
			c.reset = true
			l.reset(ep) // ends the operations in flight (ErrCanceled)
		}
		t.Stop()
	}
	<-o.Done()
}

// abort asks the receiver to fail op's grant (the writer gave it up:
// ErrPeerClosed, as a reset would say), unless a reset did already; a
// receiver that does not answer gets the link reset.
func (c *ucxCut) abort(l *ucxLink, ep ucx.EndpointID, op *writeOp, reason error) {
	if c.reset {
		return
	}
	reason = fmt.Errorf("%w: writer cancelled: %w", ErrPeerClosed, reason)
	msg := reason.Error()
	if n := min(maxMsgLen, l.s.w.MaxHeader()-headerSize-ucxTail); len(msg) > n {
		msg = msg[:max(n, 0)]
	}
	h := header{typ: frameAbort, index: codeOf(reason), grant: op.t.Grant, epoch: op.t.Epoch, token: op.t.Token, length: uint64(len(msg))}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(l.s.e.ctx), ucxCutWait)
	defer cancel()
	if _, err := l.exchangeOn(ctx, ep, l.reset, &h, nil, []byte(msg)); err != nil {
		l.reset(ep)
	}
}

// packable returns how many of the first pieces go in one packed message:
// consecutive pieces of at most ucxPackPiece bytes, at most max of them and
// ucxPackBytes in all (fewer than two: none).
func packable(pieces []piece, max int) int {
	n, total := 0, 0
	for n < len(pieces) && n < max {
		k := len(pieces[n].src)
		if k == 0 || k > ucxPackPiece || total+k > ucxPackBytes {
			break
		}
		total += k
		n++
	}
	return n
}

// packPieces builds a packed message of pieces (a framePacked header,
// whose tail lists them) and its payload, their bytes one after another in
// a staging buffer (ucxStage: no zeroing, no garbage), which the caller
// frees once the send completed.
func packPieces(h *header, link uint64, pieces []piece) (b, payload []byte, err error) {
	total := 0
	for i := range pieces {
		total += len(pieces[i].src)
	}
	if payload, err = ucxStage(total); err != nil {
		return nil, nil, err
	}
	table := make([]byte, 0, len(pieces)*ucxPackEntry)
	pos := 0
	for i := range pieces {
		p := &pieces[i]
		table = binary.LittleEndian.AppendUint32(table, p.ext)
		table = binary.LittleEndian.AppendUint64(table, p.off)
		table = binary.LittleEndian.AppendUint64(table, uint64(len(p.src)))
		pos += copy(payload[pos:], p.src)
	}
	ph := header{typ: frameData, grant: h.grant, epoch: h.epoch, token: h.token, index: uint32(len(pieces)), length: uint64(total)}
	b = ucxHeader(&ph, link, 0, table)
	b[4] = framePacked
	return b, payload, nil
}

// close says goodbye (the receiver reports the writer gone once its last
// link went, as for tcp) and closes the endpoint.
func (l *ucxLink) close() {
	l.mu.Lock()
	l.closed = true
	ep, up := l.ep, l.up
	l.up = false
	l.mu.Unlock()
	if up {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		h := header{typ: frameBye}
		b := ucxHeader(&h, l.id, 0)
		b[4] = frameBye
		if o, err := l.s.w.Post(ep, b, nil); err == nil {
			_ = o.Wait(ctx)
		}
		cancel()
		l.s.mu.Lock()
		delete(l.s.txByEP, ep)
		l.s.mu.Unlock()
		// By force: the goodbye went (or could not), and a flush close
		// needs the peer, which may be stopped; UCX closes an endpoint
		// once, so a flush that never completes could not be forced later,
		// and a write still waiting on the endpoint would wait with it.
		ctx, cancel = context.WithTimeout(context.Background(), ucxCallTimeout)
		_ = l.s.w.CloseEndpoint(ctx, ep, ucx.CloseForce)
		cancel()
	}
	// An exchange still waiting for its reply gets none now (and, ep gone
	// from txByEP, no peer error either): it ends here, not at its deadline.
	l.failWaits(fmt.Errorf("%w: ucx link to %s closed", ErrClosed, l.peer.Agent))
	l.s.mu.Lock()
	delete(l.s.tx, l.id)
	l.s.mu.Unlock()
}
