package rdma

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/handoff-io/handoff/internal/crc32c"
	"github.com/stretchr/testify/require"
)

// streamParts cuts every extent of xs into ranges of random lengths (at
// most max bytes) and shuffles them: the order in which a layer-wise writer
// fills a grant has nothing to do with the extents' order.
func streamParts(rng *rand.Rand, xs []Extent, max uint64) []Range {
	var rs []Range
	for i, x := range xs {
		for off := uint64(0); off < x.Length; {
			n := min(x.Length-off, 1+rng.Uint64N(max))
			rs = append(rs, Range{Ext: i, Offset: off, Length: n})
			off += n
		}
	}
	rng.Shuffle(len(rs), func(i, j int) { rs[i], rs[j] = rs[j], rs[i] })
	return rs
}

// srcFor returns the source extent holding the bytes that the whole-grant
// write of src would put in r (r must not span two source extents).
func srcFor(dst []Extent, src []Extent, r Range) Extent {
	xs := srcsFor(dst, src, r)
	if len(xs) != 1 {
		panic("range spans two source extents")
	}
	return xs[0]
}

// srcsFor returns the source extents holding the bytes that the
// whole-grant write of src would put in r.
func srcsFor(dst []Extent, src []Extent, r Range) []Extent {
	var at uint64 // r's offset in the concatenation of dst
	for _, x := range dst[:r.Ext] {
		at += x.Length
	}
	at += r.Offset
	var out []Extent
	for n := r.Length; n > 0; {
		for _, s := range src {
			if at < s.Length {
				k := min(n, s.Length-at)
				out = append(out, Extent{Region: s.Region, Offset: s.Offset + at, Length: k})
				n -= k
				at = 0
				if n == 0 {
					break
				}
				continue
			}
			if len(out) == 0 {
				at -= s.Length
			}
		}
	}
	return out
}

// oneSrc is a single source extent as long as the grant.
func oneSrc(n uint64) []Extent { return []Extent{{Region: 1, Offset: 333, Length: n}} }

// TestConformanceStreamWriteReadBack fills a grant in many writes of a
// few ranges each, in random order, and commits: the bytes and the
// manifest are those of one Write, on every transport.
func TestConformanceStreamWriteReadBack(t *testing.T) {
	forEachTransport(t, func(t *testing.T, p *pair) {
		ctx := context.Background()
		rng := rand.New(rand.NewPCG(5, 6))
		for round := range 3 {
			fillRegion(p.dst, canary)
			dst := dstExtents()
			g, err := p.rx.OpenGrant(GrantSpec{RequestID: uint64(round + 1), Extents: dst, Deadline: time.Now().Add(10 * time.Second)})
			require.NoError(t, err)
			tk := g.Ticket()
			src := oneSrc(tk.Bytes)
			s, err := p.tx.OpenStream(ctx, p.desc, tk)
			require.NoError(t, err)
			parts := streamParts(rng, dst, 9000)
			for len(parts) > 0 {
				k := min(len(parts), 1+rng.IntN(4))
				var srcs []Extent
				for _, r := range parts[:k] {
					srcs = append(srcs, srcFor(dst, src, r))
				}
				require.NoError(t, s.Write(ctx, parts[:k], srcs))
				if len(parts) > k {
					// Not everything is there: the commit is refused
					// locally, nothing is sent, and the stream goes on.
					_, err := s.Commit(ctx)
					require.ErrorIs(t, err, ErrOutOfRange)
				}
				parts = parts[k:]
				select {
				case <-g.Done():
					t.Fatal("grant done before the commit")
				default:
				}
			}
			require.Equal(t, tk.Bytes, s.Written())
			m, err := s.Commit(ctx)
			require.NoError(t, err)
			got, err := g.Wait(ctx)
			require.NoError(t, err)
			require.Equal(t, m, got)
			require.Equal(t, concat(p.src, src), concat(p.dst, dst))
			p.requireCanary(t, dst)
			for i := range dst {
				require.Equal(t, crc32c.Checksum(concat(p.dst, dst[i:i+1])), got.CRC[i])
			}
			// The stream is over, and the grant committed.
			_, err = s.Commit(ctx)
			require.ErrorIs(t, err, ErrCommitted)
			require.ErrorIs(t, s.Write(ctx, []Range{{Ext: 0, Offset: 0, Length: 1}}, []Extent{{Region: 1, Offset: 0, Length: 1}}), ErrCommitted)
		}
	})
}

