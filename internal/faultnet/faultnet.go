// Package faultnet is a fault-injecting TCP proxy for tests: put it between
// a client and a server and it forwards bytes both ways, with faults a test
// turns on and off while connections are live:
//
//   - SetLatency: every chunk waits the given time before it is forwarded
//     (one way, in each direction), as on a long link: throughput is not
//     capped by it, up to a window of in-flight chunks per direction.
//   - SetBandwidth: bytes per second in each direction, shared by all
//     connections, as one link.
//   - Reset and ResetAfter: connections are cut with an RST (SO_LINGER 0)
//     on both sides, at once or once exactly n more bytes went upstream,
//     so the cut can land inside a frame. ResetClientAfter cuts only the
//     client's side and keeps the server's open and silent, as when the
//     RST towards the server is lost: the client learns of the cut first.
//   - Blackhole and BlackholeAfter: the proxy stops reading and writing in
//     both directions and keeps every socket open: no FIN, no RST, as a
//     peer whose host vanished. New connections are accepted and held.
//     Heal resumes forwarding.
//
// Upstream is client to server (the side that dialled the proxy to the
// target); byte triggers count upstream bytes over all connections.
//
// Every goroutine belongs to the Proxy and ends with Close; Start registers
// Close as a test cleanup.
package faultnet

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

const (
	chunkSize = 32 << 10
	// window is how many chunks one direction holds between reading and
	// writing: with latency, a direction carries at most window*chunkSize
	// bytes per latency period.
	window = 256
)

// Proxy forwards TCP connections from its listener to a target address.
type Proxy struct {
	ln     net.Listener
	target string
	done   chan struct{}
	wg     sync.WaitGroup

	mu      sync.Mutex
	closed  bool
	conns   map[*conn]struct{}
	latency time.Duration
	rate    int64         // bytes per second per direction, all connections; 0 unlimited
	next    [2]time.Time  // per direction: when the shared link is free again
	healed  chan struct{} // closed while forwarding; open while blackholed
	trig    *trigger

	accepted, resets   atomic.Int64
	upBytes, downBytes atomic.Int64
}

type faultKind int

const (
	faultReset faultKind = iota
	faultResetClient
	faultBlackhole
)

// trigger is a fault armed to fire after left more upstream bytes.
type trigger struct {
	kind    faultKind
	left    int64
	fired   chan struct{} // closed once the fault was applied
	settled chan struct{} // closed once it fired, or its connection ended first
}

