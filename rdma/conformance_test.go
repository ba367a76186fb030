package rdma

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/leakcheck"
)

const canary = 0xA5

// testTransports lists the transports the conformance suite runs against.
func testTransports() []Transport {
	ts := []Transport{TransportInproc, TransportTCP}
	if shmSupported {
		ts = append(ts, TransportSHM)
	}
	return append(ts, ucxTestTransports()...)
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// pair is a receiver and a writer engine that reach each other over one transport.
type pair struct {
	t        Transport
	rx, tx   *Engine
	dst, src *Region
	desc     Descriptor
}

const pairRegion = 1 << 20

func newPair(t *testing.T, tr Transport) *pair { return newPairCRC(t, tr, false, false) }

// newPairCRC sets SkipCRC on the receiver and the writer.
func newPairCRC(t *testing.T, tr Transport, rxSkip, txSkip bool) *pair {
	return newPairCase(t, hostCase(tr), rxSkip, txSkip)
}

// pairCase is one way to build a pair: a transport, and where the
// receiver's and the writer's regions live (device regions over the fake
// driver, device_linux_test.go).
type pairCase struct {
	name   string
	t      Transport
	rx, tx Memory
}

func hostCase(tr Transport) pairCase { return pairCase{string(tr), tr, MemoryHost, MemoryHost} }

// pairCases lists every case the conformance suite runs: each transport
// over host memory, then device memory on either or both ends.
func pairCases() []pairCase {
	var cs []pairCase
	for _, tr := range testTransports() {
		cs = append(cs, hostCase(tr))
	}
	return append(cs, devicePairCases()...)
}

// newPairCase builds the pair of case c; SkipCRC as in newPairCRC.
func newPairCase(t *testing.T, c pairCase, rxSkip, txSkip bool) *pair {
	t.Helper()
	tr := c.t
	// No goroutine, connection, memfd or listener outlives the pair.
	leakcheck.Check(t)
	leakcheck.CheckFDs(t)
	p := &pair{t: tr}
	var err error
	var release []func()
	p.rx, err = New(Config{Agent: AgentID("rx-" + t.Name()), Transports: []Transport{tr}, Logger: quietLogger(), SkipCRC: rxSkip})
	require.NoError(t, err)
	p.tx, err = New(Config{Agent: AgentID("tx-" + t.Name()), Transports: []Transport{tr}, Logger: quietLogger(), SkipCRC: txSkip})
	require.NoError(t, err)
	region := func(e *Engine, name string, m Memory, ordinal int) *Region {
		if m == MemoryCUDA {
			r, free := deviceRegion(t, e, name, pairRegion, ordinal)
			release = append(release, free)
			return r
		}
		r, err := e.Register(name, pairRegion)
		require.NoError(t, err)
		return r
	}
	p.dst = region(p.rx, "dst", c.rx, 0)
	p.src = region(p.tx, "src", c.tx, 1)
	fillRegion(p.dst, canary)
	rng := rand.New(rand.NewPCG(1, 2))
	src := make([]byte, pairRegion)
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	setRegion(p.src, src)
	p.desc = p.rx.Descriptor()
	got, err := p.tx.Connect(context.Background(), p.desc)
	require.NoError(t, err)
	require.Equal(t, tr, got)
	tt, ok := p.tx.TransportFor(p.rx.Agent())
	require.True(t, ok)
	require.Equal(t, tr, tt)
	t.Cleanup(func() {
		require.NoError(t, p.tx.Close())
		require.NoError(t, p.rx.Close())
		require.NoError(t, p.rx.Close(), "Close is idempotent")
		for _, f := range release {
			f()
		}
	})
	return p
}

func fill(b []byte, v byte) {
	for i := range b {
		b[i] = v
	}
}

// requireCanary checks that the receiver region holds the canary outside the given extents.
func (p *pair) requireCanary(t *testing.T, granted []Extent) {
	t.Helper()
	inside := make([]bool, pairRegion)
	for _, x := range granted {
		for i := x.Offset; i < x.Offset+x.Length; i++ {
			inside[i] = true
		}
	}
	for i, b := range regionBytes(p.dst) {
		if !inside[i] && b != canary {
			t.Fatalf("byte %d outside the grant changed to %#x", i, b)
		}
	}
}

// requireUntouched checks the whole receiver region still holds the canary.
func (p *pair) requireUntouched(t *testing.T) { t.Helper(); p.requireCanary(t, nil) }

func dstExtents() []Extent {
	return []Extent{
		{Region: 1, Offset: 100, Length: 5000},
		{Region: 1, Offset: 9000, Length: 1},
		{Region: 1, Offset: 20000, Length: 70000},
		{Region: 1, Offset: 100000, Length: 4096},
	}
}

func srcExtents(total uint64) []Extent {
	// Different boundaries from the destination: 3 runs.
	a := total / 3
	return []Extent{
		{Region: 1, Offset: 7, Length: a},
		{Region: 1, Offset: 300000, Length: a + 11},
		{Region: 1, Offset: 600000, Length: total - 2*a - 11},
	}
}

func concat(r *Region, xs []Extent) []byte {
	var b []byte
	for _, x := range xs {
		b = append(b, regionBytes(r)[x.Offset:x.Offset+x.Length]...)
	}
	return b
}

func total(xs []Extent) (n uint64) {
	for _, x := range xs {
		n += x.Length
	}
	return n
}

func forEachTransport(t *testing.T, f func(t *testing.T, p *pair)) {
	for _, c := range pairCases() {
		t.Run(c.name, func(t *testing.T) { f(t, newPairCase(t, c, false, false)) })
	}
}

// forEachTransportHeavy is forEachTransport for the long randomized tests:
// of the device cases only those with device memory on both ends, which
// take every device path (staging on both tcp ends, device-to-device copies
// inproc and over cuda-ipc); the mixed ones run in the other tests.
func forEachTransportHeavy(t *testing.T, f func(t *testing.T, p *pair)) {
	for _, c := range pairCases() {
		if c.rx != c.tx {
			continue
		}
		t.Run(c.name, func(t *testing.T) { f(t, newPairCase(t, c, false, false)) })
	}
}

func TestConformanceWriteReadBack(t *testing.T) {
	forEachTransport(t, func(t *testing.T, p *pair) {
		ctx := context.Background()
		for round := 0; round < 3; round++ {
			dst := dstExtents()
			g, err := p.rx.OpenGrant(GrantSpec{RequestID: uint64(round + 1), Extents: dst, Deadline: time.Now().Add(10 * time.Second)})
			require.NoError(t, err)
			tk := g.Ticket()
			require.Equal(t, total(dst), tk.Bytes)
			src := srcExtents(tk.Bytes)
			m, err := p.tx.Write(ctx, p.desc, tk, src)
			require.NoError(t, err)
			got, err := g.Wait(ctx)
			require.NoError(t, err)
			require.Equal(t, m, got)
			require.Equal(t, concat(p.src, src), concat(p.dst, dst))
			p.requireCanary(t, dst)
			for i, x := range dst {
				require.Equal(t, x.Length, got.Bytes[i])
				require.Equal(t, crc32Update(0, concat(p.dst, dst[i:i+1])), got.CRC[i])
			}
			select {
			case <-g.Done():
			default:
				t.Fatal("Done not closed after commit")
			}
			select {
			case <-g.Failed():
				t.Fatal("Failed closed after commit")
			default:
			}
			rs, ts := p.rx.Stats(), p.tx.Stats()
			require.Equal(t, uint64(round+1), rs.GrantsCommitted)
			require.Equal(t, uint64(round+1)*tk.Bytes, rs.BytesLanded)
			require.Equal(t, uint64(0), rs.GrantsOpen)
			require.Equal(t, uint64(round+1), ts.Writes)
			require.Equal(t, uint64(round+1)*tk.Bytes, ts.BytesWritten)
			g.Revoke() // no-op after commit
			_, err = g.Wait(ctx)
			require.NoError(t, err)
			select {
			case <-g.Failed():
				t.Fatal("Failed closed by a revoke after commit")
			default:
			}
			// A second write into the committed grant is refused.
			_, err = p.tx.Write(ctx, p.desc, tk, src)
			require.ErrorIs(t, err, ErrCommitted)
			fillRegion(p.dst, canary)
		}
	})
}

func TestConformanceConcurrentGrants(t *testing.T) {
	forEachTransport(t, func(t *testing.T, p *pair) {
		ctx := context.Background()
		const n = 8
		const size = 16 << 10
		var wg sync.WaitGroup
		errs := make([]error, n)
		grants := make([]*Grant, n)
		for i := range n {
			g, err := p.rx.OpenGrant(GrantSpec{RequestID: uint64(i + 1), Extents: []Extent{{Region: 1, Offset: uint64(i) * 2 * size, Length: size}}})
			require.NoError(t, err)
			grants[i] = g
		}
		for i := range n {
			wg.Go(func() {
				_, errs[i] = p.tx.Write(ctx, p.desc, grants[i].Ticket(), []Extent{{Region: 1, Offset: uint64(i) * 4096, Length: size}})
			})
		}
		wg.Wait()
		var granted []Extent
		for i := range n {
			require.NoError(t, errs[i])
			_, err := grants[i].Wait(ctx)
			require.NoError(t, err)
			x := grants[i].Ticket().Extents[0]
			granted = append(granted, x)
			require.Equal(t, regionBytes(p.src)[i*4096:i*4096+size], regionBytes(p.dst)[x.Offset:x.Offset+x.Length])
		}
		p.requireCanary(t, granted)
	})
}

func TestConformanceRefusals(t *testing.T) {
	forEachTransport(t, func(t *testing.T, p *pair) {
		ctx := context.Background()
		open := func(t *testing.T) (*Grant, Ticket) {
			g, err := p.rx.OpenGrant(GrantSpec{RequestID: 7, Extents: dstExtents()})
			require.NoError(t, err)
			t.Cleanup(g.Revoke)
			return g, g.Ticket()
		}
		src := func(tk Ticket) []Extent { return srcExtents(tk.Bytes) }
		requireOpen := func(t *testing.T, g *Grant) {
			select {
			case <-g.Done():
				t.Fatalf("grant settled: %v", g.Err())
			case <-g.Failed():
				t.Fatalf("grant failed: %v", g.Err())
			default:
			}
		}

		t.Run("bad token", func(t *testing.T) {
			g, tk := open(t)
			bad := tk
			bad.Token[3] ^= 1
			_, err := p.tx.Write(ctx, p.desc, bad, src(tk))
			require.ErrorIs(t, err, ErrBadToken)
			var re *RemoteError
			require.ErrorAs(t, err, &re)
			require.Equal(t, p.rx.Agent(), re.Agent)
			p.requireUntouched(t)
			requireOpen(t, g) // a forged frame does not kill the grant
			_, err = p.tx.Write(ctx, p.desc, tk, src(tk))
			require.NoError(t, err)
			_, err = g.Wait(ctx)
			require.NoError(t, err)
			fillRegion(p.dst, canary)
		})
		t.Run("unknown grant", func(t *testing.T) {
			_, tk := open(t)
			bad := tk
			bad.Grant += 1 << 40
			_, err := p.tx.Write(ctx, p.desc, bad, src(tk))
			require.ErrorIs(t, err, ErrUnknownGrant)
			p.requireUntouched(t)
		})
		t.Run("stale epoch", func(t *testing.T) {
			g, tk := open(t)
			bad := tk
			bad.Epoch--
			_, err := p.tx.Write(ctx, p.desc, bad, src(tk))
			require.ErrorIs(t, err, ErrStaleEpoch)
			p.requireUntouched(t)
			requireOpen(t, g)
		})
		t.Run("revoked", func(t *testing.T) {
			g, tk := open(t)
			g.Revoke()
			g.Revoke()
			_, err := g.Wait(ctx)
			require.ErrorIs(t, err, ErrRevoked)
			select {
			case <-g.Failed():
			default:
				t.Fatal("Failed not closed after a revoke")
			}
			require.NotEqual(t, tk.Epoch, g.Ticket().Epoch, "revoke bumps the epoch")
			_, err = p.tx.Write(ctx, p.desc, tk, src(tk))
			require.Error(t, err)
			require.True(t, errors.Is(err, ErrRevoked) || errors.Is(err, ErrStaleEpoch), "%v", err)
			p.requireUntouched(t)
		})
		t.Run("deadline", func(t *testing.T) {
			g, err := p.rx.OpenGrant(GrantSpec{RequestID: 9, Extents: dstExtents(), Deadline: time.Now().Add(30 * time.Millisecond)})
			require.NoError(t, err)
			tk := g.Ticket()
			_, err = g.Wait(ctx)
			require.ErrorIs(t, err, ErrDeadline)
			// The writer checks the deadline itself...
			_, err = p.tx.Write(ctx, p.desc, tk, src(tk))
			require.ErrorIs(t, err, ErrDeadline)
			// ...and the receiver refuses a ticket whose deadline was forged.
			tk.Deadline = time.Now().Add(time.Hour)
			_, err = p.tx.Write(ctx, p.desc, tk, src(tk))
			require.Error(t, err)
			require.True(t, errors.Is(err, ErrDeadline) || errors.Is(err, ErrStaleEpoch), "%v", err)
			p.requireUntouched(t)
		})
		t.Run("forged extents", func(t *testing.T) {
			g, tk := open(t)
			bad := tk
			bad.Extents = append([]Extent(nil), tk.Extents...)
			bad.Extents[0].Length += 64 // more bytes than the grant's first extent holds
			bad.Bytes += 64
			_, err := p.tx.Write(ctx, p.desc, bad, srcExtents(bad.Bytes))
			require.Error(t, err)
			require.True(t, errors.Is(err, ErrOutOfRange) || errors.Is(err, ErrManifestMismatch), "%v", err)
			p.requireCanary(t, tk.Extents)
			_, err = g.Wait(ctx)
			require.Error(t, err, "a writer with the right token and wrong extents fails the grant")
			fillRegion(p.dst, canary)
		})
		t.Run("length mismatch", func(t *testing.T) {
			_, tk := open(t)
			_, err := p.tx.Write(ctx, p.desc, tk, srcExtents(tk.Bytes-1))
			require.ErrorIs(t, err, ErrOutOfRange)
			_, err = p.tx.Write(ctx, p.desc, tk, []Extent{{Region: 9, Offset: 0, Length: tk.Bytes}})
			require.ErrorIs(t, err, ErrOutOfRange)
			_, err = p.tx.Write(ctx, p.desc, tk, []Extent{{Region: 1, Offset: pairRegion - 10, Length: tk.Bytes}})
			require.ErrorIs(t, err, ErrOutOfRange)
			p.requireUntouched(t)
		})
		t.Run("cancelled context", func(t *testing.T) {
			_, tk := open(t)
			cctx, cancel := context.WithCancel(ctx)
			cancel()
			_, err := p.tx.Write(cctx, p.desc, tk, src(tk))
			require.ErrorIs(t, err, context.Canceled)
		})
	})
}

func TestConformanceCloseRevokes(t *testing.T) {
	forEachTransport(t, func(t *testing.T, p *pair) {
		g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dstExtents()})
		require.NoError(t, err)
		tk := g.Ticket()
		require.NoError(t, p.rx.Close())
		_, err = g.Wait(context.Background())
		require.ErrorIs(t, err, ErrRevoked)
		require.ErrorIs(t, err, ErrClosed)
		_, err = p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dstExtents()})
		require.ErrorIs(t, err, ErrClosed)
		_, err = p.tx.Write(context.Background(), p.desc, tk, srcExtents(tk.Bytes))
		require.Error(t, err)
		require.NoError(t, p.tx.Close())
		_, err = p.tx.Write(context.Background(), p.desc, tk, srcExtents(tk.Bytes))
		require.ErrorIs(t, err, ErrClosed)
	})
}

