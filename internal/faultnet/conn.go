package faultnet

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

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