// Start listens on a fresh loopback port, forwards to target and closes the
// proxy when t ends.
func Start(t testing.TB, target string) *Proxy {
	t.Helper()
	p, err := New("127.0.0.1:0", target)
	if err != nil {
		t.Fatalf("faultnet: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// New listens on addr and forwards every connection to target.
func New(addr, target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	healed := make(chan struct{})
	close(healed)
	p := &Proxy{ln: ln, target: target, done: make(chan struct{}), conns: make(map[*conn]struct{}), healed: healed}
	p.wg.Go(p.accept)
	return p, nil
}

// Addr is the address clients dial instead of the target.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// SetLatency delays every chunk by d before it is forwarded, each direction.
func (p *Proxy) SetLatency(d time.Duration) {
	p.mu.Lock()
	p.latency = d
	p.mu.Unlock()
}

// SetBandwidth caps each direction at bytesPerSec, over all connections
// together; 0 removes the cap.
func (p *Proxy) SetBandwidth(bytesPerSec int64) {
	p.mu.Lock()
	p.rate = bytesPerSec
	p.next = [2]time.Time{}
	p.mu.Unlock()
}

// Reset cuts every live connection with an RST on both sides (the server
// side only, for a connection whose client side was cut already).
func (p *Proxy) Reset() {
	p.mu.Lock()
	cs := make([]*conn, 0, len(p.conns))
	for c := range p.conns {
		cs = append(cs, c)
	}
	p.mu.Unlock()
	for _, c := range cs {
		c.reset()
	}
}

// ResetAfter arms a reset: once n more bytes went upstream, the connection
// that carried the n-th byte is cut with an RST on both sides right after
// forwarding it. The returned channel is closed when the reset happened.
func (p *Proxy) ResetAfter(n int64) <-chan struct{} { return p.arm(faultReset, n) }

// ResetClientAfter arms a one-sided reset: once n more bytes went
// upstream, the connection that carried the n-th byte is cut with an RST
// towards the client only, right after forwarding it; its server side stays
// open and nothing more is forwarded on it (until Close or Reset). The
// returned channel is closed when the cut happened.
func (p *Proxy) ResetClientAfter(n int64) <-chan struct{} { return p.arm(faultResetClient, n) }

// BlackholeAfter arms a blackhole: once n more bytes went upstream, the
// proxy forwards the n-th byte and then stops, as Blackhole. The returned
// channel is closed when the blackhole began.
func (p *Proxy) BlackholeAfter(n int64) <-chan struct{} { return p.arm(faultBlackhole, n) }

// Disarm drops a trigger armed by ResetAfter, ResetClientAfter or
// BlackholeAfter that has not begun to fire; its channel stays open. One
// that has begun (its n-th byte read, not yet forwarded) is waited for
// until it took effect, or its connection ended first, so that no fault
// lands after Disarm returns: a blackhole may then have begun, which Heal
// ends. The connection's last chunk waits for Heal when the proxy is
// blackholed: heal first.
func (p *Proxy) Disarm() {
	p.mu.Lock()
	tr := p.trig
	firing := tr != nil && tr.left == 0
	if tr != nil && !firing {
		p.trig = nil
	}
	p.mu.Unlock()
	if firing {
		select {
		case <-tr.settled:
		case <-p.done:
		}
	}
}

func (p *Proxy) arm(k faultKind, n int64) <-chan struct{} {
	if n < 1 {
		panic("faultnet: a trigger needs at least one byte")
	}
	tr := &trigger{kind: k, left: n, fired: make(chan struct{}), settled: make(chan struct{})}
	p.mu.Lock()
	p.trig = tr
	p.mu.Unlock()
	return tr.fired
}

// Blackhole stops all forwarding, in both directions, on every connection
// and every connection accepted later, and keeps the sockets open. Bytes
// already read stay in the proxy until Heal.
func (p *Proxy) Blackhole() {
	p.mu.Lock()
	select {
	case <-p.healed:
		p.healed = make(chan struct{})
	default:
	}
	p.mu.Unlock()
}

// Heal ends a blackhole: forwarding resumes where it stopped.
func (p *Proxy) Heal() {
	p.mu.Lock()
	select {
	case <-p.healed:
	default:
		close(p.healed)
	}
	p.mu.Unlock()
}

// Stats are the proxy's counters.
type Stats struct {
	Accepted  int64 // connections accepted
	Live      int   // connections open now
	Resets    int64 // connections cut with an RST
	UpBytes   int64 // bytes forwarded client to server
	DownBytes int64 // bytes forwarded server to client
}

// Stats returns the proxy's counters.
func (p *Proxy) Stats() Stats {
	p.mu.Lock()
	live := len(p.conns)
	p.mu.Unlock()
	return Stats{Accepted: p.accepted.Load(), Live: live, Resets: p.resets.Load(), UpBytes: p.upBytes.Load(), DownBytes: p.downBytes.Load()}
}

// Close stops the listener, closes every connection (a plain close, FIN)
// and waits for every goroutine of the proxy to end. It is idempotent.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		p.wg.Wait()
		return nil
	}
	p.closed = true
	close(p.done)
	cs := make([]*conn, 0, len(p.conns))
	for c := range p.conns {
		cs = append(cs, c)
	}
	p.mu.Unlock()
	err := p.ln.Close()
	for _, c := range cs {
		c.close()
	}
	p.wg.Wait()
	return err
}

func (p *Proxy) gate() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.healed
}

func (p *Proxy) accept() {
	for {
		nc, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		p.accepted.Add(1)
		c := &conn{p: p, client: nc.(*net.TCPConn), done: make(chan struct{})}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			nc.Close()
			return
		}
		p.conns[c] = struct{}{}
		p.wg.Add(1)
		p.mu.Unlock()
		go func() {
			defer p.wg.Done()
			c.run()
		}()
	}
}

