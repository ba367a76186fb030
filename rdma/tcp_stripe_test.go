package rdma

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/leakcheck"
)

// stripePair is a tcp writer and receiver with regions large enough for
// writes that are striped over several connections.
type stripePair struct {
	rx, tx   *Engine
	dst, src *Region
	desc     Descriptor
}

const stripeRegion = 24 << 20

func newStripePair(t *testing.T, lanes int) *stripePair {
	t.Helper()
	leakcheck.Check(t)
	leakcheck.CheckFDs(t)
	p := &stripePair{}
	var err error
	p.rx, err = New(Config{Agent: "stripe-rx", Transports: []Transport{TransportTCP}, Logger: quietLogger()})
	require.NoError(t, err)
	p.tx, err = New(Config{Agent: "stripe-tx", Transports: []Transport{TransportTCP}, Logger: quietLogger(), TCPLanes: lanes})
	require.NoError(t, err)
	p.dst, err = p.rx.Register("dst", stripeRegion)
	require.NoError(t, err)
	p.src, err = p.tx.Register("src", stripeRegion)
	require.NoError(t, err)
	fill(p.dst.Bytes(), canary)
	rng := rand.New(rand.NewPCG(5, 6))
	for i := range p.src.Bytes() {
		p.src.Bytes()[i] = byte(rng.Uint32())
	}
	p.desc = p.rx.Descriptor()
	_, err = p.tx.Connect(context.Background(), p.desc)
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, p.tx.Close())
		require.NoError(t, p.rx.Close())
	})
	return p
}

// stripedDst is n destination extents of size bytes with gaps between them.
func stripedDst(n int, size uint64) []Extent {
	xs := make([]Extent, n)
	for i := range xs {
		xs[i] = Extent{Region: 1, Offset: 4096 + uint64(i)*(size+8192), Length: size}
	}
	return xs
}

func (p *stripePair) rxConns() int {
	p.rx.tcp.mu.Lock()
	defer p.rx.tcp.mu.Unlock()
	return len(p.rx.tcp.conns)
}

func TestStripe(t *testing.T) {
	mk := func(sizes ...uint64) *writeOp {
		op := &writeOp{t: &Ticket{}}
		for i, n := range sizes {
			op.pieces = append(op.pieces, piece{ext: uint32(i), src: make([]byte, n)})
			op.t.Bytes += n
			op.n += n
		}
		return op
	}
	const mib = 1 << 20
	for _, tc := range []struct {
		name  string
		op    *writeOp
		lanes int
		want  []int // lane bytes
	}{
		{"one lane configured", mk(mib, mib, mib, mib), 1, nil},
		{"under two lanes' minimum", mk(mib/2, mib/2, mib/2), 4, nil},
		{"one extent", mk(8 * mib), 4, []int{2 * mib, 2 * mib, 2 * mib, 2 * mib}},
		{"even", mk(mib, mib, mib, mib, mib, mib, mib, mib), 4, []int{2 * mib, 2 * mib, 2 * mib, 2 * mib}},
		{"bytes bound the lanes", mk(mib, mib, mib), 8, []int{mib, mib, mib}},
		{"uneven extents", mk(6*mib, mib, mib), 4, []int{2 * mib, 2 * mib, 2 * mib, 2 * mib}},
		{"odd bytes", mk(3*mib+1, 2), 2, []int{(3*mib + 3) / 2, (3*mib + 3) - (3*mib+3)/2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pieces, cuts := stripe(tc.op, tc.lanes)
			if tc.want == nil {
				require.Nil(t, cuts)
				return
			}
			require.Len(t, cuts, len(tc.want)+1)
			var got []int
			for i := range tc.want {
				n := 0
				for _, p := range pieces[cuts[i]:cuts[i+1]] {
					n += len(p.src)
				}
				got = append(got, n)
			}
			require.Equal(t, tc.want, got)
			// The pieces cover the source in order, each extent from its
			// offset 0 on, and an extent is apart exactly when two lanes
			// carry it.
			next := map[uint32]uint64{}
			lanesOf := map[uint32]map[int]bool{}
			for lane := range tc.want {
				for _, p := range pieces[cuts[lane]:cuts[lane+1]] {
					require.Equal(t, next[p.ext], p.off)
					next[p.ext] += uint64(len(p.src))
					if lanesOf[p.ext] == nil {
						lanesOf[p.ext] = map[int]bool{}
					}
					lanesOf[p.ext][lane] = true
				}
			}
			for _, p := range pieces {
				require.Equal(t, len(lanesOf[p.ext]) > 1, p.apart, "extent %d", p.ext)
			}
		})
	}
}

