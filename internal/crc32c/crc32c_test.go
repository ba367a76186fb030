package crc32c

import (
	"bytes"
	"hash/crc32"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

func reference(crc uint32, p []byte) uint32 { return crc32.Update(crc, table, p) }

// kernel is one folding implementation; use selects it until its result
// is called.
type kernel struct {
	name string
	use  func() (restore func())
}

// eachKernel runs f with every folding kernel this core has (none: f is not
// run; Update is hash/crc32 there and the other tests cover it).
func eachKernel(t *testing.T, f func(t *testing.T)) {
	for _, k := range kernels() {
		t.Run(k.name, func(t *testing.T) {
			defer k.use()()
			f(t)
		})
	}
}

func TestFoldKeys(t *testing.T) {
	// x^(8·16±32) for a 16-byte fold, as published for CRC-32C folding.
	require.Equal(t, [2]uint64{0xf20c0dfe, 0x14cd00bd6}, foldKeys(16))
	t.Logf("kernels on this core: %v", kernels())
}

func TestFoldKernels(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	buf := make([]byte, 4*foldBytes+64)
	for i := range buf {
		buf[i] = byte(rng.Uint32())
	}
	eachKernel(t, func(t *testing.T) {
		dst := make([]byte, len(buf)+64)
		for n := 256; n <= len(buf)-64; n++ {
			off := n % 64
			p := buf[off : off+n]
			crc := rng.Uint32()
			want := reference(crc, p)
			require.Equal(t, want, updateFold(crc, p), "len %d", n)
			for i := range dst {
				dst[i] = 0xA5
			}
			do := (n * 3) % 64
			require.Equal(t, want, copyUpdateFold(crc, dst[do:do+n+1], p), "copy, len %d", n)
			require.Equal(t, p, dst[do:do+n], "copy, len %d: bytes", n)
			require.Equal(t, byte(0xA5), dst[do+n], "copy, len %d: byte after", n)
			if do > 0 {
				require.Equal(t, byte(0xA5), dst[do-1], "copy, len %d: byte before", n)
			}
		}
		big := make([]byte, 5<<20+7)
		for i := range big {
			big[i] = byte(rng.Uint32())
		}
		require.Equal(t, reference(0, big), Update(0, big))
		out := make([]byte, len(big))
		require.Equal(t, reference(0, big), CopyUpdate(0, out, big))
		require.Equal(t, big, out)
	})
}

func TestUpdateMatchesHashCRC32(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 3*foldBytes*4+64)
	for i := range buf {
		buf[i] = byte(rng.Uint32())
	}
	// Every length around the thresholds, at every alignment of a cache line.
	for n := 0; n <= len(buf)-64; n++ {
		off := n % 64
		p := buf[off : off+n]
		crc := rng.Uint32()
		want := reference(crc, p)
		require.Equal(t, want, Update(crc, p), "len %d offset %d", n, off)
		if haveFold && n >= foldBytes {
			require.Equal(t, want, updateFold(crc, p), "folded, len %d", n)
		}
	}
}

func TestUpdateLongAndStreamed(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	p := make([]byte, 8<<20+13)
	for i := range p {
		p[i] = byte(rng.Uint32())
	}
	want := reference(0, p)
	require.Equal(t, want, Checksum(p))
	// Streamed in uneven pieces, as a writer sums a frame's batches.
	var c uint32
	for rest := p; len(rest) > 0; {
		n := min(len(rest), 1+rng.IntN(300<<10))
		c = Update(c, rest[:n])
		rest = rest[n:]
	}
	require.Equal(t, want, c)
	require.Equal(t, uint32(0xe3069283), Checksum([]byte("123456789")))
}

func TestCopyUpdate(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	src := make([]byte, 5*foldBytes+128)
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	dst := make([]byte, len(src)+64)
	for n := 0; n <= len(src)-64; n++ {
		so, do := n%64, (n*7)%64
		p := src[so : so+n]
		for i := range dst {
			dst[i] = 0xA5
		}
		crc := rng.Uint32()
		require.Equal(t, reference(crc, p), CopyUpdate(crc, dst[do:do+n+1], p), "len %d", n)
		require.Equal(t, p, dst[do:do+n], "len %d: copied bytes", n)
		for i, b := range dst {
			if (i < do || i >= do+n) && b != 0xA5 {
				t.Fatalf("len %d: byte %d outside the copy changed", n, i)
			}
		}
		if haveFold && n >= foldBytes { // the fused assembly, below fuseMin too
			for i := range dst {
				dst[i] = 0xA5
			}
			require.Equal(t, reference(crc, p), copyUpdateFold(crc, dst[do:do+n+1], p), "fused, len %d", n)
			require.Equal(t, p, dst[do:do+n], "fused, len %d: copied bytes", n)
			require.Equal(t, byte(0xA5), dst[do+n], "fused, len %d: byte after the copy", n)
		}
	}
	// Long copies, at odd offsets.
	big := make([]byte, 3<<20)
	for i := range big {
		big[i] = byte(rng.Uint32())
	}
	out := make([]byte, len(big)+64)
	for _, n := range []int{fuseMin, fuseMin + 1, 1 << 20, 3<<20 - 3} {
		p := big[3 : 3+n-3]
		require.Equal(t, reference(9, p), CopyUpdate(9, out[5:], p), "len %d", len(p))
		require.Equal(t, p, out[5:5+len(p)])
	}
	require.Panics(t, func() { CopyUpdate(0, make([]byte, 3), make([]byte, 4)) })
}

