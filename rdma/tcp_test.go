package rdma

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/leakcheck"
)

// rawRx is a receiver engine with one open grant, reached over a raw TCP
// connection that a test drives frame by frame.
type rawRx struct {
	e    *Engine
	dst  *Region
	g    *Grant
	tk   Ticket
	conn net.Conn
}

func newRawRx(t *testing.T, deadline time.Duration) *rawRx {
	t.Helper()
	leakcheck.Check(t)
	e, err := New(Config{Agent: "raw-rx", Transports: []Transport{TransportTCP}, Logger: quietLogger()})
	require.NoError(t, err)
	dst, err := e.Register("dst", 1<<20)
	require.NoError(t, err)
	fill(dst.Bytes(), canary)
	g, err := e.OpenGrant(GrantSpec{RequestID: 5, Extents: []Extent{{1, 4096, 8192}, {1, 65536, 65536}}, Deadline: time.Now().Add(deadline)})
	require.NoError(t, err)
	r := &rawRx{e: e, dst: dst, g: g, tk: g.Ticket()}
	r.conn = r.dial(t, "raw-tx", "raw-rx")
	t.Cleanup(func() {
		r.conn.Close()
		require.NoError(t, e.Close())
	})
	return r
}

// dial connects and, when to is set, performs the hello exchange.
func (r *rawRx) dial(t *testing.T, from, to AgentID) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", r.e.Descriptor().TCPAddr)
	require.NoError(t, err)
	if to != "" {
		features, err := handshake(context.Background(), c, make([]byte, headerSize+maxMsgLen), from, to)
		require.NoError(t, err)
		require.Equal(t, []string{featureFlush}, features)
	}
	return c
}

func (r *rawRx) data(ext uint32, off uint64, payload []byte) []byte {
	h := header{typ: frameData, index: ext, grant: r.tk.Grant, epoch: r.tk.Epoch, token: r.tk.Token, offset: off, length: uint64(len(payload))}
	b := make([]byte, headerSize)
	h.put(b)
	return append(b, payload...)
}

func (r *rawRx) commit(m Manifest) []byte {
	h := header{typ: frameCommit, index: uint32(len(m.Bytes)), grant: r.tk.Grant, epoch: r.tk.Epoch, token: r.tk.Token, length: uint64(len(m.Bytes) * manifestEntrySize)}
	b := make([]byte, headerSize+len(m.Bytes)*manifestEntrySize)
	h.put(b)
	putManifest(b[headerSize:], &m)
	return b
}

func (r *rawRx) send(t *testing.T, b []byte) {
	t.Helper()
	_, err := r.conn.Write(b)
	require.NoError(t, err)
}

// reply reads a reply frame and returns its code and message.
func (r *rawRx) reply(t *testing.T) (uint32, string) {
	t.Helper()
	require.NoError(t, r.conn.SetReadDeadline(time.Now().Add(5*time.Second)))
	h, msg, err := readReply(r.conn, make([]byte, headerSize+maxMsgLen))
	require.NoError(t, err)
	require.Equal(t, uint8(frameReply), h.typ)
	return h.index, string(msg)
}

// requireClosed checks the receiver closed the connection.
func (r *rawRx) requireClosed(t *testing.T) {
	t.Helper()
	require.NoError(t, r.conn.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err := io.ReadAll(r.conn)
	require.NoError(t, err) // EOF
}

// requireCanary checks that every byte outside the grant still holds the canary.
func (r *rawRx) requireCanary(t *testing.T) {
	t.Helper()
	b := r.dst.Bytes()
	for i := range b {
		in := (i >= 4096 && i < 4096+8192) || (i >= 65536 && i < 2*65536)
		if !in && b[i] != canary {
			t.Fatalf("byte %d outside the grant changed", i)
		}
	}
}

func (r *rawRx) requireOpen(t *testing.T) {
	t.Helper()
	select {
	case <-r.g.Done():
		t.Fatalf("grant settled: %v", r.g.Err())
	default:
	}
}

func (r *rawRx) wait(t *testing.T) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := r.g.Wait(ctx)
	require.NotErrorIs(t, err, context.DeadlineExceeded)
	return err
}

