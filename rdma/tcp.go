package rdma

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/handoff-io/handoff/internal/crc32c"
)

const (
	// rxBufSize is the receiver's read buffer. A payload at least this long
	// is read straight into the destination extent; shorter frames arrive
	// through the buffer, many per read(2), so small extents do not cost two
	// syscalls each. 64 KiB keeps 1 MiB extents ~94% zero-copy.
	rxBufSize = 64 << 10
	// txBatchBytes bounds the payload of one writev batch when summing:
	// the writer crcs a batch right after the kernel copied it, while it
	// is still in cache (L2 is 1-2 MiB per core on current x86 servers),
	// and the receiver drains one batch while the next is sent. 1 MiB
	// measured 20-40% faster than 256 KiB (fewer, larger socket writes).
	txBatchBytes = 1 << 20
	// landChunk is the unit in which landings are filled and summed: data
	// is checksummed right after it was copied, while it is in L2.
	landChunk = 128 << 10
	// rxReadChunk bounds one read straight into a destination; each read
	// is then summed in landChunk pieces while it is in L2.
	rxReadChunk = 256 << 10
	// txBigBatchBytes bounds one writev without crc.
	txBigBatchBytes = 4 << 20
	// txBatchVecs bounds the iovecs of one batch (Linux IOV_MAX is 1024;
	// Go splits longer vectors itself).
	txBatchVecs = 1024
	// maxIdlePerPeer is how many idle connections a writer keeps per peer.
	maxIdlePerPeer = 16
	// defaultTCPLanes is Config.TCPLanes' default.
	defaultTCPLanes = 4
	// laneMinBytes is the least a lane of a striped write carries: below it
	// the lane's flush round trip costs more than the parallelism gives.
	laneMinBytes = 1 << 20
	// maxRefusals bounds the refusals a connection remembers until a commit.
	maxRefusals = 16
	// helloTimeout bounds the handshake.
	helloTimeout = 10 * time.Second
)

// aLongTimeAgo is a deadline that makes blocked reads and writes return.
var aLongTimeAgo = time.Unix(1, 0)

// ----- receiver -----

// tcpServer accepts writer connections and lands their data frames.
type tcpServer struct {
	e         *Engine
	ln        net.Listener
	advertise string

	mu     sync.Mutex
	conns  map[*rxConn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// defaultAdvertise is the address peers dial when none was configured: the
// listener's, except that a wildcard listener (":7400") is advertised by this
// machine's host name where that resolves (containers on one network resolve
// each other's), since no peer can dial a wildcard address from elsewhere.
func defaultAdvertise(a *net.TCPAddr) string {
	if a.IP.IsUnspecified() {
		if h, err := os.Hostname(); err == nil && h != "" {
			if addrs, err := net.LookupHost(h); err == nil && len(addrs) > 0 {
				return net.JoinHostPort(h, strconv.Itoa(a.Port))
			}
		}
	}
	return a.String()
}

func startTCP(e *Engine, addr, advertise string) (*tcpServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("rdma: tcp listen %s: %w", addr, err)
	}
	if advertise == "" {
		advertise = defaultAdvertise(ln.Addr().(*net.TCPAddr))
	}
	if e.cfg.TLS != nil {
		ln = tls.NewListener(ln, serverTLS(e.cfg.TLS))
	}
	s := &tcpServer{e: e, ln: ln, advertise: advertise, conns: make(map[*rxConn]struct{})}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

func (s *tcpServer) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				s.e.log.Warn("rdma: tcp accept", "err", err)
			}
			return
		}
		rc := newRxConn(s.e, c, TransportTCP)
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			continue
		}
		s.conns[rc] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			rc.serve()
			s.mu.Lock()
			delete(s.conns, rc)
			s.mu.Unlock()
		}()
	}
}

