package faultnet

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/handoff-io/handoff/internal/leakcheck"
	"github.com/stretchr/testify/require"
)

// server accepts connections and hands each to serve on its own goroutine;
// everything ends on test cleanup.
type server struct {
	ln    net.Listener
	conns chan net.Conn // every accepted connection, for the test to inspect
	wg    sync.WaitGroup
}

func startServer(t *testing.T, serve func(net.Conn)) *server {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &server{ln: ln, conns: make(chan net.Conn, 16)}
	var mu sync.Mutex
	var open []net.Conn
	s.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			open = append(open, c)
			mu.Unlock()
			select {
			case s.conns <- c:
			default:
			}
			if serve != nil {
				s.wg.Go(func() { serve(c) })
			}
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range open {
			c.Close()
		}
		mu.Unlock()
		s.wg.Wait()
	})
	return s
}

// echo sends back what it reads and passes the client's FIN on.
func echo(c net.Conn) {
	_, _ = io.Copy(c, c)
	_ = c.(*net.TCPConn).CloseWrite()
}

func dial(t *testing.T, p *Proxy) *net.TCPConn {
	t.Helper()
	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn)
}

func roundTrip(t *testing.T, c net.Conn, msg []byte) {
	t.Helper()
	require.NoError(t, c.SetDeadline(time.Now().Add(10*time.Second)))
	errc := make(chan error, 1)
	go func() { _, err := c.Write(msg); errc <- err }()
	got := make([]byte, len(msg))
	_, err := io.ReadFull(c, got)
	require.NoError(t, err)
	require.NoError(t, <-errc)
	require.True(t, bytes.Equal(msg, got), "echo differs")
}

func pattern(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7 + i>>8)
	}
	return b
}

func TestForwardAndClose(t *testing.T) {
	leakcheck.Check(t)
	s := startServer(t, echo)
	p := Start(t, s.ln.Addr().String())
	c := dial(t, p)
	roundTrip(t, c, pattern(3<<20))
	roundTrip(t, c, []byte("x"))
	// A client's FIN reaches the server, and the server's comes back.
	require.NoError(t, c.CloseWrite())
	n, err := c.Read(make([]byte, 1))
	require.Equal(t, 0, n)
	require.ErrorIs(t, err, io.EOF)
	st := p.Stats()
	require.Equal(t, int64(1), st.Accepted)
	require.Equal(t, int64(3<<20+1), st.UpBytes)
	require.Equal(t, int64(3<<20+1), st.DownBytes)
	require.NoError(t, p.Close())
	require.NoError(t, p.Close(), "Close is idempotent")
}

func TestLatency(t *testing.T) {
	s := startServer(t, echo)
	p := Start(t, s.ln.Addr().String())
	c := dial(t, p)
	roundTrip(t, c, []byte("warm"))
	p.SetLatency(40 * time.Millisecond)
	start := time.Now()
	roundTrip(t, c, []byte("x"))
	require.GreaterOrEqual(t, time.Since(start), 80*time.Millisecond, "one way each direction")
	// Latency does not cap throughput: 4 MiB still go through in well under 4*latency*window.
	start = time.Now()
	roundTrip(t, c, pattern(4<<20))
	require.Less(t, time.Since(start), 5*time.Second)
	p.SetLatency(0)
	start = time.Now()
	roundTrip(t, c, []byte("y"))
	require.Less(t, time.Since(start), 40*time.Millisecond)
}

func TestBandwidth(t *testing.T) {
	got := make(chan int64, 1)
	s := startServer(t, func(c net.Conn) {
		n, _ := io.Copy(io.Discard, c)
		got <- n
	})
	p := Start(t, s.ln.Addr().String())
	p.SetBandwidth(1 << 20)
	c := dial(t, p)
	start := time.Now()
	_, err := c.Write(pattern(256 << 10))
	require.NoError(t, err)
	require.NoError(t, c.CloseWrite())
	require.Equal(t, int64(256<<10), <-got)
	require.GreaterOrEqual(t, time.Since(start), 200*time.Millisecond, "256 KiB at 1 MiB/s")
}

