package crc32c

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCombine(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(rng.Uint32())
	}
	lens := []int{0, 1, 2, 3, 7, 8, 15, 16, 63, 64, 511, 512, 4096, 65537, 1 << 20}
	for range 200 {
		lens = append(lens, rng.IntN(len(buf)+1))
	}
	for _, n := range lens {
		cut := 0
		if n > 0 {
			cut = rng.IntN(n + 1)
		}
		a, b := buf[:cut], buf[cut:n]
		require.Equal(t, Checksum(buf[:n]), Combine(Checksum(a), Checksum(b), int64(len(b))), "len %d cut %d", n, cut)
		// And with a running crc in front, as Update continues one.
		pre := rng.Uint32()
		require.Equal(t, Update(pre, buf[:n]), Combine(Update(pre, a), Checksum(b), int64(len(b))), "len %d cut %d, prefixed", n, cut)
	}
	// Many pieces joined left to right.
	var crc uint32
	for off := 0; off < len(buf); {
		n := min(len(buf)-off, 1+rng.IntN(100<<10))
		crc = Combine(crc, Checksum(buf[off:off+n]), int64(n))
		off += n
	}
	require.Equal(t, Checksum(buf), crc)
}

func FuzzCombine(f *testing.F) {
	f.Add([]byte("hello, handoff"), uint8(5))
	f.Fuzz(func(t *testing.T, p []byte, cut uint8) {
		c := min(int(cut), len(p))
		if got, want := Combine(Checksum(p[:c]), Checksum(p[c:]), int64(len(p)-c)), Checksum(p); got != want {
			t.Fatalf("len %d cut %d: %#x, want %#x", len(p), c, got, want)
		}
	})
}

func BenchmarkCombine(b *testing.B) {
	for b.Loop() {
		Combine(0x12345678, 0x9abcdef0, 50<<20)
	}
}
