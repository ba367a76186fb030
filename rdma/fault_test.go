package rdma

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/handoff-io/handoff/internal/faultnet"
	"github.com/handoff-io/handoff/internal/leakcheck"
	"github.com/stretchr/testify/require"
)

// Data-path faults between a tcp writer and a receiver, injected by a proxy
// (internal/faultnet) that the writer dials instead of the receiver: added
// latency, a bandwidth cap, a reset in the middle of a frame, and a peer
// that vanishes without closing (half-open). Each test checks that a write
// ends within its deadline, that no byte lands once the grant is done (the
// destination is snapshotted when Done closes and compared after the faulty
// connections drained), that a fresh grant over the same bytes (a fenced
// retry) then succeeds, and that the receiver ends with no grant open.

const faultRegion = 8 << 20

// faultPair is a receiver and a writer whose tcp connections go through a
// fault-injecting proxy.
type faultPair struct {
	rx, tx   *Engine
	dst, src *Region
	proxy    *faultnet.Proxy
	via      Descriptor // the receiver's descriptor, its tcp address the proxy's
	lanes    int
}

func newFaultPair(t *testing.T, lanes int) *faultPair {
	t.Helper()
	leakcheck.Check(t)
	leakcheck.CheckFDs(t)
	p := &faultPair{lanes: lanes}
	var err error
	p.rx, err = New(Config{Agent: "fault-rx", Transports: []Transport{TransportTCP}, Logger: quietLogger()})
	require.NoError(t, err)
	p.dst, err = p.rx.Register("dst", faultRegion)
	require.NoError(t, err)
	fill(p.dst.Bytes(), canary)
	p.proxy, err = faultnet.New("127.0.0.1:0", p.rx.Descriptor().TCPAddr)
	require.NoError(t, err)
	p.via = p.rx.Descriptor()
	p.via.TCPAddr = p.proxy.Addr()
	p.startWriter(t, 1)
	t.Cleanup(func() {
		require.NoError(t, p.tx.Close())
		require.NoError(t, p.proxy.Close())
		require.NoError(t, p.rx.Close())
	})
	return p
}

// startWriter (re)starts the writer engine with a source region of pattern
// seed, connected through the proxy.
func (p *faultPair) startWriter(t *testing.T, seed uint64) {
	t.Helper()
	if p.tx != nil {
		require.NoError(t, p.tx.Close())
	}
	var err error
	p.tx, err = New(Config{Agent: "fault-tx", Transports: []Transport{TransportTCP}, Logger: quietLogger(), TCPLanes: p.lanes})
	require.NoError(t, err)
	p.src, err = p.tx.Register("src", faultRegion)
	require.NoError(t, err)
	rng := rand.New(rand.NewPCG(seed, 99))
	b := p.src.Bytes()
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], rng.Uint64())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	tr, err := p.tx.Connect(ctx, p.via)
	require.NoError(t, err)
	require.Equal(t, TransportTCP, tr)
}

// write opens a grant over dst with deadline d and writes the same number
// of bytes from the start of the source region into it, with the grant's
// deadline as the write's. It returns the grant, how long the write took and
// the write's error.
func (p *faultPair) write(t *testing.T, dst []Extent, d time.Duration) (*Grant, time.Duration, error) {
	t.Helper()
	deadline := time.Now().Add(d)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 7, Extents: dst, Deadline: deadline})
	require.NoError(t, err)
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	start := time.Now()
	_, werr := p.tx.Write(ctx, p.via, g.Ticket(), []Extent{{Region: 1, Offset: 0, Length: total(dst)}})
	return g, time.Since(start), werr
}

// warm writes dst once without faults, so that the writer holds every
// connection a write over dst needs (a lane dialled through a slow link
// would spend the deadline on its handshake), then puts the canary back.
func (p *faultPair) warm(t *testing.T, dst []Extent) {
	t.Helper()
	g, _, err := p.write(t, dst, 5*time.Second)
	require.NoError(t, err)
	p.requireLanded(t, g, dst)
	fill(p.dst.Bytes(), canary)
}

// requireLanded waits for g and checks that dst holds the source bytes and
// every byte outside dst still holds the canary.
func (p *faultPair) requireLanded(t *testing.T, g *Grant, dst []Extent) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := g.Wait(ctx)
	require.NoError(t, err)
	want := p.src.Bytes()[:total(dst)]
	require.True(t, bytes.Equal(want, concat(p.dst, dst)), "destination differs from the source")
	p.requireCanary(t, dst)
}