func TestConformanceManyExtents(t *testing.T) {
	forEachTransportHeavy(t, func(t *testing.T, p *pair) {
		// 200 one-KiB runs with gaps, written from one source run.
		var dst []Extent
		for i := range 200 {
			dst = append(dst, Extent{Region: 1, Offset: uint64(i) * 3000, Length: 1024})
		}
		g, err := p.rx.OpenGrant(GrantSpec{RequestID: 3, Extents: dst})
		require.NoError(t, err)
		src := []Extent{{Region: 1, Offset: 1, Length: 200 * 1024}}
		_, err = p.tx.Write(context.Background(), p.desc, g.Ticket(), src)
		require.NoError(t, err)
		_, err = g.Wait(context.Background())
		require.NoError(t, err)
		require.True(t, bytes.Equal(concat(p.src, src), concat(p.dst, dst)))
		p.requireCanary(t, dst)
	})
}

func TestOpenGrantValidation(t *testing.T) {
	e, err := New(Config{Agent: "v", Transports: []Transport{TransportInproc}, Logger: quietLogger()})
	require.NoError(t, err)
	defer e.Close()
	r, err := e.Register("kv", 4096)
	require.NoError(t, err)
	r.Forbid(1024, 512)
	r.Forbid(1400, 400) // merges with the first
	require.Equal(t, []Extent{{Region: 1, Offset: 1024, Length: 776}}, r.Forbidden())
	x := func(off, n uint64) []Extent { return []Extent{{Region: 1, Offset: off, Length: n}} }
	for _, tc := range []struct {
		name string
		spec GrantSpec
		want error
	}{
		{"request 0", GrantSpec{RequestID: 0, Extents: x(0, 10)}, ErrBadRequestID},
		{"no extents", GrantSpec{RequestID: 1}, ErrOutOfRange},
		{"empty extent", GrantSpec{RequestID: 1, Extents: x(0, 0)}, ErrOutOfRange},
		{"past end", GrantSpec{RequestID: 1, Extents: x(4000, 97)}, ErrOutOfRange},
		{"offset past end", GrantSpec{RequestID: 1, Extents: x(5000, 1)}, ErrOutOfRange},
		{"overflow", GrantSpec{RequestID: 1, Extents: x(1<<63, 1<<63)}, ErrOutOfRange},
		{"unknown region", GrantSpec{RequestID: 1, Extents: []Extent{{Region: 2, Offset: 0, Length: 1}}}, ErrOutOfRange},
		{"overlapping extents", GrantSpec{RequestID: 1, Extents: []Extent{{1, 0, 100}, {1, 99, 10}}}, ErrOutOfRange},
		{"forbidden start", GrantSpec{RequestID: 1, Extents: x(1024, 1)}, ErrForbidden},
		{"forbidden tail", GrantSpec{RequestID: 1, Extents: x(1799, 10)}, ErrForbidden},
		{"spans forbidden", GrantSpec{RequestID: 1, Extents: x(0, 4096)}, ErrForbidden},
		{"deadline passed", GrantSpec{RequestID: 1, Extents: x(0, 10), Deadline: time.Now().Add(-time.Second)}, ErrDeadline},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.OpenGrant(tc.spec)
			require.ErrorIs(t, err, tc.want)
		})
	}
	for _, ok := range [][]Extent{x(0, 1024), x(1800, 2296), {{1, 0, 10}, {1, 10, 10}}} {
		g, err := e.OpenGrant(GrantSpec{RequestID: 1, Extents: ok})
		require.NoError(t, err, fmt.Sprint(ok))
		g.Revoke()
	}

	// A destination held by an open grant cannot be granted again until
	// that grant is Done.
	g1, err := e.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{1, 100, 100}, {1, 2000, 100}}})
	require.NoError(t, err)
	g2, err := e.OpenGrant(GrantSpec{RequestID: 2, Extents: []Extent{{1, 200, 100}, {1, 1900, 100}}}) // touching, not overlapping
	require.NoError(t, err)
	for _, busy := range [][]Extent{x(150, 1), x(0, 101), x(2099, 50), x(1950, 51), {{1, 300, 10}, {1, 199, 2}}} {
		_, err := e.OpenGrant(GrantSpec{RequestID: 3, Extents: busy})
		require.ErrorIs(t, err, ErrBusy, fmt.Sprint(busy))
	}
	g1.Revoke()
	g3, err := e.OpenGrant(GrantSpec{RequestID: 3, Extents: x(100, 100)})
	require.NoError(t, err)
	_, err = e.OpenGrant(GrantSpec{RequestID: 4, Extents: x(250, 1)})
	require.ErrorIs(t, err, ErrBusy)
	g2.Revoke()
	g3.Revoke()
	g4, err := e.OpenGrant(GrantSpec{RequestID: 4, Extents: x(0, 1024)})
	require.NoError(t, err)
	g4.Revoke()
	require.Panics(t, func() { r.Forbid(4000, 97) })
}

