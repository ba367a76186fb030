package rdma

import (
	"context"
	"fmt"
	"testing"
)

// Data path benchmarks. Each op moves benchTotal bytes as extents of the
// given size, laid out with gaps so nothing coalesces: BenchmarkMemcpy is
// the same copy done with copy(), the baseline the transports are compared
// with. Each BenchmarkWrite op opens a grant, writes and commits it, and
// waits for the receiver's verdict, so the figure includes the crc32c on
// both sides and the commit round trip.
//
//	go test -run '^$' -bench 'Memcpy|Write' -benchtime 2s ./rdma
const (
	benchTotal = 8 << 20
	benchGap   = 512
)

var benchSizes = []int{4 << 10, 1 << 20}

func benchLayout(size int) (exts []Extent, regionLen int64) {
	n := benchTotal / size
	stride := uint64(size + benchGap)
	for i := range n {
		exts = append(exts, Extent{Region: 1, Offset: uint64(i) * stride, Length: uint64(size)})
	}
	return exts, int64(uint64(n) * stride)
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return fmt.Sprintf("%dMiB", n>>20)
	}
	return fmt.Sprintf("%dKiB", n>>10)
}

func BenchmarkMemcpy(b *testing.B) {
	for _, size := range benchSizes {
		b.Run(sizeName(size), func(b *testing.B) {
			exts, n := benchLayout(size)
			src, dst := make([]byte, n), make([]byte, n)
			for i := range src { // real pages, not the shared zero page
				src[i], dst[i] = byte(i*7), 1
			}
			b.SetBytes(benchTotal)
			b.ReportAllocs()
			for b.Loop() {
				for _, x := range exts {
					copy(dst[x.Offset:x.Offset+x.Length], src[x.Offset:x.Offset+x.Length])
				}
			}
		})
	}
}

func BenchmarkWrite(b *testing.B) { benchWrite(b, false) }

// BenchmarkWriteNoCRC is BenchmarkWrite with SkipCRC on both sides: what the
// end-to-end crc32c costs.
func BenchmarkWriteNoCRC(b *testing.B) { benchWrite(b, true) }

func benchWrite(b *testing.B, skipCRC bool) {
	for _, tr := range testTransports() {
		for _, size := range benchSizes {
			b.Run(string(tr)+"/"+sizeName(size), func(b *testing.B) {
				exts, n := benchLayout(size)
				rx, err := New(Config{Agent: "bench-rx", Transports: []Transport{tr}, Logger: quietLogger(), SkipCRC: skipCRC})
				if err != nil {
					b.Fatal(err)
				}
				defer rx.Close()
				tx, err := New(Config{Agent: "bench-tx", Transports: []Transport{tr}, Logger: quietLogger(), SkipCRC: skipCRC})
				if err != nil {
					b.Fatal(err)
				}
				defer tx.Close()
				if _, err := rx.Register("dst", n); err != nil {
					b.Fatal(err)
				}
				src, err := tx.Register("src", n)
				if err != nil {
					b.Fatal(err)
				}
				for i := range src.Bytes() {
					src.Bytes()[i] = byte(i * 7)
				}
				desc := rx.Descriptor()
				ctx := context.Background()
				if _, err := tx.Connect(ctx, desc); err != nil {
					b.Fatal(err)
				}
				spec := GrantSpec{Extents: exts}
				b.SetBytes(benchTotal)
				b.ReportAllocs()
				b.ReportMetric(float64(len(exts)), "extents/op")
				for b.Loop() {
					spec.RequestID++
					g, err := rx.OpenGrant(spec)
					if err != nil {
						b.Fatal(err)
					}
					if _, err := tx.Write(ctx, desc, g.Ticket(), exts); err != nil {
						b.Fatal(err)
					}
					if _, err := g.Wait(ctx); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