func (p *faultPair) requireCanary(t *testing.T, granted []Extent) {
	t.Helper()
	outside := p.dst.Bytes()
	var off uint64
	want := bytes.Repeat([]byte{canary}, 64<<10)
	check := func(b []byte) {
		for base := off; len(b) > 0; {
			n := min(len(b), len(want))
			if !bytes.Equal(b[:n], want[:n]) {
				t.Fatalf("a byte in [%d, %d) outside the grant changed", base, base+uint64(n))
			}
			b, base = b[n:], base+uint64(n)
		}
	}
	xs := slices.SortedFunc(slices.Values(granted), func(a, b Extent) int { return cmp.Compare(a.Offset, b.Offset) })
	for _, x := range xs {
		check(outside[off:x.Offset])
		off = x.Offset + x.Length
	}
	check(outside[off:])
}

// failed waits for g to end with an error, at most slack after its
// deadline, and returns a snapshot of the destination region taken as Done
// closed.
func (p *faultPair) failed(t *testing.T, g *Grant, slack time.Duration) ([]byte, error) {
	t.Helper()
	select {
	case <-g.Done():
	case <-time.After(time.Until(g.Ticket().Deadline) + slack):
		t.Fatalf("grant still open %s after its deadline", slack)
	}
	snap := bytes.Clone(p.dst.Bytes())
	err := g.Err()
	require.Error(t, err, "the grant must not commit")
	return snap, err
}

// drain ends the faulty writer and waits until the proxy carried every
// connection to its end: whatever the proxy still held has reached the
// receiver, which read its connections to the end and closed them.
func (p *faultPair) drain(t *testing.T) {
	t.Helper()
	p.proxy.SetLatency(0)
	p.proxy.SetBandwidth(0)
	p.proxy.Heal()
	require.NoError(t, p.tx.Close())
	require.Eventually(t, func() bool { return p.proxy.Stats().Live == 0 }, 10*time.Second, time.Millisecond,
		"proxied connections still open: %+v", p.proxy.Stats())
}

// requireIdle checks the receiver holds no grant and no quarantined byte.
func (p *faultPair) requireIdle(t *testing.T) {
	t.Helper()
	st := p.rx.Stats()
	require.Zero(t, st.GrantsOpen, "grants open: %+v", st)
	require.Zero(t, st.QuarantinedBytes)
}

// TestFaultTCPSlowLink writes through added latency and a bandwidth cap,
// striped over lanes and on one connection: every write lands whole
// within its deadline, and the cap really applied.
func TestFaultTCPSlowLink(t *testing.T) {
	for _, lanes := range []int{1, 4} {
		t.Run(map[int]string{1: "one-lane", 4: "striped"}[lanes], func(t *testing.T) {
			p := newFaultPair(t, lanes)
			p.proxy.SetLatency(3 * time.Millisecond)
			const rate = 32 << 20
			p.proxy.SetBandwidth(rate)
			dst := []Extent{{Region: 1, Offset: 4096, Length: 3 << 20}, {Region: 1, Offset: 5 << 20, Length: 1 << 20}}
			for range 2 {
				fill(p.dst.Bytes(), canary)
				g, took, err := p.write(t, dst, 10*time.Second)
				require.NoError(t, err)
				p.requireLanded(t, g, dst)
				require.GreaterOrEqual(t, took, time.Duration(total(dst))*time.Second/rate*3/4, "the cap did not apply")
				t.Logf("%d MiB in %s", total(dst)>>20, took)
			}
			st := p.proxy.Stats()
			if lanes > 1 {
				require.Greater(t, st.Accepted, int64(1), "a striped write uses several connections")
			}
			require.Greater(t, st.UpBytes, int64(2*total(dst)))
			p.requireIdle(t)
			require.Zero(t, p.tx.Stats().WritesFailed)
		})
	}
}

