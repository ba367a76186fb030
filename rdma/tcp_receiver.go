package rdma

// The receiving end of the frame protocol: tcpServer accepts writer
// connections, and an rxConn serves each, tcp or the shm control socket
// (shm_receiver_linux.go), landing data frames into grants and answering commits.
// The tcp writer is in tcp_writer.go, striped writes in tcp_stripe.go.

import (
	"bufio"
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
)

const (
	// rxBufSize is the receiver's read buffer. A payload at least this long
	// is read straight into the destination extent; shorter frames arrive
	// through the buffer, many per read(2), so small extents do not cost two
	// syscalls each. 64 KiB keeps 1 MiB extents ~94% zero-copy.
	rxBufSize = 64 << 10
	// landChunk is the unit in which landings are filled and summed: data
	// is checksummed right after it was copied, while it is in L2.
	landChunk = 128 << 10
	// rxReadChunk bounds one read straight into a destination; each read
	// is then summed in landChunk pieces while it is in L2.
	rxReadChunk = 256 << 10
	// maxRefusals bounds the refusals a connection remembers until a commit.
	maxRefusals = 16
	// helloTimeout bounds the handshake.
	helloTimeout = 10 * time.Second
)

// aLongTimeAgo is a deadline that makes blocked reads and writes return.
var aLongTimeAgo = time.Unix(1, 0)

// tcpServer accepts writer connections and lands their data frames. It is
// the receiving side of tcp and of cuda-ipc (whose pull frames travel on
// its connections), and their fence is landings: every data frame and pull
// is admitted by Grant.beginLand, and a fence cuts the read or chunked copy
// in progress (rxConn.abortLanding; pullFence) and waits for it.
type tcpServer struct {
	landings
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

// advertised is the address peers dial for listener a: advertise as
// configured, where a port of 0 (never dialable) stands for the
// listener's, so that one interface's address can be advertised for a
// listener on an ephemeral port; defaultAdvertise when none is configured.
func advertised(advertise string, a *net.TCPAddr) string {
	if advertise == "" {
		return defaultAdvertise(a)
	}
	if h, p, err := net.SplitHostPort(advertise); err == nil && p == "0" {
		return net.JoinHostPort(h, strconv.Itoa(a.Port))
	}
	return advertise
}

func startTCP(e *Engine, addr, advertise string) (*tcpServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("rdma: tcp listen %s: %w", addr, err)
	}
	advertise = advertised(advertise, ln.Addr().(*net.TCPAddr))
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
			if errors.Is(err, net.ErrClosed) || !s.e.acceptAgain("tcp", err) {
				return
			}
			continue
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

var _ fence = (*tcpServer)(nil)

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
	cur     *Grant       // last grant looked up
	touched []*Grant     // grants this connection landed bytes in since its last commit
	refused []rejection  // refusals since the last commit
	aborted atomic.Bool  // a grant fence set our read deadline
	pulled  []pulledFrom // writer processes whose cuda-ipc exports this connection opened, by device
	shm     *shmRxState  // shm only
	counted bool         // writerUp was called for this connection (hello)
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

// acceptAgain reports whether a listener's accept loop goes on after err,
// once it paused: out of descriptors or memory for now (EMFILE, ENFILE,
// ENOBUFS, ENOMEM), the connections already served go on, and the
// listener serves the next writer once some were let go. Stopping would
// leave a listener the kernel still completes dials to, which no one
// answers. Any other error ends the loop; so does Close.
func (e *Engine) acceptAgain(transport string, err error) bool {
	if !errors.Is(err, syscall.EMFILE) && !errors.Is(err, syscall.ENFILE) &&
		!errors.Is(err, syscall.ENOBUFS) && !errors.Is(err, syscall.ENOMEM) {
		e.log.Error("rdma: accept failed: the data path takes no more writers", "transport", transport, "err", err)
		return false
	}
	e.log.Warn("rdma: accept", "transport", transport, "err", err)
	t := time.NewTimer(acceptPause)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-e.ctx.Done():
		return false
	}
}

// acceptPause is how long an accept loop waits after running out of
// descriptors or memory.
const acceptPause = 50 * time.Millisecond

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
		err = writerAborted(c.peer, h, c.mbuf)
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