// TestConformanceRevokeRacesWrite revokes grants at random moments of a
// write in progress: whatever the interleaving, once Revoke returned the
// destination never changes again, and the outcome on both sides agrees.
func TestConformanceRevokeRacesWrite(t *testing.T) {
	forEachTransportHeavy(t, func(t *testing.T, p *pair) {
		const size = 256 << 10
		dst := []Extent{{Region: 1, Offset: 4096, Length: size}}
		revokeRaces(t, p, rand.New(rand.NewPCG(3, 4)), 30, dst, func(i int) []Extent {
			return []Extent{{Region: 1, Offset: uint64(i) * 1000, Length: size}}
		})
	})
}

// TestConformanceRevokeRacesSmallPieces is RevokeRacesWrite for a write
// of many small pieces (scattered 4 KiB runs, which ucx packs several to
// a message): no byte lands after Revoke, whichever piece of a message a
// revoke catches.
func TestConformanceRevokeRacesSmallPieces(t *testing.T) {
	forEachTransportHeavy(t, func(t *testing.T, p *pair) {
		var dst []Extent
		for i := range 96 {
			dst = append(dst, Extent{Region: 1, Offset: 4096 + uint64(i)*6000, Length: 4096})
		}
		revokeRaces(t, p, rand.New(rand.NewPCG(5, 6)), 12, dst, func(i int) []Extent {
			return []Extent{{Region: 1, Offset: uint64(i) * 1000, Length: 96 * 4096}}
		})
	})
}