func payload(n int, v byte) []byte {
	b := make([]byte, n)
	fill(b, v)
	return b
}

func fullManifest(a, b []byte) Manifest {
	return Manifest{Bytes: []uint64{8192, 65536}, CRC: []uint32{crc32Update(0, a), crc32Update(0, b)}}
}

func TestTCPRawCommitAndRefusals(t *testing.T) {
	r := newRawRx(t, time.Minute)
	a, b := payload(8192, 1), payload(65536, 2)

	// Refused frames are skipped without ending the connection.
	bad := r.data(0, 0, a)
	bad[40] ^= 0xff // token
	r.send(t, bad)
	over := r.data(9, 0, a) // extent index out of range, wrong token too
	over[40] ^= 0xff
	r.send(t, over)
	badc := r.commit(fullManifest(a, b))
	badc[40] ^= 0xff
	r.send(t, badc)
	code, msg := r.reply(t)
	require.Equal(t, codeBadToken, code, msg)
	r.requireOpen(t)
	r.requireCanary(t)
	require.Equal(t, byte(canary), r.dst.Bytes()[4096])

	// Right frames, split, out of order within extent 1.
	r.send(t, r.data(0, 0, a))
	r.send(t, r.data(1, 32768, b[32768:]))
	r.send(t, r.data(1, 0, b[:32768]))
	r.send(t, r.commit(fullManifest(a, b)))
	code, msg = r.reply(t)
	require.Equal(t, codeOK, code, msg)
	require.NoError(t, r.wait(t))
	require.Equal(t, a, r.dst.Bytes()[4096:4096+8192])
	r.requireCanary(t)

	// The committed grant refuses anything further.
	r.send(t, r.data(0, 0, payload(10, 9)))
	r.send(t, r.commit(fullManifest(a, b)))
	code, _ = r.reply(t)
	require.Equal(t, codeCommitted, code)
	require.Equal(t, a, r.dst.Bytes()[4096:4096+8192])
}

func TestTCPRawManifestMismatch(t *testing.T) {
	for _, tc := range []struct {
		name string
		send func(r *rawRx, a, b []byte) [][]byte
		m    func(a, b []byte) Manifest
	}{
		{"wrong crc", func(r *rawRx, a, b []byte) [][]byte { return [][]byte{r.data(0, 0, a), r.data(1, 0, b)} },
			func(a, b []byte) Manifest { m := fullManifest(a, b); m.CRC[1]++; return m }},
		{"missing bytes", func(r *rawRx, a, b []byte) [][]byte { return [][]byte{r.data(0, 0, a), r.data(1, 0, b[:100])} },
			fullManifest},
		{"rewrite counted twice", func(r *rawRx, a, b []byte) [][]byte {
			return [][]byte{r.data(0, 0, a), r.data(0, 0, a), r.data(1, 0, b)}
		}, fullManifest},
		{"manifest too short", func(r *rawRx, a, b []byte) [][]byte { return [][]byte{r.data(0, 0, a), r.data(1, 0, b)} },
			func(a, b []byte) Manifest { return Manifest{Bytes: []uint64{8192}, CRC: []uint32{crc32Update(0, a)}} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRawRx(t, time.Minute)
			a, b := payload(8192, 1), payload(65536, 2)
			for _, f := range tc.send(r, a, b) {
				r.send(t, f)
			}
			r.send(t, r.commit(tc.m(a, b)))
			code, msg := r.reply(t)
			require.Equal(t, codeManifestMismatch, code, msg)
			require.ErrorIs(t, r.wait(t), ErrManifestMismatch)
			r.requireCanary(t)
		})
	}
}

func TestTCPRawOutOfRangeFailsGrant(t *testing.T) {
	r := newRawRx(t, time.Minute)
	r.send(t, r.data(0, 8000, payload(193, 3))) // 1 byte past extent 0
	r.send(t, r.data(1, 0, payload(10, 3)))     // refused: the grant failed
	r.send(t, r.commit(fullManifest(nil, nil)))
	code, msg := r.reply(t)
	require.Equal(t, codeOutOfRange, code, msg)
	require.ErrorIs(t, r.wait(t), ErrOutOfRange)
	require.Equal(t, byte(canary), r.dst.Bytes()[4096+8000])
	require.Equal(t, byte(canary), r.dst.Bytes()[65536])
	r.requireCanary(t)
}