func TestResetAfterCutsInsideTheStream(t *testing.T) {
	type result struct {
		n   int64
		err error
	}
	got := make(chan result, 1)
	s := startServer(t, func(c net.Conn) {
		n, err := io.Copy(io.Discard, c)
		got <- result{n, err}
	})
	p := Start(t, s.ln.Addr().String())
	c := dial(t, p)
	roundTripless := pattern(1 << 20)
	fired := p.ResetAfter(1000)
	_, werr := c.Write(roundTripless) // may or may not see the RST
	select {
	case <-fired:
	case <-time.After(10 * time.Second):
		t.Fatal("reset did not fire")
	}
	r := <-got
	require.Equal(t, int64(1000), r.n, "the server got exactly the bytes before the cut")
	require.ErrorIs(t, r.err, syscall.ECONNRESET)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err := c.Read(make([]byte, 1))
	if werr == nil {
		require.ErrorIs(t, err, syscall.ECONNRESET, "the client sees an RST, not a FIN")
	}
	require.Equal(t, int64(1), p.Stats().Resets)
	// New connections work again.
	s2 := startServer(t, echo)
	p2 := Start(t, s2.ln.Addr().String())
	roundTrip(t, dial(t, p2), []byte("after"))
}

func TestBlackholeKeepsSocketsOpen(t *testing.T) {
	s := startServer(t, echo)
	p := Start(t, s.ln.Addr().String())
	c := dial(t, p)
	roundTrip(t, c, []byte("warm"))
	p.Blackhole()
	_, err := c.Write([]byte("lost?"))
	require.NoError(t, err)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(150*time.Millisecond)))
	_, err = c.Read(make([]byte, 8))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "no data, no FIN, no RST")

	// A connection made during the blackhole is accepted and held: the
	// server never sees it.
	c2 := dial(t, p)
	_, err = c2.Write([]byte("held"))
	require.NoError(t, err)
	select {
	case <-s.conns: // the first connection
	default:
		t.Fatal("first connection not seen by the server")
	}
	select {
	case <-s.conns:
		t.Fatal("the server saw a connection made during the blackhole")
	case <-time.After(100 * time.Millisecond):
	}

	p.Heal()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	got := make([]byte, 5)
	_, err = io.ReadFull(c, got)
	require.NoError(t, err)
	require.Equal(t, "lost?", string(got), "held bytes are forwarded after Heal")
	require.NoError(t, c2.SetReadDeadline(time.Now().Add(5*time.Second)))
	got = make([]byte, 4)
	_, err = io.ReadFull(c2, got)
	require.NoError(t, err)
	require.Equal(t, "held", string(got))
}

func TestBlackholeAfterStopsInsideTheStream(t *testing.T) {
	var mu sync.Mutex
	var got []byte
	s := startServer(t, func(c net.Conn) {
		b := make([]byte, 64)
		for {
			n, err := c.Read(b)
			mu.Lock()
			got = append(got, b[:n]...)
			mu.Unlock()
			if err != nil {
				return
			}
		}
	})
	received := func() string {
		mu.Lock()
		defer mu.Unlock()
		return string(got)
	}
	p := Start(t, s.ln.Addr().String())
	c := dial(t, p)
	fired := p.BlackholeAfter(5)
	_, err := c.Write([]byte("0123456789"))
	require.NoError(t, err)
	<-fired
	require.Eventually(t, func() bool { return received() == "01234" }, 5*time.Second, time.Millisecond)
	time.Sleep(50 * time.Millisecond) // nothing more may arrive while the hole lasts
	require.Equal(t, "01234", received())
	p.Heal()
	require.Eventually(t, func() bool { return received() == "0123456789" }, 5*time.Second, time.Millisecond)
}

func TestCloseEndsBlackholedConnections(t *testing.T) {
	leakcheck.Check(t)
	s := startServer(t, echo)
	p, err := New("127.0.0.1:0", s.ln.Addr().String())
	require.NoError(t, err)
	c := dial(t, p)
	roundTrip(t, c, []byte("warm"))
	p.SetLatency(time.Hour)
	_, err = c.Write([]byte("delayed"))
	require.NoError(t, err)
	p.Blackhole()
	c2 := dial(t, p)
	_, err = c2.Write([]byte("held"))
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- p.Close() }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("Close hangs on a blackholed or delayed connection")
	}
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err = c.Read(make([]byte, 1))
	require.True(t, errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET), "closed, got %v", err)
}

