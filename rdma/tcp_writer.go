package rdma

// The tcp writer: a tcpLink pools a peer's connections and writes a grant's
// pieces over one of them as frames (frame.go), or over several at once
// (tcp_stripe.go).

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

const (
	// txBatchBytes bounds the payload of one writev batch when summing:
	// the writer crcs a batch right after the kernel copied it, while it
	// is still in cache (L2 is 1-2 MiB per core on current x86 servers),
	// and the receiver drains one batch while the next is sent. 1 MiB
	// measured 20-40% faster than 256 KiB (fewer, larger socket writes).
	txBatchBytes = 1 << 20
	// txBigBatchBytes bounds one writev without crc.
	txBigBatchBytes = 4 << 20
	// txBatchVecs bounds the iovecs of one batch (Linux IOV_MAX is 1024;
	// Go splits longer vectors itself).
	txBatchVecs = 1024
	// maxIdlePerPeer is how many idle connections a writer keeps per peer.
	maxIdlePerPeer = 16
)

// ctxErr is ctx.Err(), also when a connection deadline copied from ctx fired
// a moment before ctx's own timer.
func ctxErr(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
		return context.DeadlineExceeded
	}
	return nil
}

// tcpLink is a writer's pool of connections to one peer.
type tcpLink struct {
	e       *Engine
	peer    Descriptor
	stripes atomic.Bool    // the receiver accepts flush frames (striped writes)
	ipc     bool           // cuda-ipc: device pieces travel as pull frames (device.go)
	wg      sync.WaitGroup // replacements being dialled (drop)

	mu     sync.Mutex
	idle   []*txConn
	closed bool
	busy   map[*txConn]struct{}
}

// txConn is one writer connection with its reusable frame scratch.
type txConn struct {
	c      net.Conn // *net.TCPConn, or *tls.Conn over one
	tls    bool     // c is a *tls.Conn
	gather []byte   // a batch gathered for a tls.Conn (flush)
	hdrs   []byte   // frame headers of the current request
	iov    [][]byte // vectors of the current batch
	pend   []pendSum
	bufs   net.Buffers
	// unbind stops the ctx binding of the write in progress (bind).
	unbind func() bool
	rbuf   [headerSize + maxMsgLen]byte
}

// dialTCP pre-connects one connection to peer.
func dialTCP(ctx context.Context, e *Engine, peer Descriptor) (link, error) {
	l := &tcpLink{e: e, peer: peer, busy: make(map[*txConn]struct{})}
	tc, err := l.dial(ctx)
	if err != nil {
		return nil, err
	}
	l.put(tc)
	return l, nil
}

func (l *tcpLink) transport() Transport {
	if l.ipc {
		return TransportCUDAIPC
	}
	return TransportTCP
}

func (l *tcpLink) dial(ctx context.Context) (*txConn, error) {
	d := net.Dialer{Timeout: 5 * time.Second, KeepAlive: 15 * time.Second}
	nc, err := d.DialContext(ctx, "tcp", l.peer.TCPAddr)
	if err != nil {
		return nil, fmt.Errorf("rdma: dial %s at %s: %w", l.peer.Agent, l.peer.TCPAddr, err)
	}
	if l.e.cfg.TLS != nil {
		tc := tls.Client(nc, clientTLS(l.e.cfg.TLS))
		hctx, cancel := context.WithTimeout(ctx, helloTimeout)
		err := tc.HandshakeContext(hctx)
		cancel()
		if err != nil {
			nc.Close()
			return nil, fmt.Errorf("%w: tls handshake with %s at %s: %w", ErrPeerClosed, l.peer.Agent, l.peer.TCPAddr, err)
		}
		nc = tc
	}
	tc := &txConn{c: nc, tls: l.e.cfg.TLS != nil}
	features, err := handshake(ctx, nc, tc.rbuf[:], l.e.cfg.Agent, l.peer.Agent)
	if err != nil {
		nc.Close()
		return nil, err
	}
	// A receiver that predates striped writes does not know the flush frame.
	l.stripes.Store(slices.Contains(features, featureFlush))
	if l.ipc && !slices.Contains(features, featureCUDAIPC) {
		nc.Close()
		return nil, fmt.Errorf("%w: %s does not take cuda-ipc pull frames", ErrUnsupported, l.peer.Agent)
	}
	return tc, nil
}

