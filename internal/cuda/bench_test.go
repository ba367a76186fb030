//go:build linux && (amd64 || arm64)

package cuda_test

import (
	"context"
	"testing"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
)

// BenchmarkDo is the executor hand-off: one call queued to the locked
// thread and answered.
func BenchmarkDo(b *testing.B) {
	d, err := cuda.OpenDevice(cudafake.New(cudafake.Config{}), "0")
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	b.ReportAllocs()
	for b.Loop() {
		_ = d.Do(func(cuda.Driver) error { return nil })
	}
}

// BenchmarkCopyChunked is the per-chunk overhead of a fenced DtoD copy over
// the fake (64 KiB chunks, so the executor's work dominates the memcpy).
func BenchmarkCopyChunked(b *testing.B) {
	d, err := cuda.OpenDevice(cudafake.New(cudafake.Config{}), "0")
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	const n, chunk = 4 << 20, 64 << 10
	p, _ := d.Alloc(n)
	q, _ := d.Alloc(n)
	defer d.Free(p) //nolint:errcheck
	defer d.Free(q) //nolint:errcheck
	b.SetBytes(n)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := d.CopyChunked(context.Background(), q, p, n, chunk, &countBracket{allow: 1 << 30}); err != nil {
			b.Fatal(err)
		}
	}
}