// TestConformanceStreamRefusesBadRanges: a range outside its extent, one
// written before, overlapping ranges of one call and a length mismatch are
// the caller's mistakes: refused before anything is sent.
func TestConformanceStreamRefusesBadRanges(t *testing.T) {
	forEachTransport(t, func(t *testing.T, p *pair) {
		ctx := context.Background()
		dst := dstExtents()
		g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dst})
		require.NoError(t, err)
		s, err := p.tx.OpenStream(ctx, p.desc, g.Ticket())
		require.NoError(t, err)
		one := func(n uint64) []Extent { return []Extent{{Region: 1, Offset: 0, Length: n}} }
		for name, c := range map[string]struct {
			r   []Range
			src []Extent
		}{
			"extent index":  {[]Range{{Ext: 4, Offset: 0, Length: 1}}, one(1)},
			"past the end":  {[]Range{{Ext: 1, Offset: 0, Length: 2}}, one(2)},
			"empty":         {[]Range{{Ext: 0, Offset: 0, Length: 0}}, nil},
			"overlap":       {[]Range{{Ext: 0, Offset: 0, Length: 10}, {Ext: 0, Offset: 9, Length: 2}}, one(12)},
			"overlap later": {[]Range{{Ext: 0, Offset: 20, Length: 5}, {Ext: 1, Offset: 0, Length: 1}, {Ext: 0, Offset: 0, Length: 21}}, one(27)},
			"short source":  {[]Range{{Ext: 0, Offset: 0, Length: 10}}, one(9)},
			"long source":   {[]Range{{Ext: 0, Offset: 0, Length: 10}}, one(11)},
			"unknown local": {[]Range{{Ext: 0, Offset: 0, Length: 10}}, []Extent{{Region: 9, Offset: 0, Length: 10}}},
		} {
			require.ErrorIs(t, s.Write(ctx, c.r, c.src), ErrOutOfRange, name)
			require.NoError(t, s.Err(), "%s: a refused write ended the stream", name)
		}
		require.NoError(t, s.Write(ctx, []Range{{Ext: 0, Offset: 100, Length: 50}}, one(50)))
		require.ErrorIs(t, s.Write(ctx, []Range{{Ext: 0, Offset: 149, Length: 2}}, one(2)), ErrOutOfRange, "rewrite")
		require.ErrorIs(t, s.Write(ctx, []Range{{Ext: 0, Offset: 60, Length: 41}}, one(41)), ErrOutOfRange, "rewrite")
		require.NoError(t, s.Write(ctx, []Range{{Ext: 0, Offset: 60, Length: 40}, {Ext: 0, Offset: 150, Length: 1}}, one(41)))
		require.Equal(t, uint64(91), s.Written())
		require.NoError(t, s.Err())
		select {
		case <-g.Failed():
			t.Fatal("a refused range failed the grant")
		default:
		}
		g.Revoke()
	})
}

// TestConformanceStreamRevoke revokes a grant between two writes of a
// stream: no byte of a later write lands, the writes and the commit are
// refused with the receiver's reason, on every transport.
func TestConformanceStreamRevoke(t *testing.T) {
	forEachTransport(t, func(t *testing.T, p *pair) {
		ctx := context.Background()
		dst := dstExtents()
		g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dst})
		require.NoError(t, err)
		tk := g.Ticket()
		src := oneSrc(tk.Bytes)
		s, err := p.tx.OpenStream(ctx, p.desc, tk)
		require.NoError(t, err)
		parts := streamParts(rand.New(rand.NewPCG(7, 8)), dst, 4000)
		half := len(parts) / 2
		for _, r := range parts[:half] {
			require.NoError(t, s.Write(ctx, []Range{r}, []Extent{srcFor(dst, src, r)}))
		}
		g.Revoke()
		snap := regionBytes(p.dst)
		err = s.Write(ctx, parts[half:half+1], []Extent{srcFor(dst, src, parts[half])})
		require.Error(t, err)
		require.True(t, errors.Is(err, ErrRevoked) || errors.Is(err, ErrStaleEpoch), "%v", err)
		// Sticky: the stream is over.
		require.ErrorIs(t, s.Err(), err)
		require.ErrorIs(t, s.Write(ctx, parts[half+1:half+2], []Extent{srcFor(dst, src, parts[half+1])}), err)
		_, cerr := s.Commit(ctx)
		require.Error(t, cerr)
		_, werr := g.Wait(ctx)
		require.ErrorIs(t, werr, ErrRevoked)
		time.Sleep(time.Millisecond)
		require.Equal(t, snap, regionBytes(p.dst), "bytes landed after Revoke returned")
		p.requireCanary(t, dst)
	})
}