func TestTCPRawMalformed(t *testing.T) {
	for _, tc := range []struct {
		name  string
		frame func(r *rawRx) []byte
	}{
		{"bad magic", func(r *rawRx) []byte { b := r.data(0, 0, []byte{1}); b[0] = 'X'; return b }},
		{"reserved bits", func(r *rawRx) []byte { b := r.data(0, 0, []byte{1}); b[6] = 1; return b }},
		{"no-crc flag on data", func(r *rawRx) []byte { b := r.data(0, 0, []byte{1}); b[5] = flagNoCRC; return b }},
		{"unknown commit flag", func(r *rawRx) []byte { b := r.commit(fullManifest(nil, nil)); b[5] = 2; return b }},
		{"unknown type", func(r *rawRx) []byte { b := r.data(0, 0, []byte{1}); b[4] = 99; return b }},
		{"offset overflow", func(r *rawRx) []byte {
			b := r.data(0, 0, []byte{1})
			binary.LittleEndian.PutUint64(b[48:], ^uint64(0))
			return b
		}},
		{"huge length", func(r *rawRx) []byte {
			b := r.data(0, 0, nil)
			binary.LittleEndian.PutUint64(b[56:], 1<<62)
			return b
		}},
		{"zero length", func(r *rawRx) []byte { return r.data(0, 0, nil) }},
		{"commit count vs length", func(r *rawRx) []byte {
			b := r.commit(fullManifest(nil, nil))
			binary.LittleEndian.PutUint32(b[8:], 3)
			return b
		}},
		{"flush with a payload", func(r *rawRx) []byte {
			h := header{typ: frameFlush, grant: r.tk.Grant, epoch: r.tk.Epoch, token: r.tk.Token, length: 1}
			b := make([]byte, headerSize)
			h.put(b)
			return append(b, 0)
		}},
		{"flush with an index", func(r *rawRx) []byte {
			h := header{typ: frameFlush, index: 1, grant: r.tk.Grant, epoch: r.tk.Epoch, token: r.tk.Token}
			b := make([]byte, headerSize)
			h.put(b)
			return b
		}},
		{"reply from a writer", func(r *rawRx) []byte {
			h := header{typ: frameReply}
			b := make([]byte, headerSize)
			h.put(b)
			return b
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRawRx(t, time.Minute)
			r.send(t, r.data(0, 0, payload(100, 4))) // lands, then the connection breaks
			r.send(t, tc.frame(r))
			code, msg := r.reply(t)
			require.Equal(t, codeMalformed, code, msg)
			r.requireClosed(t)
			require.ErrorIs(t, r.wait(t), ErrMalformedFrame, "a grant the connection wrote into fails with the reason")
			r.requireCanary(t)
		})
	}
}

func TestTCPRawPeerClosesMidFrame(t *testing.T) {
	t.Run("mid payload", func(t *testing.T) {
		r := newRawRx(t, time.Minute)
		f := r.data(1, 0, payload(4096, 5))
		r.send(t, f[:headerSize+1000])
		r.conn.Close()
		require.ErrorIs(t, r.wait(t), ErrPeerClosed)
		r.requireCanary(t)
		require.Equal(t, byte(canary), r.dst.Bytes()[65536+1000], "nothing past what arrived")
	})
	t.Run("mid header", func(t *testing.T) {
		r := newRawRx(t, time.Minute)
		r.send(t, r.data(0, 0, payload(8192, 5)))
		r.send(t, r.data(1, 0, payload(100, 5))[:30])
		r.conn.Close()
		require.ErrorIs(t, r.wait(t), ErrPeerClosed)
		r.requireCanary(t)
	})
	t.Run("before any landing", func(t *testing.T) {
		r := newRawRx(t, time.Minute)
		r.send(t, []byte{1, 2, 3})
		r.conn.Close()
		time.Sleep(20 * time.Millisecond)
		r.requireOpen(t) // a connection that never wrote into the grant does not fail it
		r.requireCanary(t)
	})
}