// revokeRaces writes src(i) into a grant over dst and revokes it after a
// random pause, rounds times: after Revoke returned no byte changes, the
// canary around dst is intact, the writer reports success exactly when
// the receiver committed, and a committed grant holds the source's bytes.
func revokeRaces(t *testing.T, p *pair, rng *rand.Rand, rounds int, dst []Extent, src func(i int) []Extent) {
	ctx := context.Background()
	committed, revoked := 0, 0
	for i := range rounds {
		fillRegion(p.dst, canary)
		g, err := p.rx.OpenGrant(GrantSpec{RequestID: uint64(i + 1), Extents: dst})
		require.NoError(t, err)
		tk := g.Ticket()
		werr := make(chan error, 1)
		go func() {
			_, err := p.tx.Write(ctx, p.desc, tk, src(i))
			werr <- err
		}()
		time.Sleep(time.Duration(rng.IntN(400)) * time.Microsecond)
		g.Revoke()
		snap := regionBytes(p.dst)
		err = <-werr
		time.Sleep(time.Millisecond)
		require.Equal(t, snap, regionBytes(p.dst), "bytes landed after Revoke returned (round %d)", i)
		p.requireCanary(t, dst)
		if _, gerr := g.Wait(ctx); gerr == nil {
			committed++
			require.NoError(t, err, "receiver committed, writer must agree")
			require.True(t, bytes.Equal(concat(p.src, src(i)), concat(p.dst, dst)), "round %d", i)
		} else {
			revoked++
			require.Error(t, err, "receiver revoked, writer must not report success")
		}
	}
	t.Logf("%s: %d committed, %d revoked", p.t, committed, revoked)
}