func TestResetClientAfterKeepsTheServerSideOpen(t *testing.T) {
	leakcheck.Check(t)
	s := startServer(t, nil)
	p, err := New("127.0.0.1:0", s.ln.Addr().String())
	require.NoError(t, err)
	c := dial(t, p)
	fired := p.ResetClientAfter(1000)
	_, _ = c.Write(pattern(64 << 10))
	<-fired
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err = c.Read(make([]byte, 1))
	require.ErrorIs(t, err, syscall.ECONNRESET, "the client sees an RST")

	srv := <-s.conns
	require.NoError(t, srv.SetReadDeadline(time.Now().Add(5*time.Second)))
	got, err := io.ReadAll(io.LimitReader(srv, 1000))
	require.NoError(t, err)
	require.Len(t, got, 1000, "the server got exactly the bytes before the cut")
	require.NoError(t, srv.SetReadDeadline(time.Now().Add(100*time.Millisecond)))
	_, err = srv.Read(make([]byte, 1))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "the server side stays open and silent")
	require.Equal(t, 1, p.Stats().Live)

	require.NoError(t, p.Close())
	require.NoError(t, srv.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err = srv.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF, "Close ends the server side")
}

// TestResetFiringHoldsNoOtherConnection: while a reset is being applied to
// the connection that carried its n-th byte (its last chunk still being
// written), another connection's bytes go on at once; only a blackhole,
// which stops every connection, holds them. (The soak of package transfer
// saw a new connection's hello held behind a cut connection for its
// caller's whole deadline.)
func TestResetFiringHoldsNoOtherConnection(t *testing.T) {
	for _, k := range []faultKind{faultReset, faultResetClient} {
		p := &Proxy{healed: make(chan struct{})}
		close(p.healed)
		tr := &trigger{kind: k, left: 0, fired: make(chan struct{}), settled: make(chan struct{})} // firing on another connection
		p.trig = tr
		c := &conn{p: p, done: make(chan struct{})}
		q := make(chan chunk, 1)
		done := make(chan bool, 1)
		go func() { done <- c.forward(q, []byte("hello"), true) }()
		select {
		case ok := <-done:
			require.True(t, ok)
			require.Equal(t, []byte("hello"), (<-q).b)
		case <-time.After(10 * time.Second):
			close(c.done) // ends forward
			<-done
			t.Fatalf("fault %d: the bytes were held until the other connection's reset took effect", k)
		}
	}
}

// TestDisarmWaitsForAFiringTrigger: a trigger whose n-th byte was read but
// not yet forwarded (here, held by latency) fires after the handoff that
// armed it may have ended; Disarm waits for it, so that no fault lands
// after Disarm returns (the soak of package transfer then heals what it
// began, before the next handoff).
func TestDisarmWaitsForAFiringTrigger(t *testing.T) {
	leakcheck.Check(t)
	s := startServer(t, echo)
	p := Start(t, s.ln.Addr().String())
	c := dial(t, p)
	p.SetLatency(300 * time.Millisecond)
	fired := p.BlackholeAfter(10)
	_, err := c.Write(pattern(100))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.trig != nil && p.trig.left == 0
	}, 5*time.Second, time.Millisecond, "the trigger begins to fire")
	p.Disarm()
	select {
	case <-fired:
	default:
		t.Fatal("Disarm returned before the trigger that had begun took effect")
	}
	p.Heal()
	p.SetLatency(0)
}

// TestVoidBlackholeHoldsNoOne: a blackhole whose connection ended before it
// took effect comes to nothing, and the connections that waited for it go
// on.
func TestVoidBlackholeHoldsNoOne(t *testing.T) {
	p := &Proxy{healed: make(chan struct{})}
	close(p.healed)
	tr := &trigger{kind: faultBlackhole, left: 0, fired: make(chan struct{}), settled: make(chan struct{})}
	p.trig = tr
	c := &conn{p: p, done: make(chan struct{})}
	q := make(chan chunk, 1)
	done := make(chan bool, 1)
	go func() { done <- c.forward(q, []byte("hello"), true) }()
	p.mu.Lock()
	p.trig = nil // what the firing connection does as it ends: void
	p.mu.Unlock()
	close(tr.settled)
	select {
	case ok := <-done:
		require.True(t, ok)
		require.Equal(t, []byte("hello"), (<-q).b)
	case <-time.After(10 * time.Second):
		close(c.done)
		<-done
		t.Fatal("the bytes were held by a blackhole that never began")
	}
}