func TestTCPRawWriterNeverCommits(t *testing.T) {
	r := newRawRx(t, 150*time.Millisecond)
	r.send(t, r.data(0, 0, payload(8192, 6)))
	require.ErrorIs(t, r.wait(t), ErrDeadline)
	// Later frames are refused and land nothing.
	r.send(t, r.data(1, 0, payload(65536, 6)))
	r.send(t, r.commit(fullManifest(nil, nil)))
	code, msg := r.reply(t)
	require.Contains(t, []uint32{codeDeadline, codeStaleEpoch}, code, msg)
	require.Equal(t, byte(canary), r.dst.Bytes()[65536])
	r.requireCanary(t)
}

func TestTCPRawRevokeAbortsStalledLanding(t *testing.T) {
	r := newRawRx(t, time.Minute)
	f := r.data(1, 0, payload(65536, 7))
	r.send(t, f[:headerSize+10])
	// Wait until the receiver is blocked inside the landing.
	require.Eventually(t, func() bool {
		r.g.mu.Lock()
		defer r.g.mu.Unlock()
		return r.g.inflight == 1
	}, 5*time.Second, time.Millisecond)
	done := make(chan struct{})
	go func() { r.g.Revoke(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Revoke waited on a stalled peer")
	}
	require.ErrorIs(t, r.wait(t), ErrRevoked)
	// The rest of the payload arrives after Revoke returned: it must not land.
	_, _ = r.conn.Write(f[headerSize+10:])
	time.Sleep(20 * time.Millisecond)
	for i := 65536 + 10; i < 2*65536; i++ {
		require.Equal(t, byte(canary), r.dst.Bytes()[i], "byte %d landed after Revoke", i)
	}
	r.requireCanary(t)
}

func TestTCPRawHello(t *testing.T) {
	r := newRawRx(t, time.Minute)
	c, err := net.Dial("tcp", r.e.Descriptor().TCPAddr)
	require.NoError(t, err)
	defer c.Close()
	_, err = handshake(context.Background(), c, make([]byte, headerSize+maxMsgLen), "x", "someone-else")
	require.ErrorIs(t, err, ErrWrongPeer)

	c2 := r.dial(t, "x", "")
	defer c2.Close()
	_, err = c2.Write(r.data(0, 0, []byte{1})) // data before hello
	require.NoError(t, err)
	h, _, err := readReply(c2, make([]byte, headerSize+maxMsgLen))
	require.NoError(t, err)
	require.Equal(t, codeMalformed, h.index)
	r.requireOpen(t)
	r.requireCanary(t)
}

func TestTCPWriterSeesPeerClose(t *testing.T) {
	p := newPair(t, TransportTCP)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dstExtents()})
	require.NoError(t, err)
	tk := g.Ticket()
	require.NoError(t, p.rx.Close())
	_, err = p.tx.Write(context.Background(), p.desc, tk, srcExtents(tk.Bytes))
	require.Error(t, err)
	require.True(t, isAny(err, ErrPeerClosed, ErrNoTransport, ErrRevoked, ErrClosed), "%v", err)
}

func isAny(err error, targets ...error) bool {
	for _, t := range targets {
		if errors.Is(err, t) {
			return true
		}
	}
	return false
}