func TestConformanceSkipCRC(t *testing.T) {
	for _, pc := range pairCases() {
		t.Run(pc.name, func(t *testing.T) {
			ctx := context.Background()
			for _, tc := range []struct {
				name           string
				rxSkip, txSkip bool
				want           error
			}{
				{"both skip", true, true, nil},
				{"receiver requires crc", false, true, ErrManifestMismatch},
				{"writer sends crc anyway", true, false, nil},
			} {
				t.Run(tc.name, func(t *testing.T) {
					p := newPairCase(t, pc, tc.rxSkip, tc.txSkip)
					g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dstExtents()})
					require.NoError(t, err)
					tk := g.Ticket()
					m, err := p.tx.Write(ctx, p.desc, tk, srcExtents(tk.Bytes))
					_, gerr := g.Wait(ctx)
					if tc.want != nil {
						require.ErrorIs(t, err, tc.want)
						require.ErrorIs(t, gerr, tc.want)
						return
					}
					require.NoError(t, err)
					require.NoError(t, gerr)
					require.Equal(t, concat(p.src, srcExtents(tk.Bytes)), concat(p.dst, dstExtents()))
					if tc.txSkip {
						require.Equal(t, make([]uint32, len(tk.Extents)), m.CRC)
					}
					p.requireCanary(t, dstExtents())
				})
			}
		})
	}
}