func TestTCPStripedWrite(t *testing.T) {
	p := newStripePair(t, 4)
	ctx := context.Background()
	dst := stripedDst(8, 1<<20)
	// The source runs have other boundaries than the destination's.
	src := []Extent{{Region: 1, Offset: 7, Length: 3 << 20}, {Region: 1, Offset: 10 << 20, Length: 5 << 20}}
	for round := range 3 {
		g, err := p.rx.OpenGrant(GrantSpec{RequestID: uint64(round + 1), Extents: dst})
		require.NoError(t, err)
		m, err := p.tx.Write(ctx, p.desc, g.Ticket(), src)
		require.NoError(t, err)
		got, err := g.Wait(ctx)
		require.NoError(t, err)
		require.Equal(t, m, got)
		require.Equal(t, concat(p.src, src), concat(p.dst, dst))
	}
	for i, b := range p.dst.Bytes() {
		in := false
		for _, x := range dst {
			in = in || uint64(i) >= x.Offset && uint64(i) < x.Offset+x.Length
		}
		if !in && b != canary {
			t.Fatalf("byte %d outside the grant changed", i)
		}
	}
	// Four lanes, pooled: later writes reuse the connections.
	require.Equal(t, 4, p.rxConns())
	st := p.rx.Stats()
	require.Equal(t, uint64(3), st.GrantsCommitted)
}

// One large destination extent, the usual shape of a KV run: the lanes
// split it, each side sums the pieces apart and joins the sums, and the
// manifests agree with the bytes.
func TestTCPStripedWriteOneExtent(t *testing.T) {
	p := newStripePair(t, 4)
	ctx := context.Background()
	dst := []Extent{{Region: 1, Offset: 4096, Length: 16<<20 + 3}}
	src := []Extent{{Region: 1, Offset: 11, Length: 5 << 20}, {Region: 1, Offset: 6 << 20, Length: 11<<20 + 3}}
	for round := range 3 {
		g, err := p.rx.OpenGrant(GrantSpec{RequestID: uint64(round + 1), Extents: dst})
		require.NoError(t, err)
		m, err := p.tx.Write(ctx, p.desc, g.Ticket(), src)
		require.NoError(t, err)
		got, err := g.Wait(ctx)
		require.NoError(t, err)
		require.Equal(t, m, got)
		want := concat(p.src, src)
		require.Equal(t, crc32Update(0, want), got.CRC[0])
		require.Equal(t, want, concat(p.dst, dst))
	}
	require.Equal(t, 4, p.rxConns())
	require.Equal(t, byte(canary), p.dst.Bytes()[4095])
	require.Equal(t, byte(canary), p.dst.Bytes()[4096+16<<20+3])
}

// A receiver that does not announce the flush frame (one that predates
// striped writes) gets every write on one connection.
func TestTCPNoStripingWithoutFlushFeature(t *testing.T) {
	p := newStripePair(t, 4)
	p.tx.peerMu.Lock()
	l := p.tx.peers[p.rx.Agent()].link.(*tcpLink)
	p.tx.peerMu.Unlock()
	require.True(t, l.stripes.Load(), "this receiver announced flush")
	l.stripes.Store(false)
	ctx := context.Background()
	dst := stripedDst(8, 1<<20)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dst})
	require.NoError(t, err)
	_, err = p.tx.Write(ctx, p.desc, g.Ticket(), []Extent{{Region: 1, Offset: 0, Length: 8 << 20}})
	require.NoError(t, err)
	_, err = g.Wait(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, p.rxConns())
}

func TestTCPStripedWriteOneLane(t *testing.T) {
	p := newStripePair(t, 1)
	ctx := context.Background()
	dst := stripedDst(4, 1<<20)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dst})
	require.NoError(t, err)
	_, err = p.tx.Write(ctx, p.desc, g.Ticket(), []Extent{{Region: 1, Offset: 0, Length: 4 << 20}})
	require.NoError(t, err)
	_, err = g.Wait(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, p.rxConns())
}