// A receiver that accepts, answers the hello and then never replies: Write
// returns when its context ends, and leaves no goroutine behind.
func TestTCPWriterContextAgainstSilentReceiver(t *testing.T) {
	leakcheck.Check(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	silent := func(c net.Conn) {
		defer c.Close()
		buf := make([]byte, headerSize+maxMsgLen)
		if _, err := io.ReadFull(c, buf[:headerSize]); err != nil {
			return
		}
		h, _ := decodeHeader(buf[:headerSize])
		if _, err := io.ReadFull(c, buf[:h.length]); err != nil {
			return
		}
		_, _ = c.Write(appendHello(nil, "silent", "tx"))
		_, _ = io.Copy(io.Discard, c)
	}
	served := make(chan struct{})
	go func() {
		defer close(served)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			silent(c)
		}
	}()
	tx, err := New(Config{Agent: "tx", Transports: []Transport{TransportTCP}, Logger: quietLogger()})
	require.NoError(t, err)
	src, err := tx.Register("src", 1<<20)
	require.NoError(t, err)
	_ = src
	peer := Descriptor{Agent: "silent", TCPAddr: ln.Addr().String(), Transports: []Transport{TransportTCP}}
	tk := Ticket{Agent: "silent", Grant: 1, Epoch: 1, Extents: []Extent{{1, 0, 1 << 20}}, Bytes: 1 << 20, Deadline: time.Now().Add(time.Minute)}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = tx.Write(ctx, peer, tk, []Extent{{1, 0, 1 << 20}})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Less(t, time.Since(start), 5*time.Second)

	// Cancellation (no deadline) aborts a blocked Write too.
	cctx, ccancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, ccancel)
	_, err = tx.Write(cctx, peer, tk, []Extent{{1, 0, 1 << 20}})
	require.ErrorIs(t, err, context.Canceled)
	require.NoError(t, tx.Close())
	ln.Close()
	<-served
}

func TestTCPRawRefusalsAreBounded(t *testing.T) {
	r := newRawRx(t, time.Minute)
	for i := range 1000 {
		f := r.data(0, 0, []byte{1})
		binary.LittleEndian.PutUint64(f[16:], uint64(1<<40+i)) // unknown grants
		r.send(t, f)
	}
	r.send(t, r.commit(fullManifest(nil, nil)))
	code, msg := r.reply(t)
	require.Equal(t, codeManifestMismatch, code, msg) // the real grant: nothing landed
	require.ErrorIs(t, r.wait(t), ErrManifestMismatch)
	r.requireCanary(t)
}

// A commit whose grant or token is wrong is refused without its manifest
// being held: connections that know only the agent id and send the largest
// manifest a header allows (12 MiB) leave the receiver's heap as it was.
func TestCommitManifestHeldOnlyWhenAuthentic(t *testing.T) {
	r := newRawRx(t, time.Minute)
	bad := r.tk
	bad.Token[0] ^= 1
	for _, tc := range []struct {
		name         string
		grant, epoch uint64
		token        [16]byte
		code         uint32
	}{
		{"unknown grant", r.tk.Grant + 100, r.tk.Epoch, r.tk.Token, codeUnknownGrant},
		{"wrong token", r.tk.Grant, r.tk.Epoch, bad.Token, codeBadToken},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const conns = 4
			var ms runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&ms)
			before := ms.HeapAlloc
			h := header{typ: frameCommit, index: MaxExtents, grant: tc.grant, epoch: tc.epoch, token: tc.token, length: MaxExtents * manifestEntrySize}
			frame := make([]byte, headerSize+MaxExtents*manifestEntrySize)
			h.put(frame)
			for range conns {
				c := r.dial(t, "mallory", "raw-rx")
				defer c.Close()
				_, err := c.Write(frame)
				require.NoError(t, err)
				require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
				rh, _, err := readReply(c, make([]byte, headerSize+maxMsgLen))
				require.NoError(t, err)
				require.Equal(t, tc.code, rh.index)
			}
			frame = nil
			runtime.GC()
			runtime.ReadMemStats(&ms)
			grew := ms.HeapAlloc - min(ms.HeapAlloc, before)
			require.Less(t, grew, uint64(MaxExtents*manifestEntrySize),
				"%d refused commits left %d MiB held on the receiver", conns, grew>>20)
		})
	}
	// The grant itself is untouched and still completes.
	r.send(t, r.data(0, 0, make([]byte, 8192)))
	r.send(t, r.data(1, 0, make([]byte, 65536)))
	m := Manifest{Bytes: []uint64{8192, 65536}, CRC: []uint32{crc32Update(0, make([]byte, 8192)), crc32Update(0, make([]byte, 65536))}}
	r.send(t, r.commit(m))
	code, msg := r.reply(t)
	require.Equal(t, codeOK, code, msg)
}