// TestFaultTCPDeadlineOnCappedLink gives a write less time than the capped
// link needs: the write and the grant end by the deadline, the bytes the
// proxy still held are delivered late (the cap lifted) and must land
// nowhere, and a fenced retry over the same destination succeeds.
func TestFaultTCPDeadlineOnCappedLink(t *testing.T) {
	for _, lanes := range []int{1, 4} {
		t.Run(map[int]string{1: "one-lane", 4: "striped"}[lanes], func(t *testing.T) {
			p := newFaultPair(t, lanes)
			p.proxy.SetBandwidth(4 << 20) // 4 MiB/s: the 4 MiB write needs a second
			dst := []Extent{{Region: 1, Offset: 1 << 20, Length: 4 << 20}}
			const d = 300 * time.Millisecond
			g, took, werr := p.write(t, dst, d)
			require.Error(t, werr)
			require.Less(t, took, d+time.Second, "the write outlived its deadline")
			snap, err := p.failed(t, g, time.Second)
			require.ErrorIs(t, err, ErrDeadline)
			require.Greater(t, p.proxy.Stats().UpBytes, int64(0), "some bytes went through before the deadline")

			p.drain(t)
			require.True(t, bytes.Equal(snap, p.dst.Bytes()), "bytes landed after the grant ended")
			p.requireCanary(t, dst)
			p.requireIdle(t)

			p.startWriter(t, 2)
			g, _, werr = p.write(t, dst, 5*time.Second)
			require.NoError(t, werr)
			p.requireLanded(t, g, dst)
			p.requireIdle(t)
		})
	}
}

// TestFaultTCPResetMidFrame cuts the writer's connection with an RST inside
// a data frame's payload: the write fails at once (not at its deadline),
// the receiver fails the grant at once, nothing lands afterwards, and a
// fenced retry from the same writer (which dials again) succeeds.
func TestFaultTCPResetMidFrame(t *testing.T) {
	for _, lanes := range []int{1, 4} {
		t.Run(map[int]string{1: "one-lane", 4: "striped"}[lanes], func(t *testing.T) {
			p := newFaultPair(t, lanes)
			dst := []Extent{{Region: 1, Offset: 0, Length: 3 << 20}, {Region: 1, Offset: 4 << 20, Length: 1 << 20}}
			// The connection was dialled and greeted by Connect: the count
			// starts at the first data frame's header, so the cut lands
			// 5000 bytes into its payload.
			fired := p.proxy.ResetAfter(headerSize + 5000)
			const d = 30 * time.Second
			g, took, werr := p.write(t, dst, d)
			require.Error(t, werr)
			require.ErrorIs(t, werr, ErrPeerClosed)
			require.Less(t, took, 5*time.Second, "a reset must fail the write at once")
			<-fired
			select {
			case <-g.Done():
			case <-time.After(5 * time.Second):
				t.Fatal("the receiver kept the grant open after its writer's connection was reset")
			}
			require.ErrorIs(t, g.Err(), ErrPeerClosed)
			require.Equal(t, int64(1), p.proxy.Stats().Resets)

			// The retry: a fresh grant (new epoch) over the same bytes,
			// from the same writer engine.
			g2, _, werr := p.write(t, dst, 5*time.Second)
			require.NoError(t, werr)
			p.requireLanded(t, g2, dst)
			landed := bytes.Clone(p.dst.Bytes())
			p.drain(t)
			require.True(t, bytes.Equal(landed, p.dst.Bytes()), "bytes landed after the retry committed")
			p.requireIdle(t)
		})
	}
}

// TestFaultTCPHalfOpenPeer stops all forwarding inside a data frame and
// keeps the sockets open: no FIN, no RST, as a peer whose host vanished.
// The write and the grant end by the deadline (the receiver's fence cuts
// the landing blocked mid-frame); when the link comes back, the rest of
// the frame and everything the writer had queued arrives late and lands
// nowhere; a fenced retry succeeds.
func TestFaultTCPHalfOpenPeer(t *testing.T) {
	for _, lanes := range []int{1, 4} {
		t.Run(map[int]string{1: "one-lane", 4: "striped"}[lanes], func(t *testing.T) {
			p := newFaultPair(t, lanes)
			dst := []Extent{{Region: 1, Offset: 0, Length: 3 << 20}, {Region: 1, Offset: 4 << 20, Length: 1 << 20}}
			fired := p.proxy.BlackholeAfter(headerSize + 5000)
			const d = 400 * time.Millisecond
			g, took, werr := p.write(t, dst, d)
			<-fired
			require.Error(t, werr)
			require.True(t, errors.Is(werr, context.DeadlineExceeded) || errors.Is(werr, ErrDeadline),
				"a silent peer ends the write at its deadline: %v", werr)
			require.Less(t, took, d+time.Second, "the write outlived its deadline")
			snap, err := p.failed(t, g, time.Second)
			require.ErrorIs(t, err, ErrDeadline)
			require.Zero(t, p.proxy.Stats().Resets)

			p.drain(t) // heals first: the held bytes arrive now
			require.True(t, bytes.Equal(snap, p.dst.Bytes()), "bytes landed after the grant ended")
			p.requireCanary(t, dst)
			p.requireIdle(t)

			p.startWriter(t, 3)
			g, _, werr = p.write(t, dst, 5*time.Second)
			require.NoError(t, werr)
			p.requireLanded(t, g, dst)
			p.requireIdle(t)
		})
	}
}

