//go:build linux

package rdma

import (
	"bytes"
	"context"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// shmSlot returns the writer's link and the slot of g as the writer maps it.
func shmSlot(t *testing.T, p *pair, g *Grant) (*shmLink, slotView) {
	t.Helper()
	p.tx.peerMu.Lock()
	l := p.tx.peers[p.rx.Agent()].link.(*shmLink)
	p.tx.peerMu.Unlock()
	return l, slotAt(l.table, int(g.ID()%uint64(l.n)))
}

func TestSHMRevokeWaitsForCopyBracket(t *testing.T) {
	p := newPair(t, TransportSHM)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dstExtents()})
	require.NoError(t, err)
	tk := g.Ticket()
	l, sl := shmSlot(t, p, g)
	open := slotWord(slotOpen, 0, tk.Epoch)
	writing := slotWord(slotWriting, l.wid, tk.Epoch)
	require.True(t, sl.state().CompareAndSwap(open, writing), "writer enters a copy bracket")

	revoked := make(chan struct{})
	go func() { g.Revoke(); close(revoked) }()
	select {
	case <-revoked:
		t.Fatal("Revoke returned while a copy was in progress")
	case <-time.After(50 * time.Millisecond):
	}
	sl.state().Store(open) // the copy ends
	select {
	case <-revoked:
	case <-time.After(5 * time.Second):
		t.Fatal("Revoke did not return after the copy ended")
	}
	require.False(t, sl.state().CompareAndSwap(open, writing), "no bracket can start after Revoke")
	require.Equal(t, uint64(slotClosed), wordState(sl.state().Load()))
	_, err = g.Wait(context.Background())
	require.ErrorIs(t, err, ErrRevoked)
	_, err = p.tx.Write(context.Background(), p.desc, tk, srcExtents(tk.Bytes))
	require.ErrorIs(t, err, ErrRevoked)
	p.requireUntouched(t)
}

func TestSHMWriterDiesMidCopy(t *testing.T) {
	p := newPair(t, TransportSHM)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dstExtents()})
	require.NoError(t, err)
	tk := g.Ticket()
	l, sl := shmSlot(t, p, g)
	writing := slotWord(slotWriting, l.wid, tk.Epoch)
	require.True(t, sl.state().CompareAndSwap(slotWord(slotOpen, 0, tk.Epoch), writing))
	copy(p.dst.Bytes()[100:200], p.src.Bytes()[:100]) // a partial copy inside the grant
	sl.writer().Store(l.wid)
	// The writer process dies: its pidfd polls readable, and the kernel
	// closes its control socket. The writer here shares the test's process,
	// so the receiver is told of a child process's pid as the writer's.
	stand := exec.Command("sleep", "60")
	require.NoError(t, stand.Start())
	pidfd, err := unix.PidfdOpen(stand.Process.Pid, 0)
	require.NoError(t, err)
	p.rx.shm.mu.Lock()
	w := p.rx.shm.writers[l.wid]
	w.release()
	w.pid, w.pidfd = stand.Process.Pid, pidfd
	p.rx.shm.mu.Unlock()
	require.NoError(t, stand.Process.Kill())
	_ = stand.Wait()
	l.mu.Lock()
	l.conn.Close()
	l.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = g.Wait(ctx)
	require.ErrorIs(t, err, ErrPeerClosed)
	require.Equal(t, uint64(slotClosed), wordState(sl.state().Load()))
	p.requireCanary(t, tk.Extents)
}

func TestSHMWriterLeavesAfterCopyBeforeCommit(t *testing.T) {
	p := newPair(t, TransportSHM)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dstExtents()})
	require.NoError(t, err)
	tk := g.Ticket()
	l, sl := shmSlot(t, p, g)
	sl.writer().Store(l.wid) // copied, released the bracket, never committed
	require.NoError(t, p.tx.Close())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = g.Wait(ctx)
	require.ErrorIs(t, err, ErrPeerClosed)
	_ = tk
}