func TestDescriptorAndTicketJSON(t *testing.T) {
	p := newPair(t, TransportTCP)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 77, Extents: dstExtents()})
	require.NoError(t, err)
	var d Descriptor
	b, err := json.Marshal(p.rx.Descriptor())
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &d))
	require.Equal(t, p.rx.Descriptor(), d)
	var tk Ticket
	b, err = json.Marshal(g.Ticket())
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &tk))
	require.True(t, tk.Deadline.Equal(g.Ticket().Deadline))
	tk.Deadline = g.Ticket().Deadline
	require.Equal(t, g.Ticket(), tk)
	// The decoded values work: another process would do exactly this.
	_, err = p.tx.Write(context.Background(), d, tk, srcExtents(tk.Bytes))
	require.NoError(t, err)
	_, err = g.Wait(context.Background())
	require.NoError(t, err)
}

func TestCloseAbortsDialInProgress(t *testing.T) {
	leakcheck.Check(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0") // accepts in the kernel, never answers the hello
	require.NoError(t, err)
	defer ln.Close()
	tx, err := New(Config{Agent: "tx", Transports: []Transport{TransportTCP}, Logger: quietLogger()})
	require.NoError(t, err)
	res := make(chan error, 1)
	go func() {
		_, err := tx.Connect(context.Background(), Descriptor{Agent: "mute", TCPAddr: ln.Addr().String(), Transports: []Transport{TransportTCP}})
		res <- err
	}()
	time.Sleep(50 * time.Millisecond)
	start := time.Now()
	require.NoError(t, tx.Close())
	select {
	case err := <-res:
		require.ErrorIs(t, err, ErrClosed)
	case <-time.After(5 * time.Second):
		t.Fatal("Connect kept dialling after Close")
	}
	require.Less(t, time.Since(start), 5*time.Second)
	ln.Close()
}

func TestNoCommonTransport(t *testing.T) {
	a, err := New(Config{Agent: "a", Transports: []Transport{TransportTCP}, Logger: quietLogger()})
	require.NoError(t, err)
	defer a.Close()
	b, err := New(Config{Agent: "b", Transports: []Transport{TransportInproc}, Logger: quietLogger()})
	require.NoError(t, err)
	defer b.Close()
	_, err = a.Connect(context.Background(), b.Descriptor())
	require.ErrorIs(t, err, ErrNoTransport)
	_, ok := a.TransportFor("b")
	require.False(t, ok)
	_, err = New(Config{})
	require.Error(t, err)
	_, err = New(Config{Agent: "x", Transports: []Transport{"carrier-pigeon"}})
	require.ErrorIs(t, err, ErrUnsupported)
}

// TestConformanceRandomLayouts writes random source layouts into random
// destination layouts (property test): the concatenations match, nothing
// outside the grant changes, and the manifest crcs are those of the landed
// extents.
func TestConformanceRandomLayouts(t *testing.T) {
	forEachTransportHeavy(t, func(t *testing.T, p *pair) {
		ctx := context.Background()
		rng := rand.New(rand.NewPCG(5, 6))
		for round := range 12 {
			fillRegion(p.dst, canary)
			// Destination: 1..40 disjoint runs in random order.
			var dst []Extent
			for off := uint64(rng.IntN(64)); len(dst) < 1+rng.IntN(40); {
				n := uint64(1 + rng.IntN(20000))
				if off+n > pairRegion {
					break
				}
				dst = append(dst, Extent{Region: 1, Offset: off, Length: n})
				off += n + uint64(rng.IntN(3000))
			}
			rng.Shuffle(len(dst), func(i, j int) { dst[i], dst[j] = dst[j], dst[i] })
			g, err := p.rx.OpenGrant(GrantSpec{RequestID: uint64(round + 1), Extents: dst})
			require.NoError(t, err)
			tk := g.Ticket()
			// Source: the same byte count cut at random points, anywhere.
			var src []Extent
			for left := tk.Bytes; left > 0; {
				n := min(left, uint64(1+rng.IntN(30000)))
				off := uint64(rng.IntN(pairRegion - int(n) + 1))
				src = append(src, Extent{Region: 1, Offset: off, Length: n})
				left -= n
			}
			m, err := p.tx.Write(ctx, p.desc, tk, src)
			require.NoError(t, err)
			got, err := g.Wait(ctx)
			require.NoError(t, err)
			require.Equal(t, m, got)
			require.True(t, bytes.Equal(concat(p.src, src), concat(p.dst, dst)), "round %d", round)
			for i, x := range dst {
				require.Equal(t, crc32Update(0, concat(p.dst, []Extent{x})), got.CRC[i])
			}
			p.requireCanary(t, dst)
		}
	})
}

// A receiver hears once that a writer is gone when the writer's engine
// closes its connections, and not while the writer lives (tcp with several
// pooled connections, shm with its control socket).
func TestWriterGone(t *testing.T) {
	for _, tr := range append([]Transport{TransportTCP, TransportSHM}, ucxTestTransports()...) {
		if tr == TransportSHM && !shmSupported {
			continue
		}
		t.Run(string(tr), func(t *testing.T) {
			rx, err := New(Config{Agent: "gone-rx", Transports: []Transport{tr}, Logger: quietLogger()})
			require.NoError(t, err)
			defer rx.Close()
			gone := make(chan AgentID, 4)
			rx.OnWriterGone(func(a AgentID) { gone <- a })
			_, err = rx.Register("dst", 4<<20)
			require.NoError(t, err)
			tx, err := New(Config{Agent: "gone-tx", Transports: []Transport{tr}, Logger: quietLogger()})
			require.NoError(t, err)
			src, err := tx.Register("src", 4<<20)
			require.NoError(t, err)
			_, err = tx.Connect(context.Background(), rx.Descriptor())
			require.NoError(t, err)
			// A striped write opens more connections; none of them closing
			// while the writer lives is reported.
			g, err := rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{1, 0, 2 << 20}, {1, 2 << 20, 2 << 20}}})
			require.NoError(t, err)
			_, err = tx.Write(context.Background(), rx.Descriptor(), g.Ticket(), []Extent{{src.ID(), 0, 4 << 20}})
			require.NoError(t, err)
			select {
			case a := <-gone:
				t.Fatalf("%s reported gone while it lives", a)
			case <-time.After(50 * time.Millisecond):
			}
			require.True(t, rx.WriterConnected("gone-tx"))
			require.False(t, rx.WriterConnected("someone-else"))
			require.NoError(t, tx.Close())
			select {
			case a := <-gone:
				require.Equal(t, AgentID("gone-tx"), a)
			case <-time.After(5 * time.Second):
				t.Fatal("no report after the writer closed")
			}
			require.False(t, rx.WriterConnected("gone-tx"))
			select {
			case a := <-gone:
				t.Fatalf("a second report for %s", a)
			case <-time.After(50 * time.Millisecond):
			}
			// The receiver closing ends its connections: that is no news of
			// the writer.
			tx2, err := New(Config{Agent: "gone-tx2", Transports: []Transport{tr}, Logger: quietLogger()})
			require.NoError(t, err)
			defer tx2.Close()
			_, err = tx2.Connect(context.Background(), rx.Descriptor())
			require.NoError(t, err)
			require.NoError(t, rx.Close())
			select {
			case a := <-gone:
				t.Fatalf("%s reported gone when the receiver closed", a)
			case <-time.After(100 * time.Millisecond):
			}
		})
	}
}