// TestFaultTCPLateFrames delays every frame past the grant's end on a link
// with more latency than the grant lives: the grant is revoked (or
// expires) before its first frame arrives, the connection stays healthy,
// and every frame then arrives whole and must be refused. Many small
// extents make many small frames, none of them in flight when the fence
// comes, so nothing but the grant's own checks stands between them and the
// destination.
func TestFaultTCPLateFrames(t *testing.T) {
	var dst []Extent
	for i := range 64 {
		dst = append(dst, Extent{Region: 1, Offset: uint64(i) * 96 << 10, Length: 32 << 10})
	}
	const latency = 300 * time.Millisecond
	for _, lanes := range []int{1, 4} {
		name := map[int]string{1: "one-lane", 4: "striped"}[lanes]
		t.Run(name+"/revoked", func(t *testing.T) {
			p := newFaultPair(t, lanes)
			p.warm(t, dst)
			p.proxy.SetLatency(latency)
			g, err := p.rx.OpenGrant(GrantSpec{RequestID: 8, Extents: dst, Deadline: time.Now().Add(10 * time.Second)})
			require.NoError(t, err)
			werr := make(chan error, 1)
			go func() {
				_, err := p.tx.Write(context.Background(), p.via, g.Ticket(), []Extent{{Region: 1, Length: total(dst)}})
				werr <- err
			}()
			g.Revoke() // the frames are on the link for another 300 ms
			snap := bytes.Clone(p.dst.Bytes())
			p.requireCanary(t, nil)
			// The commit's reply comes after the receiver read every frame
			// before it (on every lane: the commit follows the flushes).
			select {
			case err = <-werr:
			case <-time.After(10 * time.Second):
				t.Fatal("the write did not end")
			}
			require.True(t, bytes.Equal(snap, p.dst.Bytes()), "bytes landed after Revoke returned")
			require.ErrorIs(t, err, ErrRevoked)
			require.Greater(t, p.rx.Stats().FramesRefused, uint64(0))

			// The fenced retry, over the same link.
			p.proxy.SetLatency(0)
			g, _, err2 := p.write(t, dst, 5*time.Second)
			require.NoError(t, err2)
			p.requireLanded(t, g, dst)
			p.requireIdle(t)
		})
		t.Run(name+"/deadline", func(t *testing.T) {
			p := newFaultPair(t, lanes)
			p.warm(t, dst)
			p.proxy.SetLatency(latency)
			g, took, werr := p.write(t, dst, latency/3)
			require.Error(t, werr)
			require.Less(t, took, latency/3+time.Second, "the write outlived its deadline")
			snap, err := p.failed(t, g, time.Second)
			require.ErrorIs(t, err, ErrDeadline)
			p.requireCanary(t, nil)
			p.drain(t)
			require.True(t, bytes.Equal(snap, p.dst.Bytes()), "bytes landed after the deadline")
			require.Greater(t, p.rx.Stats().FramesRefused, uint64(0), "the late frames reached the receiver")

			p.startWriter(t, 4)
			g, _, werr = p.write(t, dst, 5*time.Second)
			require.NoError(t, werr)
			p.requireLanded(t, g, dst)
			p.requireIdle(t)
		})
	}
}

// TestFaultTCPIdleConnectionReset resets the writer's pooled connections
// while they are idle (a network blip, a middlebox dropping idle flows):
// nothing of the next write was sent yet, so it must not fail for it.
// tcpLink.get used to hand out such a connection unchecked, and the write
// failed with ErrPeerClosed ("writev: connection reset by peer").
func TestFaultTCPIdleConnectionReset(t *testing.T) {
	for _, lanes := range []int{1, 4} {
		t.Run(map[int]string{1: "one-lane", 4: "striped"}[lanes], func(t *testing.T) {
			p := newFaultPair(t, lanes)
			dst := []Extent{{Region: 1, Offset: 0, Length: 3 << 20}}
			p.warm(t, dst)
			live := p.proxy.Stats().Live
			p.proxy.Reset()
			// Both ends got the RST: the receiver closed its side.
			require.Eventually(t, func() bool { return p.proxy.Stats().Live == 0 }, 5*time.Second, time.Millisecond)
			g, _, err := p.write(t, dst, 5*time.Second)
			require.NoError(t, err, "the first write after %d pooled connections were reset while idle", live)
			p.requireLanded(t, g, dst)
			p.requireIdle(t)
		})
	}
}