func TestSHMRegionRegisteredAfterConnect(t *testing.T) {
	p := newPair(t, TransportSHM)
	late, err := p.rx.Register("late", 8192)
	require.NoError(t, err)
	fill(late.Bytes(), canary)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{Region: late.ID(), Offset: 100, Length: 4000}}})
	require.NoError(t, err)
	_, err = p.tx.Write(context.Background(), p.rx.Descriptor(), g.Ticket(), []Extent{{Region: 1, Offset: 0, Length: 4000}})
	require.NoError(t, err)
	_, err = g.Wait(context.Background())
	require.NoError(t, err)
	require.Equal(t, p.src.Bytes()[:4000], late.Bytes()[100:4100])
	require.Equal(t, byte(canary), late.Bytes()[99])
	require.Equal(t, byte(canary), late.Bytes()[4100])
}

func TestSlotWord(t *testing.T) {
	for _, tc := range []struct{ state, writer, epoch uint64 }{
		{slotOpen, 0, 1}, {slotWriting, 65535, slotEpochMask}, {slotClosed, 17, 123456789},
	} {
		w := slotWord(tc.state, tc.writer, tc.epoch)
		require.Equal(t, tc.state, wordState(w))
		require.Equal(t, tc.writer, wordWriter(w))
		require.Equal(t, tc.epoch, wordEpoch(w))
	}
}

func TestExtentsDigest(t *testing.T) {
	base := []Extent{{1, 0, 4096}, {1, 8192, 4096}, {2, 0, 100}}
	d := extentsDigest(base)
	require.Equal(t, d, extentsDigest(append([]Extent(nil), base...)))
	for i := range base {
		for f := range 3 {
			x := append([]Extent(nil), base...)
			switch f {
			case 0:
				x[i].Region++
			case 1:
				x[i].Offset++
			case 2:
				x[i].Length++
			}
			require.NotEqual(t, d, extentsDigest(x), "extent %d field %d", i, f)
		}
	}
	require.NotEqual(t, d, extentsDigest(base[:2]))
	require.NotEqual(t, d, extentsDigest([]Extent{base[1], base[0], base[2]}))
}

func TestSHMCancelledWriteFailsGrant(t *testing.T) {
	p := newPair(t, TransportSHM)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dstExtents()})
	require.NoError(t, err)
	tk := g.Ticket()
	l, _ := shmSlot(t, p, g)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	op := &writeOp{t: &tk, manifest: &Manifest{Bytes: make([]uint64, len(tk.Extents)), CRC: make([]uint32, len(tk.Extents))}}
	require.NoError(t, p.tx.split(op, srcExtents(tk.Bytes), tk.Bytes))
	err = l.write(ctx, op)
	require.ErrorIs(t, err, context.Canceled)
	wctx, wcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer wcancel()
	_, err = g.Wait(wctx)
	require.ErrorIs(t, err, ErrPeerClosed)
	p.requireCanary(t, tk.Extents)
}

func TestSHMSocketIsPrivate(t *testing.T) {
	p := newPair(t, TransportSHM)
	st, err := os.Stat(p.desc.ShmAddr)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
}

func TestSHMRawControlBadInput(t *testing.T) {
	p := newPair(t, TransportSHM)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dstExtents()})
	require.NoError(t, err)
	tk := g.Ticket()
	dial := func() net.Conn {
		c, err := net.Dial("unix", p.desc.ShmAddr)
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		return c
	}
	buf := make([]byte, headerSize+maxMsgLen)

	// Garbage instead of a hello.
	c := dial()
	_, err = c.Write([]byte("GET / HTTP/1.1\r\n\r\n" + string(make([]byte, 64))))
	require.NoError(t, err)
	h, _, err := readReply(c, buf)
	require.NoError(t, err)
	require.Equal(t, codeMalformed, h.index)

	// A valid hello, then a data frame: shm carries no data frames.
	c = dial()
	_, err = c.Write(appendHello(nil, "raw", p.rx.Agent()))
	require.NoError(t, err)
	_, _, err = readReply(c, buf) // the hello answer (its fds are dropped)
	require.NoError(t, err)
	d := make([]byte, headerSize)
	(&header{typ: frameData, grant: tk.Grant, epoch: tk.Epoch, token: tk.Token, length: 4}).put(d)
	_, err = c.Write(append(d, 1, 2, 3, 4))
	require.NoError(t, err)
	h, _, err = readReply(c, buf)
	require.NoError(t, err)
	require.Equal(t, codeMalformed, h.index)

	// A truncated commit, then the writer goes away.
	c = dial()
	_, err = c.Write(appendHello(nil, "raw", p.rx.Agent()))
	require.NoError(t, err)
	_, _, err = readReply(c, buf)
	require.NoError(t, err)
	cm := make([]byte, headerSize+12)
	(&header{typ: frameCommit, index: 1, grant: tk.Grant, epoch: tk.Epoch, token: tk.Token, length: 12}).put(cm)
	_, err = c.Write(cm[:headerSize+5])
	require.NoError(t, err)
	c.Close()

	select {
	case <-g.Done():
		t.Fatalf("grant settled by a writer that never copied: %v", g.Err())
	case <-time.After(20 * time.Millisecond):
	}
	p.requireUntouched(t)
	// The grant is still good for a real writer.
	_, err = p.tx.Write(context.Background(), p.desc, tk, srcExtents(tk.Bytes))
	require.NoError(t, err)
}