// A striped write raced by Revoke: nothing lands once Revoke returned, and
// writer and receiver agree on the outcome.
func TestTCPStripedRevokeRacesWrite(t *testing.T) {
	p := newStripePair(t, 4)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(7, 8))
	dst := stripedDst(8, 1<<20)
	committed, revoked := 0, 0
	for i := range 20 {
		g, err := p.rx.OpenGrant(GrantSpec{RequestID: uint64(i + 1), Extents: dst})
		require.NoError(t, err)
		tk := g.Ticket()
		werr := make(chan error, 1)
		go func() {
			_, err := p.tx.Write(ctx, p.desc, tk, []Extent{{Region: 1, Offset: uint64(i) * 4096, Length: 8 << 20}})
			werr <- err
		}()
		time.Sleep(time.Duration(rng.IntN(3000)) * time.Microsecond)
		g.Revoke()
		snap := append([]byte(nil), p.dst.Bytes()...)
		err = <-werr
		time.Sleep(time.Millisecond)
		require.Equal(t, snap, p.dst.Bytes(), "bytes landed after Revoke returned (round %d)", i)
		if _, gerr := g.Wait(ctx); gerr == nil {
			committed++
			require.NoError(t, err, "receiver committed, writer must agree")
		} else {
			revoked++
			require.Error(t, err, "receiver revoked, writer must not report success")
		}
	}
	t.Logf("%d committed, %d revoked", committed, revoked)
	// The engine still writes after all that.
	fill(p.dst.Bytes(), canary)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 100, Extents: dst})
	require.NoError(t, err)
	_, err = p.tx.Write(ctx, p.desc, g.Ticket(), []Extent{{Region: 1, Offset: 0, Length: 8 << 20}})
	require.NoError(t, err)
	_, err = g.Wait(ctx)
	require.NoError(t, err)
}

// A striped write whose context ends mid-way fails, and so does its grant
// (or it never committed); the writer's pool is still usable.
func TestTCPStripedWriteCancelled(t *testing.T) {
	p := newStripePair(t, 4)
	dst := stripedDst(16, 1<<20)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dst})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = p.tx.Write(ctx, p.desc, g.Ticket(), []Extent{{Region: 1, Offset: 0, Length: 16 << 20}})
	require.ErrorIs(t, err, context.Canceled)
	g.Revoke()

	g2, err := p.rx.OpenGrant(GrantSpec{RequestID: 2, Extents: dst})
	require.NoError(t, err)
	_, err = p.tx.Write(context.Background(), p.desc, g2.Ticket(), []Extent{{Region: 1, Offset: 0, Length: 16 << 20}})
	require.NoError(t, err)
}

// The flush frame, driven by hand: lanes on two connections, a flush on
// each but the committing one, the grant done; a flush with a wrong token
// is answered with the refusal, and a lane that flushed may close without
// failing the grant.
func TestTCPRawFlush(t *testing.T) {
	r := newRawRx(t, time.Minute)
	a, b := payload(8192, 1), payload(65536, 2)
	lane := r.dial(t, "raw-tx", "raw-rx")
	defer lane.Close()
	flush := func(tok [16]byte) []byte {
		f := make([]byte, headerSize)
		(&header{typ: frameFlush, grant: r.tk.Grant, epoch: r.tk.Epoch, token: tok}).put(f)
		return f
	}
	_, err := lane.Write(append(r.data(0, 0, a), flush(r.tk.Token)...))
	require.NoError(t, err)
	h, msg, err := readReply(lane, make([]byte, headerSize+maxMsgLen))
	require.NoError(t, err)
	require.Equal(t, uint32(codeOK), h.index, msg)

	var bad [16]byte
	_, err = lane.Write(flush(bad))
	require.NoError(t, err)
	h, msg, err = readReply(lane, make([]byte, headerSize+maxMsgLen))
	require.NoError(t, err)
	require.Equal(t, uint32(codeBadToken), h.index, msg)
	require.NoError(t, lane.Close())

	r.send(t, r.data(1, 0, b))
	r.send(t, r.commit(fullManifest(a, b)))
	code, msg2 := r.reply(t)
	require.Equal(t, uint32(codeOK), code, msg2)
	require.NoError(t, r.wait(t))
	r.requireCanary(t)
}

// A lane that landed bytes and closed without its flush fails the grant.
func TestTCPRawLaneClosesBeforeFlush(t *testing.T) {
	r := newRawRx(t, time.Minute)
	lane := r.dial(t, "raw-tx", "raw-rx")
	_, err := lane.Write(r.data(0, 0, payload(8192, 1)))
	require.NoError(t, err)
	require.NoError(t, lane.Close())
	require.ErrorIs(t, r.wait(t), ErrPeerClosed)
	r.requireCanary(t)
}