// handshake sends our hello and checks the receiver's; it returns the
// features the receiver announced.
func handshake(ctx context.Context, nc net.Conn, buf []byte, self, peer AgentID) (features []string, err error) {
	dl := time.Now().Add(helloTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl = d
	}
	_ = nc.SetDeadline(dl)
	defer nc.SetDeadline(time.Time{})
	if ctx.Done() != nil {
		stop := context.AfterFunc(ctx, func() { _ = nc.SetDeadline(aLongTimeAgo) })
		defer func() {
			if !stop() && err == nil {
				// ctx ended as the hello did: its past deadline may land
				// after the reset above, so the connection is not used.
				features, err = nil, fmt.Errorf("hello to %s: %w", peer, ctx.Err())
			}
		}()
	}
	if _, err := nc.Write(appendHello(nil, self, peer)); err != nil {
		if cerr := ctxErr(ctx); cerr != nil {
			return nil, fmt.Errorf("hello to %s: %w", peer, cerr)
		}
		return nil, fmt.Errorf("%w: sending hello to %s: %w", ErrPeerClosed, peer, err)
	}
	h, msg, err := readReply(nc, buf)
	if err != nil {
		if cerr := ctxErr(ctx); cerr != nil {
			return nil, fmt.Errorf("hello from %s: %w", peer, cerr)
		}
		return nil, fmt.Errorf("hello from %s: %w", peer, err)
	}
	switch h.typ {
	case frameReply:
		return nil, &RemoteError{Agent: peer, Code: h.index, Msg: string(msg)}
	case frameHello:
		fields := strings.SplitN(string(msg), "\n", 3)
		if AgentID(fields[0]) != peer {
			return nil, fmt.Errorf("%w: expected %q, reached %q", ErrWrongPeer, peer, fields[0])
		}
		if len(fields) == 3 {
			return strings.Fields(fields[2]), nil
		}
		return nil, nil
	}
	return nil, malformed("handshake answered with frame type %d", h.typ)
}

// readReply reads one reply or hello frame into buf.
func readReply(r io.Reader, buf []byte) (header, []byte, error) {
	if _, err := io.ReadFull(r, buf[:headerSize]); err != nil {
		return header{}, nil, fmt.Errorf("%w: %w", ErrPeerClosed, err)
	}
	h, err := decodeHeader(buf[:headerSize])
	if err != nil {
		return h, nil, err
	}
	if h.typ != frameReply && h.typ != frameHello {
		return h, nil, malformed("expected a reply, got frame type %d", h.typ)
	}
	msg := buf[headerSize : headerSize+int(h.length)]
	if _, err := io.ReadFull(r, msg); err != nil {
		return h, nil, fmt.Errorf("%w: %w", ErrPeerClosed, err)
	}
	return h, msg, nil
}

// get takes an idle connection or dials a new one.
func (l *tcpLink) get(ctx context.Context) (*txConn, error) {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil, ErrClosed
	}
	dropped := 0
	for n := len(l.idle); n > 0; n = len(l.idle) {
		tc := l.idle[n-1]
		l.idle[n-1] = nil
		l.idle = l.idle[:n-1]
		if connBroken(tc.c) {
			// Reset or closed while idle (the receiver sends nothing
			// unsolicited): a write on it would fail with nothing sent.
			tc.c.Close()
			dropped++
			continue
		}
		l.busy[tc] = struct{}{}
		l.mu.Unlock()
		return tc, nil
	}
	l.mu.Unlock()
	tc, err := l.dial(ctx)
	if err != nil {
		if dropped > 0 { // it closed our connections and takes no new one
			return nil, fmt.Errorf("%w: %w", ErrPeerClosed, err)
		}
		return nil, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		tc.c.Close()
		return nil, ErrClosed
	}
	l.busy[tc] = struct{}{}
	return tc, nil
}

// put returns a healthy connection to the pool.
func (l *tcpLink) put(tc *txConn) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.busy, tc)
	if l.closed || len(l.idle) >= maxIdlePerPeer {
		tc.c.Close()
		return
	}
	l.idle = append(l.idle, tc)
}

// drop closes a connection that is out of sync or broken.
func (l *tcpLink) drop(tc *txConn) {
	if tc.unbind != nil {
		tc.unbind()
		tc.unbind = nil
	}
	l.mu.Lock()
	delete(l.busy, tc)
	last := !l.closed && len(l.idle) == 0 && len(l.busy) == 0
	if last {
		l.wg.Add(1)
	}
	l.mu.Unlock()
	if !last {
		tc.c.Close()
		return
	}
	// The receiver reads a writer whose connections all closed as gone
	// (Engine.OnWriterGone): a live writer connects again before it lets
	// its last connection go.
	go func() {
		defer l.wg.Done()
		ctx, cancel := context.WithTimeout(l.e.ctx, helloTimeout)
		defer cancel()
		if fresh, err := l.dial(ctx); err == nil {
			l.put(fresh)
		}
		tc.c.Close()
	}()
}