// close stops accepting, closes every connection and waits for their goroutines.
func (s *tcpServer) close() {
	s.mu.Lock()
	s.closed = true
	s.ln.Close()
	for c := range s.conns {
		c.c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// rejection remembers why frames of a grant were refused until its commit.
type rejection struct {
	grant uint64
	err   error
}

// rxConn is the receiving end of one writer connection (tcp, or the shm
// control socket, where no data frames are allowed).
type rxConn struct {
	e       *Engine
	c       net.Conn
	br      *bufio.Reader
	kind    Transport
	peer    string
	hbuf    [headerSize]byte
	out     []byte // reply scratch
	mbuf    []byte // manifest payload scratch
	man     Manifest
	cur     *Grant      // last grant looked up
	touched []*Grant    // grants this connection landed bytes in since its last commit
	refused []rejection // refusals since the last commit
	aborted atomic.Bool // a grant fence set our read deadline
	pids    []int       // writer processes whose cuda-ipc exports this connection opened
	shm     *shmRxState // shm only
	counted bool        // writerUp was called for this connection (hello)
}

func newRxConn(e *Engine, c net.Conn, kind Transport) *rxConn {
	return &rxConn{e: e, c: c, br: bufio.NewReaderSize(c, rxBufSize), kind: kind, peer: "?"}
}

// abortLanding makes a read blocked in a landing return (Revoke, deadline).
func (c *rxConn) abortLanding() {
	c.aborted.Store(true)
	_ = c.c.SetReadDeadline(aLongTimeAgo)
}

// serve runs the connection until the peer closes it, a frame is malformed,
// or the engine closes. Grants the connection landed bytes in without
// committing fail with ErrPeerClosed (or ErrMalformedFrame).
func (c *rxConn) serve() {
	var cause error
	// The writer closed this connection (or its process died) when a read
	// found the end, or when a fence cut a landing and what the writer still
	// sent ended in a hang-up (a killed writer's connections all end at once,
	// and the first to fail its grant fences the others' reads). A malformed
	// frame or our own close say nothing about the writer.
	hungUp := false
	defer func() {
		c.c.Close()
		for _, g := range c.touched {
			g.terminate(fmt.Errorf("connection from %s closed before commit: %w", c.peer, cause))
		}
		if c.shm != nil {
			c.shm.closed(cause, hungUp)
		}
		c.forgetGone()
	}()
	cause = c.hello()
	if cause != nil {
		if c.counted {
			c.e.writerDown(AgentID(c.peer), false)
		}
		c.e.log.Warn("rdma: handshake refused", "transport", string(c.kind), "remote", c.c.RemoteAddr().String(), "err", cause)
		return
	}
	defer func() {
		hungUp = hungUp || errors.Is(cause, ErrPeerClosed) && !errors.Is(cause, errFenced)
		c.e.writerDown(AgentID(c.peer), hungUp)
	}()
	for {
		_, err := io.ReadFull(c.br, c.hbuf[:])
		if err != nil {
			switch {
			case errors.Is(err, io.EOF):
				cause = ErrPeerClosed
				return
			case errors.Is(err, net.ErrClosed):
				cause = ErrClosed
				return
			}
			cause = fmt.Errorf("%w: reading a frame header: %w", ErrPeerClosed, err)
			c.logEnd(cause)
			return
		}
		h, err := decodeHeader(c.hbuf[:])
		if err == nil {
			switch {
			case h.typ == frameData && c.kind == TransportTCP:
				err = c.data(&h)
			case h.typ == frameCommit:
				err = c.commit(&h)
			case h.typ == frameAbort:
				err = c.abort(&h)
			case h.typ == frameFlush && c.kind == TransportTCP:
				err = c.flush(&h)
			case h.typ == framePull && c.kind == TransportTCP:
				err = c.pull(&h)
			default:
				err = malformed("unexpected frame type %d on %s", h.typ, c.kind)
			}
		}
		if err != nil {
			cause = err
			if errors.Is(err, ErrMalformedFrame) {
				c.reply(h.grant, h.epoch, err)
			}
			if errors.Is(err, errFenced) {
				hungUp = c.drainToEnd()
			}
			c.logEnd(err)
			return
		}
	}
}

// fenceDrain is the silence that ends drainToEnd, fenceDrainMax its bound.
const (
	fenceDrain    = 50 * time.Millisecond
	fenceDrainMax = time.Second
)

// drainToEnd reads and drops what the writer still sends after a fence cut
// a landing, and reports whether the writer hung up: a writer that died ends
// its stream right after the bytes its kernel had queued, a live one keeps
// the connection open waiting for a reply. It stops at the end of the
// stream, after fenceDrain without a byte, or after fenceDrainMax: a dead
// writer's queued bytes (megabytes, at the pace of a loaded machine) do not
// pass for a live writer's silence.
func (c *rxConn) drainToEnd() bool {
	until := time.Now().Add(fenceDrainMax)
	for {
		dl := time.Now().Add(fenceDrain)
		if dl.After(until) {
			dl = until
		}
		_ = c.c.SetReadDeadline(dl)
		if _, err := c.br.Discard(rxBufSize); err != nil {
			return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)
		}
	}
}

func (c *rxConn) logEnd(err error) {
	if errors.Is(err, net.ErrClosed) {
		return
	}
	c.e.log.Warn("rdma: writer connection ended", "transport", string(c.kind), "peer", c.peer, "err", err)
}

// hello exchanges agent ids: the writer says who it is and whom it wants.
func (c *rxConn) hello() error {
	_ = c.c.SetReadDeadline(time.Now().Add(helloTimeout))
	defer c.c.SetReadDeadline(time.Time{})
	if _, err := io.ReadFull(c.br, c.hbuf[:]); err != nil {
		return fmt.Errorf("%w: reading hello: %w", ErrPeerClosed, err)
	}
	h, err := decodeHeader(c.hbuf[:])
	if err == nil && h.typ != frameHello {
		err = malformed("first frame has type %d, want hello", h.typ)
	}
	if err != nil {
		c.reply(0, 0, err)
		return err
	}
	p := make([]byte, h.length)
	if _, err := io.ReadFull(c.br, p); err != nil {
		return fmt.Errorf("%w: reading hello: %w", ErrPeerClosed, err)
	}
	from, to, ok := strings.Cut(string(p), "\n")
	to, _, _ = strings.Cut(to, "\n") // later fields: features of newer writers
	if !ok {
		err := malformed("hello payload %q is not from\\nto", p)
		c.reply(0, 0, err)
		return err
	}
	c.peer = from
	if AgentID(to) != c.e.cfg.Agent {
		err := fmt.Errorf("%w: writer %s asked for agent %q, this is %q", ErrWrongPeer, from, to, c.e.cfg.Agent)
		c.reply(0, 0, err)
		return err
	}
	// Counted before the answer: a writer that replaces a connection closes
	// the old one once this answer is in (Engine.OnWriterGone).
	c.e.writerUp(AgentID(from))
	c.counted = true
	if c.shm != nil {
		return c.shm.hello(c)
	}
	// The answer lists what this receiver understands beyond version 1
	// frames; a writer that predates a feature reads only the first field.
	_, err = c.c.Write(appendHello(c.out[:0], c.e.cfg.Agent, AgentID(from), c.e.rxFeatures()...))
	return err
}

// tcpFeatures are the optional frames a tcp receiver accepts, announced in
// its hello answer: featureFlush, the striped writes' flush frame.
var tcpFeatures = []string{featureFlush}

const featureFlush = "flush"

func appendHello(b []byte, from, to AgentID, features ...string) []byte {
	msg := string(from) + "\n" + string(to)
	if len(features) > 0 {
		msg += "\n" + strings.Join(features, " ")
	}
	h := header{typ: frameHello, index: protocolVersion, length: uint64(len(msg))}
	b = append(b, make([]byte, headerSize)...)
	h.put(b[len(b)-headerSize:])
	return append(b, msg...)
}

// grant looks a grant up, caching the last one.
func (c *rxConn) grant(id uint64) (*Grant, error) {
	if c.cur != nil && c.cur.id == id {
		return c.cur, nil
	}
	g, err := c.e.lookupGrant(id)
	if err != nil {
		return nil, err
	}
	c.cur = g
	return g, nil
}

// data lands one data frame, or refuses it and skips its payload. The
// returned error ends the connection.
func (c *rxConn) data(h *header) error {
	g, err := c.grant(h.grant)
	var ld landing
	if err == nil {
		ld, err = g.beginLand(h.epoch, &h.token, h.index, h.offset, h.length, c)
	}
	if err != nil {
		c.e.stats.framesRefused.Add(1)
		c.refuse(h.grant, err)
		if _, derr := c.br.Discard(int(h.length)); derr != nil {
			return fmt.Errorf("%w: skipping a refused payload: %w", ErrPeerClosed, derr)
		}
		return nil
	}
	var rerr error
	if ld.dev.a != nil {
		rerr = c.landStaged(&ld)
	}
	for off := 0; off < len(ld.dst) && rerr == nil; {
		end := min(off+rxReadChunk, len(ld.dst))
		var n int
		n, rerr = io.ReadFull(c.br, ld.dst[off:end])
		for s := off; s < off+n; s += landChunk {
			ld.fill(ld.dst[s:min(s+landChunk, off+n)])
		}
		off += n
	}
	g.endLand(&ld, rerr == nil, c)
	if len(c.touched) == 0 || c.touched[len(c.touched)-1] != g {
		c.touched = append(c.touched, g)
	}
	if c.aborted.Swap(false) {
		// A fence raced with the end of this read; the read itself was whole.
		_ = c.c.SetReadDeadline(time.Time{})
	}
	if rerr != nil {
		// A fence cuts the read with a deadline in the past; anything else
		// (end of stream, reset) is the writer's side going away, even when
		// the grant failed meanwhile (another of its connections closed).
		if errors.Is(rerr, os.ErrDeadlineExceeded) && g.Err() != nil {
			return fmt.Errorf("%w: %w", errFenced, g.Err())
		}
		return fmt.Errorf("%w: mid-frame: %w", ErrPeerClosed, rerr)
	}
	return nil
}

func (c *rxConn) refuse(grant uint64, err error) {
	for _, r := range c.refused {
		if r.grant == grant {
			return
		}
	}
	if len(c.refused) >= maxRefusals {
		// A writer spraying frames at many grants: stop remembering. A
		// commit for a forgotten grant is refused by the grant's own checks.
		return
	}
	c.refused = append(c.refused, rejection{grant, err})
	c.e.log.Debug("rdma: frame refused", "peer", c.peer, "grant", grant, "err", err)
}

// refusal is why this connection refused frames of grant since its last
// commit, or nil.
func (c *rxConn) refusal(grant uint64) error {
	for _, r := range c.refused {
		if r.grant == grant {
			return r.err
		}
	}
	return nil
}

// commit verifies a commit frame and replies. The returned error ends the
// connection (only write failures and malformed payloads do).
//
// The manifest (up to 12 MiB) is held only for a commit whose token and
// epoch match an open grant: any other is refused and its payload skipped
// unbuffered, so a peer that knows nothing but the agent id cannot make the
// receiver allocate.
func (c *rxConn) commit(h *header) error {
	err := c.refusal(h.grant)
	var g *Grant
	if err == nil {
		g, err = c.grant(h.grant)
	}
	if err == nil {
		g.mu.Lock()
		err = g.checkLocked(h.epoch, &h.token)
		g.mu.Unlock()
	}
	if err != nil {
		if _, derr := c.br.Discard(int(h.length)); derr != nil {
			return fmt.Errorf("%w: skipping a refused manifest: %w", ErrPeerClosed, derr)
		}
	} else {
		n := int(h.length)
		if cap(c.mbuf) < n {
			c.mbuf = make([]byte, n)
		}
		c.mbuf = c.mbuf[:n]
		if _, err := io.ReadFull(c.br, c.mbuf); err != nil {
			return fmt.Errorf("%w: reading a manifest: %w", ErrPeerClosed, err)
		}
		if err := decodeManifest(c.mbuf, int(h.index), &c.man); err != nil {
			return err
		}
		if c.shm != nil {
			err = c.shm.commit(g, h, &c.man)
		} else {
			err = g.commit(h.epoch, &h.token, &c.man, true, h.flags&flagNoCRC == 0)
		}
	}
	if err != nil {
		c.e.log.Debug("rdma: commit refused", "peer", c.peer, "grant", h.grant, "err", err)
	}
	clear(c.touched)
	c.touched = c.touched[:0]
	clear(c.refused)
	c.refused = c.refused[:0]
	c.cur = nil
	return c.reply(h.grant, h.epoch, err)
}

// flush answers the end of one lane of a striped write: every earlier frame
// of this connection has landed by now, or was refused, and the reply says
// which. The grant is no longer this connection's to fail if it closes: its
// bytes are all in, and the commit comes on another connection.
func (c *rxConn) flush(h *header) error {
	err := c.refusal(h.grant)
	if err == nil {
		var g *Grant
		if g, err = c.grant(h.grant); err == nil {
			g.mu.Lock()
			err = g.checkLocked(h.epoch, &h.token)
			g.mu.Unlock()
		}
	}
	c.touched = slices.DeleteFunc(c.touched, func(g *Grant) bool { return g.id == h.grant })
	c.refused = slices.DeleteFunc(c.refused, func(r rejection) bool { return r.grant == h.grant })
	return c.reply(h.grant, h.epoch, err)
}

// abort fails a grant on its writer's request and replies with the reason.
func (c *rxConn) abort(h *header) error {
	n := int(h.length)
	if cap(c.mbuf) < n {
		c.mbuf = make([]byte, n)
	}
	c.mbuf = c.mbuf[:n]
	if _, err := io.ReadFull(c.br, c.mbuf); err != nil {
		return fmt.Errorf("%w: reading an abort: %w", ErrPeerClosed, err)
	}
	g, err := c.grant(h.grant)
	if err == nil {
		g.mu.Lock()
		err = g.checkLocked(h.epoch, &h.token)
		g.mu.Unlock()
	}
	if err == nil {
		err = fmt.Errorf("writer %s aborted grant %d: %w: %s", c.peer, h.grant, codeSentinels[h.index], c.mbuf)
		if h.index == codeInternal {
			err = fmt.Errorf("writer %s aborted grant %d: %s", c.peer, h.grant, c.mbuf)
		}
		g.terminate(err)
	}
	c.cur = nil
	return c.reply(h.grant, h.epoch, err)
}

// reply sends a status frame for grant.
func (c *rxConn) reply(grant, epoch uint64, err error) error {
	var msg string
	if err != nil {
		msg = err.Error()
		if len(msg) > maxMsgLen {
			msg = msg[:maxMsgLen]
		}
	}
	if cap(c.out) < headerSize+maxMsgLen {
		c.out = make([]byte, 0, headerSize+maxMsgLen)
	}
	b := c.out[:headerSize]
	h := header{typ: frameReply, index: codeOf(err), grant: grant, epoch: epoch, length: uint64(len(msg))}
	h.put(b)
	b = append(b, msg...)
	if _, werr := c.c.Write(b); werr != nil {
		return fmt.Errorf("%w: sending a reply: %w", ErrPeerClosed, werr)
	}
	return nil
}

// errFenced ends a connection whose landing a fence aborted (its read was
// cut mid-frame, so the stream is out of step).
var errFenced = errors.New("rdma: landing aborted by fence")

// ----- writer -----

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

// stripe divides op's pieces among up to lanes lanes of about equal bytes,
// at least laneMinBytes each, splitting a piece where a lane ends. It
// returns the pieces in order and the cut points between lanes (first 0,
// last len(pieces)); no cuts means one connection carries it all. The
// pieces of an extent that two lanes share are marked apart: lanes run
// concurrently and an extent's crc runs in order, so each such piece is
// summed on its own and the sums are joined in order after the lanes
// (crc32c.Combine), as the receiver joins its landings' sums.
func stripe(op *writeOp, lanes int) ([]piece, []int) {
	k := min(uint64(lanes), op.n/laneMinBytes)
	if k < 2 {
		return nil, nil
	}
	all := make([]piece, 0, len(op.pieces)+int(k))
	cuts := make([]int, 1, k+1)
	var acc uint64 // bytes before the current lane's end
	for _, p := range op.pieces {
		for len(p.src) > 0 {
			lane := uint64(len(cuts)) // 1-based lane number
			end := op.n * lane / k
			if lane == k {
				end = op.n
			}
			n := min(uint64(len(p.src)), end-acc)
			all = append(all, piece{ext: p.ext, off: p.off, src: p.src[:n], apart: op.partial})
			p.off, p.src = p.off+n, p.src[n:]
			acc += n
			if acc == end && lane < k {
				cuts = append(cuts, len(all))
			}
		}
	}
	cuts = append(cuts, len(all))
	// Mark the extents that span a cut.
	for _, c := range cuts[1 : len(cuts)-1] {
		if c == 0 || c == len(all) || all[c-1].ext != all[c].ext {
			continue
		}
		ext := all[c].ext
		for i := c - 1; i >= 0 && all[i].ext == ext; i-- {
			all[i].apart = true
		}
		for i := c; i < len(all) && all[i].ext == ext; i++ {
			all[i].apart = true
		}
	}
	return all, cuts
}

// writeStriped sends pieces over len(cuts)-1 connections at once: each lane
// but the first ends with a flush, and once every flush was answered the
// first lane, whose own data went out meanwhile, commits, with the sums of
// the pieces marked apart joined into the manifest.
func (l *tcpLink) writeStriped(ctx context.Context, op *writeOp, pieces []piece, cuts []int) error {
	k := len(cuts) - 1
	lanes := make([]*txConn, k)
	for i := range lanes {
		tc, err := l.get(ctx)
		if err != nil {
			for _, tc := range lanes[:i] {
				l.put(tc)
			}
			return err
		}
		lanes[i] = tc
	}
	for _, tc := range lanes {
		tc.bind(ctx)
	}
	errs := make([]error, k)
	var lanesDone sync.WaitGroup
	for i := 1; i < k; i++ {
		lanesDone.Go(func() {
			tc := lanes[i]
			errs[i] = l.finish(ctx, tc, op.t, tc.send(op, pieces[cuts[i]:cuts[i+1]], frameFlush))
		})
	}
	tc := lanes[0]
	if op.partial {
		// Every lane of a Stream's part ends with a flush; the Stream joins
		// the pieces' sums, so it gets the pieces as they were cut.
		errs[0] = l.finish(ctx, tc, op.t, tc.send(op, pieces[:cuts[1]], frameFlush))
		lanesDone.Wait()
		op.pieces = append(op.pieces[:0], pieces...)
		return errors.Join(errs...)
	}
	werr := tc.send(op, pieces[:cuts[1]], 0)
	lanesDone.Wait()
	if !op.noCRC {
		for i := range pieces {
			if p := &pieces[i]; p.apart {
				op.manifest.CRC[p.ext] = crc32c.Combine(op.manifest.CRC[p.ext], p.crc, int64(len(p.src)))
			}
		}
	}
	if err := errors.Join(errs[1:]...); err != nil {
		// No commit: dropping the first lane fails the grant on the
		// receiver (a connection that landed bytes and closed).
		l.drop(tc)
		if werr != nil {
			err = errors.Join(err, fmt.Errorf("%w: writing to %s: %w", ErrPeerClosed, l.peer.Agent, werr))
		}
		return err
	}
	if werr == nil {
		werr = tc.send(op, nil, frameCommit)
	}
	return l.finish(ctx, tc, op.t, werr)
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
	var batch uint64
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
					if err := tc.flush(iov); err != nil {
						return err
					}
					iov, batch = tc.iov[:0], 0
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
					if err := tc.flush(iov); err != nil {
						return err
					}
					tc.sumPending()
					iov, batch = tc.iov[:0], 0
				}
			}
		}
		i = j
	}
	if len(tc.pend) > 0 {
		// The commit needs the last sums: send the rest of the data first.
		if err := tc.flush(iov); err != nil {
			return err
		}
		tc.sumPending()
		iov = tc.iov[:0]
	}
	cb := hdrs[n*headerSize:]
	switch end {
	case frameCommit:
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
	return tc.flush(iov)
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
