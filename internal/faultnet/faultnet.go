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