// TestTCPStreamAcrossReconnect: a Stream's grant survives its link's
// connections going between two parts (another write cut by its context;
// every pooled connection dropped, or closed outright), in one connection
// and striped: each part ends with a flush the receiver answered, after
// which the connection that carried it no longer holds the grant. The shm
// link once failed such streams (TestSHMStreamAcrossReconnect).
func TestTCPStreamAcrossReconnect(t *testing.T) {
	dropAll := func(p *pair, l *tcpLink, closeOutright bool) {
		l.mu.Lock()
		idle := l.idle
		l.idle = nil
		if !closeOutright {
			for _, tc := range idle {
				l.busy[tc] = struct{}{}
			}
		}
		l.mu.Unlock()
		for _, tc := range idle {
			if closeOutright {
				tc.c.Close()
			} else {
				l.drop(tc)
			}
		}
	}
	cutWrite := func(t *testing.T, p *pair) {
		gB, err := p.rx.OpenGrant(GrantSpec{RequestID: 2, Extents: []Extent{{Region: 1, Offset: 0, Length: 4000}}})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		p.tx.hooks.Store(&hooks{writing: func(tk *Ticket, _ uint64) {
			if tk.Grant == gB.Ticket().Grant {
				cancel()
				time.Sleep(20 * time.Millisecond)
			}
		}})
		defer p.tx.hooks.Store(nil)
		// Cut mid-send, or done before the cut: the stream's grant survives either.
		_, _ = p.tx.Write(ctx, p.rx.Descriptor(), gB.Ticket(), []Extent{{Region: 1, Offset: 0, Length: 4000}})
	}
	for _, size := range []uint64{4096, 4 << 20} { // one connection; striped
		for _, tc := range []struct {
			name    string
			disturb func(t *testing.T, p *pair, l *tcpLink)
		}{
			{"cut write", func(t *testing.T, p *pair, _ *tcpLink) { cutWrite(t, p) }},
			{"dropped", func(_ *testing.T, p *pair, l *tcpLink) { dropAll(p, l, false) }},
			{"closed", func(_ *testing.T, p *pair, l *tcpLink) { dropAll(p, l, true) }},
		} {
			t.Run(fmt.Sprintf("%s/%d", tc.name, size), func(t *testing.T) {
				p := newPair(t, TransportTCP)
				ctx := context.Background()
				rr, err := p.rx.Register("big", int64(2*size))
				require.NoError(t, err)
				sr, err := p.tx.Register("bigsrc", int64(2*size))
				require.NoError(t, err)
				for i, b := 0, sr.Bytes(); i < len(b); i++ {
					b[i] = byte(i*7 + 3)
				}
				g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{Region: rr.ID(), Offset: 0, Length: 2 * size}}})
				require.NoError(t, err)
				s, err := p.tx.OpenStream(ctx, p.rx.Descriptor(), g.Ticket())
				require.NoError(t, err)
				require.NoError(t, s.Write(ctx, []Range{{Ext: 0, Offset: 0, Length: size}}, []Extent{{Region: sr.ID(), Offset: 0, Length: size}}))
				p.tx.peerMu.Lock()
				l := p.tx.peers[p.rx.Agent()].link.(*tcpLink)
				p.tx.peerMu.Unlock()
				tc.disturb(t, p, l)
				time.Sleep(50 * time.Millisecond) // time for the receiver to see connections close
				require.NoError(t, g.Err(), "the stream's grant failed with the connections")
				require.NoError(t, s.Write(ctx, []Range{{Ext: 0, Offset: size, Length: size}}, []Extent{{Region: sr.ID(), Offset: size, Length: size}}))
				m, err := s.Commit(ctx)
				require.NoError(t, err)
				got, err := g.Wait(ctx)
				require.NoError(t, err)
				require.Equal(t, m, got)
				require.Equal(t, sr.Bytes()[:2*size], rr.Bytes()[:2*size])
			})
		}
	}
}