// A writer that lives is never reported gone: not when its only connection
// breaks on a cancelled write (it connects again before letting it go), not
// when the receiver fences a landing and cuts the connection, not when shm
// reconnects to map a region registered later.
func TestWriterGoneNotReportedForLiveWriter(t *testing.T) {
	for _, tr := range append([]Transport{TransportTCP, TransportSHM}, ucxTestTransports()...) {
		if tr == TransportSHM && !shmSupported {
			continue
		}
		t.Run(string(tr), func(t *testing.T) {
			const size = 32 << 20
			// ucx: a keepalive every 100 ms (20 s by default) makes the
			// receiver learn within the test that a connection of the
			// writer's went down.
			opts := map[string]string{"KEEPALIVE_INTERVAL": "100ms"}
			rx, err := New(Config{Agent: "live-rx", Transports: []Transport{tr}, Logger: quietLogger(), UCX: opts})
			require.NoError(t, err)
			defer rx.Close()
			gone := make(chan AgentID, 4)
			rx.OnWriterGone(func(a AgentID) { gone <- a })
			_, err = rx.Register("dst", size)
			require.NoError(t, err)
			tx, err := New(Config{Agent: "live-tx", Transports: []Transport{tr}, Logger: quietLogger(), TCPLanes: 1, UCX: opts})
			require.NoError(t, err)
			defer tx.Close()
			src, err := tx.Register("src", size)
			require.NoError(t, err)
			_, err = tx.Connect(context.Background(), rx.Descriptor())
			require.NoError(t, err)
			quiet := func(what string) {
				t.Helper()
				select {
				case a := <-gone:
					t.Fatalf("%s reported gone after %s", a, what)
				case <-time.After(150 * time.Millisecond):
				}
			}
			write := func(ctx context.Context, id uint64) (*Grant, error) {
				g, err := rx.OpenGrant(GrantSpec{RequestID: id, Extents: []Extent{{1, 0, size}}})
				require.NoError(t, err)
				_, err = tx.Write(ctx, rx.Descriptor(), g.Ticket(), []Extent{{src.ID(), 0, size}})
				return g, err
			}
			// A write cancelled while it sends.
			failed := ucxPeerErrors(rx)
			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(time.Millisecond, cancel)
			g, _ := write(ctx, 1)
			g.Revoke()
			if tr == TransportUCX {
				// The writer closed its endpoint by force to end its sends;
				// the receiver learns it when its endpoint back to the
				// writer fails (at the next keepalive), and must not take
				// that for the writer gone.
				for until := time.Now().Add(3 * time.Second); ucxPeerErrors(rx) == failed && time.Now().Before(until); {
					time.Sleep(time.Millisecond)
				}
				t.Logf("endpoint failures the receiver saw: %d", ucxPeerErrors(rx)-failed)
			}
			quiet("a cancelled write")
			// A landing fenced by the receiver.
			g, err = rx.OpenGrant(GrantSpec{RequestID: 2, Extents: []Extent{{1, 0, size}}})
			require.NoError(t, err)
			werr := make(chan error, 1)
			go func() {
				_, err := tx.Write(context.Background(), rx.Descriptor(), g.Ticket(), []Extent{{src.ID(), 0, size}})
				werr <- err
			}()
			time.Sleep(time.Millisecond)
			g.Revoke()
			<-werr
			quiet("a fenced landing")
			if tr == TransportSHM {
				// A region registered after the connection: shm maps it anew.
				_, err := rx.Register("later", 4096)
				require.NoError(t, err)
				g, err := rx.OpenGrant(GrantSpec{RequestID: 3, Extents: []Extent{{2, 0, 4096}}})
				require.NoError(t, err)
				_, err = tx.Write(context.Background(), rx.Descriptor(), g.Ticket(), []Extent{{src.ID(), 0, 4096}})
				require.NoError(t, err)
				quiet("a reconnect")
			}
			// And it still writes.
			_, err = write(context.Background(), 4)
			require.NoError(t, err)
			quiet("a good write")
		})
	}
}