func TestUpdateAllocatesNothing(t *testing.T) {
	p := make([]byte, 64<<10)
	require.Zero(t, testing.AllocsPerRun(100, func() { Update(1, p) }))
	d := make([]byte, len(p))
	require.Zero(t, testing.AllocsPerRun(100, func() { CopyUpdate(1, d, p) }))
}

func FuzzUpdate(f *testing.F) {
	f.Add(uint32(0), make([]byte, 2*foldBytes))
	f.Add(uint32(0xdeadbeef), make([]byte, 5000))
	f.Fuzz(func(t *testing.T, crc uint32, p []byte) {
		if got, want := Update(crc, p), reference(crc, p); got != want {
			t.Fatalf("len %d: %#x, want %#x", len(p), got, want)
		}
		if haveFold && len(p) >= foldBytes {
			if got, want := updateFold(crc, p), reference(crc, p); got != want {
				t.Fatalf("folded, len %d: %#x, want %#x", len(p), got, want)
			}
		}
		d := make([]byte, len(p))
		if got, want := CopyUpdate(crc, d, p), reference(crc, p); got != want || !bytes.Equal(d, p) {
			t.Fatalf("CopyUpdate, len %d: %#x, want %#x (copy equal: %v)", len(p), got, want, bytes.Equal(d, p))
		}
		for _, k := range kernels() {
			restore := k.use()
			d := make([]byte, len(p))
			got, gotCopy, want := updateFold(crc, p), copyUpdateFold(crc, d, p), reference(crc, p)
			restore()
			if got != want || gotCopy != want || !bytes.Equal(d, p) {
				t.Fatalf("%s, len %d: %#x and %#x, want %#x (copy equal: %v)", k.name, len(p), got, gotCopy, want, bytes.Equal(d, p))
			}
		}
	})
}

func benchmark(b *testing.B, n int, f func(uint32, []byte) uint32) {
	p := make([]byte, n)
	b.SetBytes(int64(n))
	for b.Loop() {
		f(0, p)
	}
}

// BenchmarkCopyUpdate copies 8 MiB in 4 or 64 KiB chunks into a 32 MiB
// destination (two slots in turn, larger than most L2s) and sums it: in one
// pass, and as a copy then a sum of the destination chunk.
func BenchmarkCopyUpdate(b *testing.B) {
	for _, chunk := range []int{4 << 10, 64 << 10} {
		b.Run(sizeName(chunk), func(b *testing.B) { benchmarkCopyUpdate(b, chunk) })
	}
}

func benchmarkCopyUpdate(b *testing.B, chunk int) {
	const total = 8 << 20
	src, dst := make([]byte, total), make([]byte, 4*total)
	for i := range src {
		src[i] = byte(i)
	}
	for _, tc := range []struct {
		name string
		f    func(crc uint32, d, s []byte) uint32
	}{
		{"copy", func(crc uint32, d, s []byte) uint32 { copy(d, s); return crc }},
		{"fused", CopyUpdate},
		{"copy-then-sum", func(crc uint32, d, s []byte) uint32 { copy(d, s); return Update(crc, d) }},
		{"copy-then-sse42", func(crc uint32, d, s []byte) uint32 { copy(d, s); return reference(crc, d) }},
	} {
		b.Run(tc.name, func(b *testing.B) {
			b.SetBytes(total)
			slot := 0
			for b.Loop() {
				base := slot % 4 * total
				slot++
				var crc uint32
				for o := 0; o < total; o += chunk {
					crc = tc.f(crc, dst[base+o:base+o+chunk], src[o:o+chunk])
				}
			}
		})
	}
}

func BenchmarkUpdate(b *testing.B) {
	for _, n := range []int{4 << 10, 64 << 10, 1 << 20, 64 << 20} {
		b.Run(sizeName(n)+"/crc32c", func(b *testing.B) { benchmark(b, n, Update) })
		b.Run(sizeName(n)+"/hash-crc32", func(b *testing.B) { benchmark(b, n, reference) })
	}
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return itoa(n>>20) + "MiB"
	default:
		return itoa(n>>10) + "KiB"
	}
}

func itoa(n int) string {
	if n < 10 {
		return string(rune('0' + n))
	}
	return itoa(n/10) + string(rune('0'+n%10))
}

// BenchmarkKernels compares the folding kernels this core has: a sum in
// cache (64 KiB) and from memory (64 MiB), and a fused copy in 64 KiB chunks.
func BenchmarkKernels(b *testing.B) {
	for _, k := range kernels() {
		b.Run(k.name, func(b *testing.B) {
			defer k.use()()
			for _, n := range []int{64 << 10, 64 << 20} {
				b.Run("sum/"+sizeName(n), func(b *testing.B) { benchmark(b, n, Update) })
			}
			b.Run("copy/64KiB", func(b *testing.B) { benchmarkCopyUpdate(b, 64<<10) })
		})
	}
}
