package rdma

import (
	"math/rand/v2"
	"testing"
	"testing/synctest"
	"time"

	"github.com/handoff-io/handoff/internal/crc32c"
	"github.com/stretchr/testify/require"
)

// land lands src at off of extent 0 of g the way a connection does:
// beginLand, fill in chunks, endLand.
func land(t *testing.T, g *Grant, off uint64, src []byte, ok bool) {
	t.Helper()
	tk := g.Ticket()
	ld, err := g.beginLand(tk.Epoch, &tk.Token, 0, off, uint64(len(src)), nil)
	require.NoError(t, err)
	for s := 0; s < len(src); s += 1000 {
		e := min(s+1000, len(src))
		copy(ld.dst[s:e], src[s:e])
		ld.fill(ld.dst[s:e])
	}
	g.endLand(&ld, ok, nil)
}

// The receiver's crc of an extent from in-order landings and segments:
// whenever the landings tile the extent exactly, it equals the sum of the
// bytes without reading them again; otherwise the commit must sum them.
func TestExtentSegments(t *testing.T) {
	const n = 64 << 10
	src := make([]byte, n)
	rng := rand.New(rand.NewPCG(13, 14))
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	type ld struct {
		off, end int
		ok       bool
	}
	for _, tc := range []struct {
		name   string
		lands  []ld
		tiled  bool
		landed int
	}{
		{"in order", []ld{{0, n / 2, true}, {n / 2, n, true}}, true, n},
		{"second half first", []ld{{n / 2, n, true}, {0, n / 2, true}}, true, n},
		{"four lanes, reversed", []ld{{3 * n / 4, n, true}, {n / 2, 3 * n / 4, true}, {n / 4, n / 2, true}, {0, n / 4, true}}, true, n},
		{"segments only, no prefix", []ld{{n / 2, n, true}, {1, n / 2, true}, {0, 1, true}}, true, n},
		{"gap", []ld{{0, n / 4, true}, {n / 2, n, true}}, false, 3 * n / 4},
		{"overlap", []ld{{0, n / 2, true}, {n / 4, n, true}}, false, n + n/4},
		{"failed segment", []ld{{n / 2, n, false}, {0, n / 2, true}, {n / 2, n, true}}, false, n},
		{"failed in-order landing", []ld{{0, n / 2, false}, {0, n / 2, true}, {n / 2, n, true}}, false, n},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPair(t, TransportInproc)
			g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{Region: 1, Offset: 0, Length: n}}, Deadline: time.Now().Add(time.Minute)})
			require.NoError(t, err)
			for _, l := range tc.lands {
				land(t, g, uint64(l.off), src[l.off:l.end], l.ok)
			}
			g.mu.Lock()
			st := &g.ext[0]
			crc, tiled := st.crcOf(n)
			landed := st.landed
			g.mu.Unlock()
			require.Equal(t, tc.tiled, tiled)
			require.Equal(t, uint64(tc.landed), landed)
			if tiled {
				require.Equal(t, crc32c.Checksum(src), crc)
			}
			// The commit agrees with the bytes either way, and refuses a
			// wrong manifest.
			bad := Manifest{Bytes: []uint64{n}, CRC: []uint32{crc32c.Checksum(src) ^ 1}}
			tk := g.Ticket()
			err = g.commit(tk.Epoch, &tk.Token, &bad, true, true)
			require.ErrorIs(t, err, ErrManifestMismatch)
		})
	}
	// A correct manifest over segments commits, without a second look.
	p := newPair(t, TransportInproc)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 2, Extents: []Extent{{Region: 1, Offset: 0, Length: n}}, Deadline: time.Now().Add(time.Minute)})
	require.NoError(t, err)
	land(t, g, n/3, src[n/3:], true)
	land(t, g, 0, src[:n/3], true)
	tk := g.Ticket()
	require.NoError(t, g.commit(tk.Epoch, &tk.Token, &Manifest{Bytes: []uint64{n}, CRC: []uint32{crc32c.Checksum(src)}}, true, true))
}

// More segments than an extent keeps: the commit sums the extent instead.
func TestExtentTooManySegments(t *testing.T) {
	const n = 2 * maxSegments * 16
	src := make([]byte, n)
	for i := range src {
		src[i] = byte(i * 31)
	}
	p := newPair(t, TransportInproc)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{Region: 1, Offset: 0, Length: n}}, Deadline: time.Now().Add(time.Minute)})
	require.NoError(t, err)
	for off := n - 16; off >= 0; off -= 16 { // every landing away from the in-order crc
		land(t, g, uint64(off), src[off:off+16], true)
	}
	g.mu.Lock()
	_, tiled := g.ext[0].crcOf(n)
	g.mu.Unlock()
	require.False(t, tiled)
	tk := g.Ticket()
	require.NoError(t, g.commit(tk.Epoch, &tk.Token, &Manifest{Bytes: []uint64{n}, CRC: []uint32{crc32c.Checksum(src)}}, true, true))
}

// TestSettledGrantIsCounted: once Revoke returns or Done closes, Stats
// counts the grant as settled, also when the deadline timer settles it at the
// same moment as the Revoke (a second terminate waits on the first's end).
func TestSettledGrantIsCounted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, err := New(Config{Agent: "rx", Transports: []Transport{TransportInproc}, Logger: quietLogger()})
		require.NoError(t, err)
		defer e.Close()
		r, err := e.Register("dst", 4096)
		require.NoError(t, err)
		for i := range 200 {
			g, err := e.OpenGrant(GrantSpec{RequestID: uint64(i + 1), Extents: []Extent{{Region: r.ID(), Length: 64}},
				Deadline: time.Now().Add(time.Second)})
			require.NoError(t, err)
			seen := make(chan Stats, 1)
			go func() { <-g.Done(); seen <- e.Stats() }()
			time.Sleep(time.Second) // the deadline timer fires now too
			g.Revoke()
			require.Zero(t, e.Stats().GrantsOpen, "round %d: Revoke returned", i)
			require.Zero(t, (<-seen).GrantsOpen, "round %d: Done closed", i)
		}
	})
}