// conn is one proxied connection: client is the accepted socket, server
// the one dialled to the target.
type conn struct {
	p       *Proxy
	client  *net.TCPConn
	done    chan struct{} // closed by close or sever: the goroutines end
	stop    sync.Once     // closes done
	once    sync.Once
	severed atomic.Bool // the client side was cut, the server side is kept

	mu     sync.Mutex
	server *net.TCPConn
	halves int // directions that ended with EOF
}

func (c *conn) run() {
	defer func() {
		if !c.severed.Load() {
			c.close()
		}
	}()
	// A blackholed proxy holds new connections without dialling.
	select {
	case <-c.p.gate():
	case <-c.done:
		return
	}
	nc, err := net.DialTimeout("tcp", c.p.target, 5*time.Second)
	if err != nil {
		return
	}
	c.mu.Lock()
	select {
	case <-c.done:
		c.mu.Unlock()
		nc.Close()
		return
	default:
	}
	c.server = nc.(*net.TCPConn)
	c.mu.Unlock()
	var wg sync.WaitGroup
	up := make(chan chunk, window)
	down := make(chan chunk, window)
	wg.Go(func() { c.read(c.client, up, true) })
	wg.Go(func() { c.write(c.server, up, 0) })
	wg.Go(func() { c.read(c.server, down, false) })
	wg.Go(func() { c.write(c.client, down, 1) })
	wg.Wait()
}

// chunk is bytes read from one side, or a marker: eof (the side closed its
// write half), or ack (closed once the chunk was written).
type chunk struct {
	b   []byte
	at  time.Time
	eof bool
	ack chan struct{}
}

// read moves bytes from src into q; upstream reads count towards triggers.
func (c *conn) read(src *net.TCPConn, q chan<- chunk, upstream bool) {
	for {
		select {
		case <-c.p.gate():
		case <-c.done:
			return
		}
		size := chunkSize
		c.p.mu.Lock()
		if r := c.p.rate / 50; r > 0 && r < int64(size) {
			size = int(r) // smooth pacing: about 20 ms of the link per chunk
		}
		c.p.mu.Unlock()
		b := make([]byte, size)
		n, err := src.Read(b)
		if n > 0 {
			if !c.forward(q, b[:n], upstream) {
				return
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				c.push(q, chunk{eof: true, at: time.Now()})
				return
			}
			if !c.severed.Load() {
				c.close()
			}
			return
		}
	}
}

// forward queues b, applying an armed trigger; false means the connection
// is over.
func (c *conn) forward(q chan<- chunk, b []byte, upstream bool) bool {
	if !upstream {
		return c.push(q, chunk{b: b, at: time.Now()})
	}
	for {
		c.p.mu.Lock()
		tr := c.p.trig
		if tr == nil {
			c.p.mu.Unlock()
			return c.push(q, chunk{b: b, at: time.Now()})
		}
		if tr.left == 0 && tr.kind != faultBlackhole {
			// Another connection carried the n-th byte and is being cut:
			// a reset is that connection's alone, and this one goes on
			// (waiting would hold every other connection's bytes for as
			// long as the cut connection's last chunk takes to be written).
			c.p.mu.Unlock()
			return c.push(q, chunk{b: b, at: time.Now()})
		}
		if tr.left == 0 {
			// Another connection begins a blackhole, which stops every
			// connection: wait until it took effect (or came to nothing).
			c.p.mu.Unlock()
			select {
			case <-tr.settled:
			case <-c.done:
				return false
			}
			select {
			case <-c.p.gate():
			case <-c.done:
				return false
			}
			continue
		}
		n := min(int64(len(b)), tr.left)
		tr.left -= n
		if tr.left > 0 {
			c.p.mu.Unlock()
			return c.push(q, chunk{b: b, at: time.Now()})
		}
		c.p.mu.Unlock()
		// This connection carries the n-th byte: forward up to it, then
		// apply the fault. If the connection ends first, the fault is void
		// (its channel stays open): the trigger must not keep holding the
		// others.
		ack := make(chan struct{})
		ok := c.push(q, chunk{b: b[:n], at: time.Now(), ack: ack})
		if ok {
			select {
			case <-ack:
			case <-c.done:
				ok = false
			}
		}
		// The fault is applied before the trigger is dropped: a Disarm
		// meanwhile finds it firing and waits for it to settle.
		settle := func() {
			c.p.mu.Lock()
			if c.p.trig == tr {
				c.p.trig = nil
			}
			c.p.mu.Unlock()
			close(tr.settled)
		}
		if !ok {
			settle()
			return false
		}
		switch tr.kind {
		case faultReset:
			c.reset()
			close(tr.fired)
			settle()
			return false
		case faultResetClient:
			c.sever()
			close(tr.fired)
			settle()
			return false
		case faultBlackhole:
			c.p.Blackhole()
			close(tr.fired)
			settle()
			// The rest of b waits for Heal.
			select {
			case <-c.p.gate():
			case <-c.done:
				return false
			}
			b = b[n:]
			if len(b) == 0 {
				return true
			}
		}
	}
}

