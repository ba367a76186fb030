//go:build linux && (amd64 || arm64)

package cuda_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
)

// A worker opens device memory only when asked (--memory cuda), by ordinal
// or UUID, and keeps each pool's arena as one device allocation.
func Example() {
	// In production: cuda.OpenMemory(mem, "0", cuda.Open).
	open := func() (cuda.Driver, error) { return cudafake.New(cudafake.Config{}), nil }
	d, err := cuda.OpenMemory(cuda.MemoryCUDA, "0", open)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer d.Close()

	arena, _ := d.NewArena(1 << 20)
	defer arena.Free()
	_, _ = arena.WriteAt([]byte("mamba row 3"), 3*4096)

	// A fenced device-to-device copy, as a cuda-ipc writer would do into a
	// peer's imported arena.
	dst, _ := d.Alloc(1 << 20)
	defer d.Free(dst)
	n, err := d.CopyChunked(context.Background(), dst, arena.Ptr(), 1<<20, 256<<10, nil)
	fmt.Println(n, err)

	row := make([]byte, 11)
	_ = d.CopyFromDevice(row, dst+3*4096)
	fmt.Printf("%s\n", row)

	// No driver: the error says so by name.
	_, err = cuda.OpenMemory(cuda.MemoryCUDA, "0", func() (cuda.Driver, error) { return cuda.Load("/nonexistent/libcuda.so.1") })
	fmt.Println(errors.Is(err, cuda.ErrNoDriver))
	// Output:
	// 1048576 <nil>
	// mamba row 3
	// true
}