// TestSHMLargeCopy writes grants of 1 MiB and more with random extents (up
// to 512 KiB each, shuffled), and checks the bytes, the canary around them
// and the crcs, against a receiver that trusts the writer's sums and one
// that computes them again (VerifySHM).
func TestSHMLargeCopy(t *testing.T) {
	for _, verify := range []bool{false, true} {
		t.Run(map[bool]string{false: "trusting", true: "verifying"}[verify], func(t *testing.T) {
			const size = 6 << 20
			rx, err := New(Config{Agent: "par-rx", Transports: []Transport{TransportSHM}, Logger: quietLogger(), VerifySHM: verify})
			require.NoError(t, err)
			defer rx.Close()
			tx, err := New(Config{Agent: "par-tx", Transports: []Transport{TransportSHM}, Logger: quietLogger()})
			require.NoError(t, err)
			defer tx.Close()
			dst, err := rx.Register("dst", size)
			require.NoError(t, err)
			src, err := tx.Register("src", size)
			require.NoError(t, err)
			rng := rand.New(rand.NewPCG(7, 8))
			for i := range src.Bytes() {
				src.Bytes()[i] = byte(rng.Uint32())
			}
			ctx := context.Background()
			desc := rx.Descriptor()
			for round := range 6 {
				fill(dst.Bytes(), canary)
				var xs []Extent
				for off := uint64(rng.IntN(4096)); ; {
					n := uint64(1 + rng.IntN(1<<(10+round%4*3))) // up to 1 KiB .. 512 KiB
					if off+n > size {
						break
					}
					xs = append(xs, Extent{Region: 1, Offset: off, Length: n})
					off += n + uint64(rng.IntN(5000))
				}
				rng.Shuffle(len(xs), func(i, j int) { xs[i], xs[j] = xs[j], xs[i] })
				g, err := rx.OpenGrant(GrantSpec{RequestID: uint64(round + 1), Extents: xs})
				require.NoError(t, err)
				tk := g.Ticket()
				require.GreaterOrEqual(t, tk.Bytes, uint64(1<<20))
				srcX := []Extent{{Region: 1, Offset: uint64(rng.IntN(int(size - tk.Bytes))), Length: tk.Bytes}}
				m, err := tx.Write(ctx, desc, tk, srcX)
				require.NoError(t, err)
				got, err := g.Wait(ctx)
				require.NoError(t, err)
				require.Equal(t, m, got)
				var all []byte
				for i, x := range xs {
					b := dst.Bytes()[x.Offset : x.Offset+x.Length]
					require.Equal(t, crc32Update(0, b), got.CRC[i], "round %d extent %d", round, i)
					all = append(all, b...)
				}
				o := srcX[0].Offset
				require.True(t, bytes.Equal(src.Bytes()[o:o+tk.Bytes], all), "round %d", round)
				in := make([]bool, size)
				for _, x := range xs {
					for i := x.Offset; i < x.Offset+x.Length; i++ {
						in[i] = true
					}
				}
				for i, b := range dst.Bytes() {
					if !in[i] && b != canary {
						t.Fatalf("round %d: byte %d outside the grant changed", round, i)
					}
				}
			}
		})
	}
}