// TestConformanceStreamRevokeRaces revokes at random moments while a
// writer streams layer after layer: once Revoke returned the destination
// never changes again, and the two sides agree on the outcome.
func TestConformanceStreamRevokeRaces(t *testing.T) {
	forEachTransportHeavy(t, func(t *testing.T, p *pair) {
		ctx := context.Background()
		rng := rand.New(rand.NewPCG(9, 10))
		const size = 256 << 10
		dst := []Extent{{Region: 1, Offset: 4096, Length: size / 2}, {Region: 1, Offset: 300000, Length: size / 2}}
		committed, revoked := 0, 0
		for i := range 20 {
			fillRegion(p.dst, canary)
			g, err := p.rx.OpenGrant(GrantSpec{RequestID: uint64(i + 1), Extents: dst})
			require.NoError(t, err)
			tk := g.Ticket()
			src := oneSrc(tk.Bytes)
			parts := streamParts(rng, dst, 16<<10)
			werr := make(chan error, 1)
			go func() {
				s, err := p.tx.OpenStream(ctx, p.desc, tk)
				for _, r := range parts {
					if err != nil {
						break
					}
					err = s.Write(ctx, []Range{r}, []Extent{srcFor(dst, src, r)})
				}
				if err == nil {
					_, err = s.Commit(ctx)
				}
				werr <- err
			}()
			time.Sleep(time.Duration(rng.IntN(600)) * time.Microsecond)
			g.Revoke()
			snap := regionBytes(p.dst)
			err = <-werr
			time.Sleep(time.Millisecond)
			require.Equal(t, snap, regionBytes(p.dst), "bytes landed after Revoke returned (round %d)", i)
			p.requireCanary(t, dst)
			if _, gerr := g.Wait(ctx); gerr == nil {
				committed++
				require.NoError(t, err, "receiver committed, writer must agree")
			} else {
				revoked++
				require.Error(t, err, "receiver revoked, writer must not report success")
			}
		}
		t.Logf("%s: %d committed, %d revoked", p.t, committed, revoked)
	})
}

// TestConformanceStreamConcurrentCallers: one stream's Write may be called
// from several goroutines (they run one at a time), and the commit joins
// what they wrote.
func TestConformanceStreamConcurrentCallers(t *testing.T) {
	forEachTransport(t, func(t *testing.T, p *pair) {
		ctx := context.Background()
		dst := dstExtents()
		g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dst})
		require.NoError(t, err)
		tk := g.Ticket()
		src := oneSrc(tk.Bytes)
		s, err := p.tx.OpenStream(ctx, p.desc, tk)
		require.NoError(t, err)
		parts := streamParts(rand.New(rand.NewPCG(11, 12)), dst, 3000)
		var wg sync.WaitGroup
		for w := range 4 {
			wg.Go(func() {
				for i := w; i < len(parts); i += 4 {
					require.NoError(t, s.Write(ctx, parts[i:i+1], []Extent{srcFor(dst, src, parts[i])}))
				}
			})
		}
		wg.Wait()
		_, err = s.Commit(ctx)
		require.NoError(t, err)
		_, err = g.Wait(ctx)
		require.NoError(t, err)
		require.Equal(t, concat(p.src, src), concat(p.dst, dst))
	})
}

// TestStreamStripedTCP streams parts large enough to be striped over
// several tcp connections (each lane ends with a flush), and checks that
// the receiver kept the sums of the many out-of-order landings (no second
// pass at commit) and the writer joined its own.
func TestStreamStripedTCP(t *testing.T) {
	for _, skip := range []bool{false, true} {
		t.Run(fmt.Sprintf("skipcrc=%v", skip), func(t *testing.T) { testStreamStriped(t, skip) })
	}
}