func (c *conn) push(q chan<- chunk, ch chunk) bool {
	select {
	case q <- ch:
		return true
	case <-c.done:
		return false
	}
}

// write moves chunks from q to dst after the latency, paced by the
// bandwidth of direction dir.
func (c *conn) write(dst *net.TCPConn, q <-chan chunk, dir int) {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	sleepUntil := func(t time.Time) bool {
		d := time.Until(t)
		if d <= 0 {
			return true
		}
		if timer == nil {
			timer = time.NewTimer(d)
		} else {
			timer.Reset(d)
		}
		select {
		case <-timer.C:
			return true
		case <-c.done:
			return false
		}
	}
	for {
		var ch chunk
		select {
		case ch = <-q:
		case <-c.done:
			return
		}
		c.p.mu.Lock()
		lat := c.p.latency
		c.p.mu.Unlock()
		if !sleepUntil(ch.at.Add(lat)) {
			return
		}
		select {
		case <-c.p.gate():
		case <-c.done:
			return
		}
		if ch.eof {
			c.halfClose(dst)
			return
		}
		c.p.mu.Lock()
		var until time.Time
		if r := c.p.rate; r > 0 {
			start := time.Now()
			if c.p.next[dir].After(start) {
				start = c.p.next[dir]
			}
			until = start.Add(time.Duration(int64(len(ch.b)) * int64(time.Second) / r))
			c.p.next[dir] = until
		}
		c.p.mu.Unlock()
		if !sleepUntil(until) {
			return
		}
		if _, err := dst.Write(ch.b); err != nil {
			if !c.severed.Load() {
				c.close()
			}
			return
		}
		if dir == 0 {
			c.p.upBytes.Add(int64(len(ch.b)))
		} else {
			c.p.downBytes.Add(int64(len(ch.b)))
		}
		if ch.ack != nil {
			close(ch.ack)
		}
	}
}

// halfClose passes an EOF on; the connection closes once both directions
// ended.
func (c *conn) halfClose(dst *net.TCPConn) {
	_ = dst.CloseWrite()
	c.mu.Lock()
	c.halves++
	both := c.halves == 2
	c.mu.Unlock()
	if both {
		c.close()
	}
}

// reset cuts both sides with an RST.
func (c *conn) reset() {
	c.mu.Lock()
	srv := c.server
	c.mu.Unlock()
	_ = c.client.SetLinger(0)
	if srv != nil {
		_ = srv.SetLinger(0)
	}
	c.p.resets.Add(1)
	c.close()
}

// sever cuts the client side with an RST and ends the connection's
// goroutines, keeping the server side open: it closes with the proxy (or
// Reset).
func (c *conn) sever() {
	c.severed.Store(true)
	c.stop.Do(func() { close(c.done) })
	_ = c.client.SetLinger(0)
	_ = c.client.Close()
	c.p.resets.Add(1)
}

// close closes both sockets and ends the connection's goroutines.
func (c *conn) close() {
	c.once.Do(func() {
		c.mu.Lock()
		c.stop.Do(func() { close(c.done) })
		srv := c.server
		c.mu.Unlock()
		c.client.Close()
		if srv != nil {
			srv.Close()
		}
		c.p.mu.Lock()
		delete(c.p.conns, c)
		c.p.mu.Unlock()
	})
}