// TestSHMCommitWithoutCopy: a commit whose manifest matches the memory as it
// is (here the canary) is refused when no writer copied the bytes.
func TestSHMCommitWithoutCopy(t *testing.T) {
	p := newPair(t, TransportSHM)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dstExtents()})
	require.NoError(t, err)
	tk := g.Ticket()
	l, _ := shmSlot(t, p, g)
	m := Manifest{}
	for _, x := range tk.Extents {
		m.Bytes = append(m.Bytes, x.Length)
		m.CRC = append(m.CRC, crc32Update(0, p.dst.Bytes()[x.Offset:x.Offset+x.Length]))
	}
	err = l.commit(context.Background(), &writeOp{t: &tk, manifest: &m})
	require.ErrorIs(t, err, ErrManifestMismatch)
	_, err = g.Wait(context.Background())
	require.ErrorIs(t, err, ErrManifestMismatch)
	p.requireUntouched(t)
}

// shmOp builds the writeOp Engine.Write would, for driving a shmLink's
// steps in an order that concurrent writes produce.
func shmOp(t *testing.T, e *Engine, tk Ticket, src []Extent) *writeOp {
	t.Helper()
	op := &writeOp{tk: tk, mf: Manifest{Bytes: make([]uint64, len(tk.Extents)), CRC: make([]uint32, len(tk.Extents))}}
	for i, x := range tk.Extents {
		op.mf.Bytes[i] = x.Length
	}
	op.t, op.manifest = &op.tk, &op.mf
	require.NoError(t, e.split(op, src, tk.Bytes))
	return op
}

// A write that reconnects the link (here: its ticket names a region the
// receiver registered after the hello) must not fail another write's grant
// that was copied under the old connection's writer id and is about to be
// committed: the old connection stays open until that commit is in.
func TestSHMReconnectKeepsCopiedGrants(t *testing.T) {
	p := newPair(t, TransportSHM)
	ctx := context.Background()
	gA, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dstExtents()})
	require.NoError(t, err)
	l, _ := shmSlot(t, p, gA)
	opA := shmOp(t, p.tx, gA.Ticket(), srcExtents(gA.Ticket().Bytes))
	releaseA, _, err := l.copyOp(ctx, opA)
	require.NoError(t, err)
	oldWid := l.wid

	late, err := p.rx.Register("late", 8192)
	require.NoError(t, err)
	gB, err := p.rx.OpenGrant(GrantSpec{RequestID: 2, Extents: []Extent{{Region: late.ID(), Offset: 0, Length: 4000}}})
	require.NoError(t, err)
	_, err = p.tx.Write(ctx, p.rx.Descriptor(), gB.Ticket(), []Extent{{Region: 1, Offset: 0, Length: 4000}})
	require.NoError(t, err)
	require.NotEqual(t, oldWid, l.wid, "write B reconnected")

	require.NoError(t, l.commit(ctx, opA), "a copied grant was failed by another write's reconnect")
	releaseA()
	_, err = gA.Wait(ctx)
	require.NoError(t, err)

	// The retired connection is let go once its last write is done: the
	// receiver sees that writer id leave.
	l.genMu.Lock()
	require.Empty(t, l.retired)
	require.Empty(t, l.users)
	l.genMu.Unlock()
	require.Eventually(t, func() bool {
		p.rx.shm.mu.Lock()
		defer p.rx.shm.mu.Unlock()
		w := p.rx.shm.writers[oldWid]
		return w == nil || !w.open
	}, 5*time.Second, time.Millisecond)
}