func testStreamStriped(t *testing.T, skip bool) {
	{
		rx, err := New(Config{Agent: "rx-striped", Transports: []Transport{TransportTCP}, Logger: quietLogger(), SkipCRC: skip})
		require.NoError(t, err)
		defer rx.Close()
		tx, err := New(Config{Agent: "tx-striped", Transports: []Transport{TransportTCP}, Logger: quietLogger(), SkipCRC: skip})
		require.NoError(t, err)
		defer tx.Close()
		const size = 24 << 20
		dr, err := rx.Register("dst", size)
		require.NoError(t, err)
		sr, err := tx.Register("src", size)
		require.NoError(t, err)
		rng := rand.New(rand.NewPCG(13, 14))
		for i := range sr.Bytes() {
			sr.Bytes()[i] = byte(rng.Uint32())
		}
		// A run of 16 blocks of 4 layers: one extent, streamed layer by
		// layer, each layer a strided set of pieces (block-major arena).
		const blocks, layers, chunk = 16, 4, 128 << 10
		dst := []Extent{{Region: 1, Offset: 1 << 20, Length: blocks * layers * chunk}, {Region: 1, Offset: 16 << 20, Length: 3 << 20}}
		g, err := rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dst})
		require.NoError(t, err)
		ctx := context.Background()
		s, err := tx.OpenStream(ctx, rx.Descriptor(), g.Ticket())
		require.NoError(t, err)
		for l := range layers {
			var rs []Range
			var src []Extent
			for b := range blocks {
				off := uint64((b*layers + l) * chunk)
				rs = append(rs, Range{Ext: 0, Offset: off, Length: chunk})
				src = append(src, Extent{Region: 1, Offset: dst[0].Offset + off, Length: chunk})
			}
			require.NoError(t, s.Write(ctx, rs, src))
		}
		require.NoError(t, s.Write(ctx, []Range{{Ext: 1, Offset: 0, Length: 3 << 20}}, []Extent{{Region: 1, Offset: 16 << 20, Length: 3 << 20}}))
		if !skip {
			g.mu.Lock()
			_, tiled := g.ext[0].crcOf(dst[0].Length)
			g.mu.Unlock()
			require.True(t, tiled, "the receiver summed every landing as it came")
		}
		m, err := s.Commit(ctx)
		require.NoError(t, err)
		_, err = g.Wait(ctx)
		require.NoError(t, err)
		for i, x := range dst {
			require.Equal(t, sr.Bytes()[x.Offset:x.Offset+x.Length], dr.Bytes()[x.Offset:x.Offset+x.Length])
			if !skip {
				require.Equal(t, crc32c.Checksum(dr.Bytes()[x.Offset:x.Offset+x.Length]), m.CRC[i])
			}
		}
	}
}

// TestConformanceStreamWriteRest writes some ranges, then the rest from
// the whole-grant sources, and commits: the result is Engine.Write's.
func TestConformanceStreamWriteRest(t *testing.T) {
	forEachTransport(t, func(t *testing.T, p *pair) {
		ctx := context.Background()
		rng := rand.New(rand.NewPCG(15, 16))
		for round := range 3 {
			fillRegion(p.dst, canary)
			dst := dstExtents()
			g, err := p.rx.OpenGrant(GrantSpec{RequestID: uint64(round + 1), Extents: dst})
			require.NoError(t, err)
			tk := g.Ticket()
			src := srcExtents(tk.Bytes) // boundaries unlike the destination's
			s, err := p.tx.OpenStream(ctx, p.desc, tk)
			require.NoError(t, err)
			parts := streamParts(rng, dst, 7000)
			for _, r := range parts[:round*len(parts)/3] {
				// Early parts from the same bytes, at the same places.
				require.NoError(t, s.Write(ctx, []Range{r}, srcsFor(dst, src, r)))
			}
			require.ErrorIs(t, s.WriteRest(ctx, src[:1]), ErrOutOfRange, "sources shorter than the ticket")
			require.NoError(t, s.WriteRest(ctx, src))
			require.Equal(t, tk.Bytes, s.Written())
			require.NoError(t, s.WriteRest(ctx, src), "nothing left to write")
			m, err := s.Commit(ctx)
			require.NoError(t, err)
			got, err := g.Wait(ctx)
			require.NoError(t, err)
			require.Equal(t, m, got)
			require.Equal(t, concat(p.src, src), concat(p.dst, dst))
			p.requireCanary(t, dst)
		}
	})
}