func (l *tcpLink) close() {
	l.mu.Lock()
	l.closed = true
	for _, tc := range l.idle {
		tc.c.Close()
	}
	l.idle = nil
	for tc := range l.busy {
		tc.c.Close()
	}
	l.mu.Unlock()
	l.wg.Wait() // a replacement being dialled (drop) sees closed and lets go
}

func (l *tcpLink) write(ctx context.Context, op *writeOp) error {
	if op.dev {
		return l.writeDevice(ctx, op)
	}
	if l.stripes.Load() {
		if pieces, cuts := stripe(op, l.e.cfg.TCPLanes); len(cuts) > 2 {
			return l.writeStriped(ctx, op, pieces, cuts)
		}
	}
	end := uint8(frameCommit)
	if op.partial {
		// One part of a Stream: the flush's reply says the frames landed
		// (or why not), and the commit comes with the Stream's last call.
		if !l.stripes.Load() {
			return fmt.Errorf("%w: receiver %s predates the flush frame a streamed write needs", ErrUnsupported, l.peer.Agent)
		}
		end = frameFlush
	}
	tc, err := l.get(ctx)
	if err != nil {
		return err
	}
	tc.bind(ctx)
	return l.finish(ctx, tc, op.t, tc.send(op, op.pieces, end))
}

// bind makes tc's reads and writes end with ctx, until finish.
func (tc *txConn) bind(ctx context.Context) {
	if dl, ok := ctx.Deadline(); ok {
		_ = tc.c.SetDeadline(dl)
	}
	if ctx.Done() != nil {
		tc.unbind = context.AfterFunc(ctx, func() { _ = tc.c.SetDeadline(aLongTimeAgo) })
	}
}

// finish reads the reply to what send wrote on tc for ticket t (after werr,
// a write error, it looks briefly for the receiver's reason), returns tc to
// the pool or drops it, and classifies the outcome. A reply that names
// another grant or epoch means the stream is out of step: tc is dropped.
func (l *tcpLink) finish(ctx context.Context, tc *txConn, t *Ticket, werr error) error {
	var h header
	var msg []byte
	var rerr error
	if werr != nil {
		// The receiver may have said why before closing; look briefly.
		_ = tc.c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	}
	h, msg, rerr = readReply(tc.c, tc.rbuf[:])
	if rerr == nil && h.typ == frameReply && h.index != codeMalformed && (h.grant != t.Grant || h.epoch != t.Epoch) {
		rerr = malformed("reply for grant %d epoch %d answers a frame for grant %d epoch %d", h.grant, h.epoch, t.Grant, t.Epoch)
	}
	fired := false
	if tc.unbind != nil {
		// A deadline set by ctx after this point would outlive the write.
		fired = !tc.unbind()
		tc.unbind = nil
	}
	if werr != nil || rerr != nil || h.typ != frameReply || h.index == codeMalformed || fired {
		l.drop(tc)
	} else {
		if _, ok := ctx.Deadline(); ok {
			_ = tc.c.SetDeadline(time.Time{})
		}
		l.put(tc)
	}
	if rerr == nil && h.typ == frameReply {
		if h.index == codeOK {
			if werr != nil {
				return fmt.Errorf("%w: %w", ErrPeerClosed, werr)
			}
			return nil
		}
		return &RemoteError{Agent: l.peer.Agent, Code: h.index, Msg: string(msg)}
	}
	if cerr := ctxErr(ctx); cerr != nil {
		return fmt.Errorf("rdma: write to %s: %w", l.peer.Agent, cerr)
	}
	if werr != nil {
		return fmt.Errorf("%w: writing to %s: %w", ErrPeerClosed, l.peer.Agent, werr)
	}
	if rerr == nil {
		rerr = malformed("expected a reply, got frame type %d", h.typ)
	}
	return fmt.Errorf("rdma: reply from %s: %w", l.peer.Agent, rerr)
}