// TestSHMStreamAcrossReconnect: a Stream's grant survives a reconnect of
// its link between two parts (here another write names a region the
// receiver registered after the hello; a cut exchange does the same): the
// connection its first part copied under stays open until it commits.
// Before, the reconnect let that connection go and the receiver failed the
// stream's grant (its writer gone).
func TestSHMStreamAcrossReconnect(t *testing.T) {
	p := newPair(t, TransportSHM)
	ctx := context.Background()
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{Region: 1, Offset: 0, Length: 8192}}})
	require.NoError(t, err)
	s, err := p.tx.OpenStream(ctx, p.desc, g.Ticket())
	require.NoError(t, err)
	require.NoError(t, s.Write(ctx, []Range{{Ext: 0, Offset: 0, Length: 4096}}, []Extent{{Region: 1, Offset: 0, Length: 4096}}))
	l, _ := shmSlot(t, p, g)
	oldWid := l.wid

	late, err := p.rx.Register("late", 8192)
	require.NoError(t, err)
	gB, err := p.rx.OpenGrant(GrantSpec{RequestID: 2, Extents: []Extent{{Region: late.ID(), Offset: 0, Length: 4000}}})
	require.NoError(t, err)
	_, err = p.tx.Write(ctx, p.rx.Descriptor(), gB.Ticket(), []Extent{{Region: 1, Offset: 0, Length: 4000}})
	require.NoError(t, err)
	require.NotEqual(t, oldWid, l.wid, "the write reconnected")
	time.Sleep(50 * time.Millisecond) // time for the receiver to see a closed connection
	require.NoError(t, g.Err(), "the stream's grant failed at the reconnect")

	require.NoError(t, s.Write(ctx, []Range{{Ext: 0, Offset: 4096, Length: 4096}}, []Extent{{Region: 1, Offset: 4096, Length: 4096}}))
	m, err := s.Commit(ctx)
	require.NoError(t, err)
	got, err := g.Wait(ctx)
	require.NoError(t, err)
	require.Equal(t, m, got)
	require.Equal(t, p.tx.regions[1].Bytes()[:8192], p.rx.regions[1].Bytes()[:8192])
	l.genMu.Lock()
	defer l.genMu.Unlock()
	require.Empty(t, l.streams, "the commit let the stream's hold go")
	require.Empty(t, l.retired, "the old connection went with it")
}

// TestSHMHelloEndsWithContext: a receiver whose shm control socket accepts
// and never answers the hello holds a connect only until the caller's
// context ends (a cancel, not a deadline), not for helloTimeout.
func TestSHMHelloEndsWithContext(t *testing.T) {
	rx, err := New(Config{Agent: "rx-frozen", Transports: []Transport{TransportSHM}, Logger: quietLogger()})
	require.NoError(t, err)
	defer rx.Close()
	tx, err := New(Config{Agent: "tx-frozen", Transports: []Transport{TransportSHM}, Logger: quietLogger()})
	require.NoError(t, err)
	defer tx.Close()
	d := rx.Descriptor()
	d.ShmAddr = frozenShm(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	time.AfterFunc(200*time.Millisecond, cancel)
	start := time.Now()
	_, err = tx.Connect(ctx, d)
	require.Error(t, err)
	require.ErrorIs(t, err, context.Canceled)
	require.Less(t, time.Since(start), 5*time.Second, "the hello outlived its context")
}

// frozenShm is an shm control socket that accepts and never answers.
func frozenShm(t *testing.T) string {
	ln, err := net.Listen("unix", filepath.Join(t.TempDir(), "frozen.sock"))
	require.NoError(t, err)
	var held []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		for _, c := range held {
			c.Close()
		}
	})
	return ln.Addr().String()
}

// TestSHMWriteCancelledInReconnect: a write whose link reconnects to a
// receiver that stopped answering ends when its context does, without an
// abort (nothing was copied, and an abort would wait on the same hello).
func TestSHMWriteCancelledInReconnect(t *testing.T) {
	p := newPair(t, TransportSHM)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dstExtents()})
	require.NoError(t, err)
	l, _ := shmSlot(t, p, g)
	l.mu.Lock()
	l.peer.ShmAddr, l.broken = frozenShm(t), true
	l.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	time.AfterFunc(200*time.Millisecond, cancel)
	start := time.Now()
	_, err = p.tx.Write(ctx, p.desc, g.Ticket(), srcExtents(g.Ticket().Bytes))
	took := time.Since(start)
	require.ErrorIs(t, err, context.Canceled)
	require.Less(t, took, 1100*time.Millisecond, "the write outlived its context (an abort waits a second)")
	g.Revoke()
	p.requireUntouched(t)
}

// TestSHMHelloAnswerBadInput: whatever answers at a peer's shm address
// with a header other than hello or reply, or a longer message than a
// hello's, is refused as malformed: the writer reads no more than its
// buffer holds (a data header of 1 MiB once panicked it).
func TestSHMHelloAnswerBadInput(t *testing.T) {
	for _, h := range []header{
		{typ: frameData, length: 1 << 20},
		{typ: frameCommit, length: 4096},
		{typ: frameHello, length: maxMsgLen + 1},
		{typ: frameReply, length: 1 << 16},
	} {
		path := filepath.Join(t.TempDir(), "s.sock")
		ln, err := net.Listen("unix", path)
		require.NoError(t, err)
		go func() {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			buf := make([]byte, 4096)
			_, _ = c.Read(buf)
			b := make([]byte, headerSize)
			h.put(b)
			_, _ = c.Write(b)
			_, _ = c.Read(buf) // until the writer hangs up
		}()
		e, err := New(Config{Agent: "w", Transports: []Transport{TransportTCP}, Logger: quietLogger()})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err = dialSHM(ctx, e, Descriptor{Agent: "r", ShmAddr: path})
		cancel()
		require.ErrorIs(t, err, ErrMalformedFrame, "frame type %d of %d bytes", h.typ, h.length)
		require.NoError(t, e.Close())
		ln.Close()
	}
}

// TestSHMStreamHoldsOfAbandonedStreams: holds of streams given up without
// a commit or abort (their grants' slots no longer theirs) are let go once
// they outnumber the receiver's slots twice; an open stream's is kept.
func TestSHMStreamHoldsOfAbandonedStreams(t *testing.T) {
	p := newPair(t, TransportSHM)
	ctx := context.Background()
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{Region: 1, Offset: 0, Length: 8192}}})
	require.NoError(t, err)
	s, err := p.tx.OpenStream(ctx, p.desc, g.Ticket())
	require.NoError(t, err)
	require.NoError(t, s.Write(ctx, []Range{{Ext: 0, Offset: 0, Length: 4096}}, []Extent{{Region: 1, Offset: 0, Length: 4096}}))
	l, _ := shmSlot(t, p, g)
	released := 0
	l.genMu.Lock()
	for i := range 2*l.n + 1 { // grants no slot holds now
		l.streams[1<<40+uint64(i)] = streamHold{wid: l.wid, epoch: 1, release: func() { released++ }}
	}
	l.genMu.Unlock()
	require.NoError(t, s.Write(ctx, []Range{{Ext: 0, Offset: 4096, Length: 4096}}, []Extent{{Region: 1, Offset: 4096, Length: 4096}}))
	require.Equal(t, 2*l.n+1, released)
	l.genMu.Lock()
	_, kept := l.streams[g.Ticket().Grant]
	n := len(l.streams)
	l.genMu.Unlock()
	require.True(t, kept, "the open stream keeps its hold")
	require.Equal(t, 1, n)
	_, err = s.Commit(ctx)
	require.NoError(t, err)
}

// TestSHMGivenUpStreamLetsConnectionGo: a stream dropped after a part
// (its grant revoked; no commit, no abort, as a cancelled layer-by-layer
// prefill leaves it) does not keep the connection it copied under open
// past the next reconnect.
func TestSHMGivenUpStreamLetsConnectionGo(t *testing.T) {
	p := newPair(t, TransportSHM)
	ctx := context.Background()
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{Region: 1, Offset: 0, Length: 8192}}})
	require.NoError(t, err)
	s, err := p.tx.OpenStream(ctx, p.desc, g.Ticket())
	require.NoError(t, err)
	require.NoError(t, s.Write(ctx, []Range{{Ext: 0, Offset: 0, Length: 4096}}, []Extent{{Region: 1, Offset: 0, Length: 4096}}))
	l, _ := shmSlot(t, p, g)
	oldWid := l.wid
	g.Revoke()

	late, err := p.rx.Register("late", 8192)
	require.NoError(t, err)
	gB, err := p.rx.OpenGrant(GrantSpec{RequestID: 2, Extents: []Extent{{Region: late.ID(), Offset: 0, Length: 4000}}})
	require.NoError(t, err)
	_, err = p.tx.Write(ctx, p.rx.Descriptor(), gB.Ticket(), []Extent{{Region: 1, Offset: 0, Length: 4000}})
	require.NoError(t, err)
	require.NotEqual(t, oldWid, l.wid, "the write reconnected")
	l.genMu.Lock()
	defer l.genMu.Unlock()
	require.Empty(t, l.streams)
	require.Empty(t, l.retired, "the old connection is let go")
	require.Zero(t, l.users[oldWid])
}