// send writes the data frames and the commit with vectored writes straight
// from the source memory. Without crc the data goes out in batches of up to
// txBigBatchBytes. With crc, batches hold txBatchBytes and each is summed
// right after the kernel copied it into the socket, while it is still in
// cache: summing first, or on another core, reads the source from memory a
// second time, which costs more than the crc itself.
//
// end is the frame that closes what was sent: frameCommit (op's manifest,
// complete once every lane's pieces were sent), frameFlush (one lane of a
// striped write), or 0 for none.
func (tc *txConn) send(op *writeOp, pieces []piece, end uint8) error {
	defer func() {
		clear(tc.pend) // drop references to the source after a failed flush
		tc.pend = tc.pend[:0]
	}()
	n := len(pieces)
	m := len(op.manifest.Bytes)
	need := (n+1)*headerSize + m*manifestEntrySize
	if cap(tc.hdrs) < need {
		tc.hdrs = make([]byte, need+need/4)
	}
	hdrs := tc.hdrs[:need]
	h := header{typ: frameData, grant: op.t.Grant, epoch: op.t.Epoch, token: op.t.Token}
	iov := tc.iov[:0]
	var batch, carried uint64
	hk := op.testHooks()
	for i, f := 0, 0; i < len(pieces); f++ {
		// Pieces that continue each other in one destination extent go out
		// as one frame: a resharded source is many short slices of several
		// regions that fill an extent in order, and a frame each would cost
		// the receiver a header and a landing per slice.
		first := &pieces[i]
		j, length := i+1, uint64(len(first.src))
		for j < len(pieces) && !first.apart && !pieces[j].apart && pieces[j].ext == first.ext && pieces[j].off == first.off+length {
			length += uint64(len(pieces[j].src))
			j++
		}
		b := hdrs[f*headerSize : (f+1)*headerSize]
		h.index, h.offset, h.length = first.ext, first.off, length
		h.put(b)
		iov = append(iov, b)
		for k := i; k < j; k++ {
			p := &pieces[k]
			if op.noCRC {
				iov = append(iov, p.src)
				batch += uint64(len(p.src))
				if batch >= txBigBatchBytes || len(iov) >= txBatchVecs {
					if hk.writing != nil {
						hk.writing(op.t, carried)
					}
					if err := tc.flush(iov); err != nil {
						return err
					}
					iov, batch, carried = tc.iov[:0], 0, carried+batch
				}
				continue
			}
			// A long payload goes out as several vectors of one frame, so that
			// no batch outgrows the cache.
			for src := p.src; len(src) > 0; {
				n := min(len(src), txBatchBytes)
				iov = append(iov, src[:n])
				sum := &op.manifest.CRC[p.ext]
				if p.apart {
					sum = &p.crc
				}
				tc.pend = append(tc.pend, pendSum{sum, src[:n]})
				src = src[n:]
				batch += uint64(n)
				if batch >= txBatchBytes || len(iov) >= txBatchVecs {
					if hk.writing != nil {
						hk.writing(op.t, carried)
					}
					if err := tc.flush(iov); err != nil {
						return err
					}
					tc.sumPending()
					iov, batch, carried = tc.iov[:0], 0, carried+batch
				}
			}
		}
		i = j
	}
	if len(tc.pend) > 0 {
		// The commit needs the last sums: send the rest of the data first.
		if hk.writing != nil {
			hk.writing(op.t, carried)
		}
		if err := tc.flush(iov); err != nil {
			return err
		}
		tc.sumPending()
		iov = tc.iov[:0]
	}
	if len(iov) > 0 && hk.writing != nil { // the last batch (without crc) goes with the end frame
		hk.writing(op.t, carried)
	}
	cb := hdrs[n*headerSize:]
	switch end {
	case frameCommit:
		if hk.commit != nil {
			hk.commit(op.t)
		}
		ch := header{typ: frameCommit, flags: op.commitFlags(), index: uint32(m), grant: op.t.Grant, epoch: op.t.Epoch, token: op.t.Token, length: uint64(m * manifestEntrySize)}
		ch.put(cb)
		putManifest(cb[headerSize:], op.manifest)
		iov = append(iov, cb)
	case frameFlush:
		fh := header{typ: frameFlush, grant: op.t.Grant, epoch: op.t.Epoch, token: op.t.Token}
		fh.put(cb)
		iov = append(iov, cb[:headerSize])
	}
	if len(iov) == 0 {
		return nil
	}
	if err := tc.flush(iov); err != nil {
		return err
	}
	if end == frameCommit && hk.sent != nil {
		hk.sent(op.t.Grant)
	}
	return nil
}

// pendSum is bytes that were sent but not summed yet, and the crc they
// extend: the manifest's for their extent, or their piece's own.
type pendSum struct {
	crc *uint32
	b   []byte
}

// sumPending folds the bytes just sent into their crcs, in order.
func (tc *txConn) sumPending() {
	for i, p := range tc.pend {
		*p.crc = crc32Update(*p.crc, p.b)
		tc.pend[i] = pendSum{}
	}
	tc.pend = tc.pend[:0]
}

func (tc *txConn) flush(iov [][]byte) error {
	tc.iov = iov[:0] // keep the backing array; WriteTo consumes tc.bufs
	if tc.tls {
		// A tls.Conn writes each buffer as records of its own: gather the
		// batch first, so that it goes out in full-size records (a 64-byte
		// header would otherwise cost a record, and its seal, per frame).
		tc.gather = tc.gather[:0]
		for _, b := range iov {
			tc.gather = append(tc.gather, b...)
		}
		_, err := tc.c.Write(tc.gather)
		return err
	}
	tc.bufs = iov
	_, err := tc.bufs.WriteTo(tc.c)
	tc.bufs = nil
	return err
}
