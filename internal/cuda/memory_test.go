//go:build linux && (amd64 || arm64)

package cuda_test

import (
	"errors"
	"testing"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
)

func TestParseMemory(t *testing.T) {
	for in, want := range map[string]cuda.Memory{"": cuda.MemoryHost, "host": cuda.MemoryHost, " CUDA ": cuda.MemoryCUDA} {
		if got, err := cuda.ParseMemory(in); err != nil || got != want {
			t.Errorf("ParseMemory(%q) = %q, %v", in, got, err)
		}
	}
	if _, err := cuda.ParseMemory("gpu"); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("ParseMemory(gpu): %v", err)
	}
}

func TestOpenMemory(t *testing.T) {
	loaded := false
	open := func() (cuda.Driver, error) { loaded = true; return cudafake.New(cudafake.Config{Devices: 2}), nil }
	d, err := cuda.OpenMemory(cuda.MemoryHost, "1", open)
	if err != nil || d != nil || loaded {
		t.Fatalf("host memory: %v, %v, driver loaded %v", d, err, loaded)
	}
	d, err = cuda.OpenMemory(cuda.MemoryCUDA, "1", open)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d.Ordinal() != 1 {
		t.Errorf("ordinal %d", d.Ordinal())
	}
	noDriver := func() (cuda.Driver, error) { return cuda.Load("/nonexistent/libcuda.so.1") }
	if _, err := cuda.OpenMemory(cuda.MemoryCUDA, "0", noDriver); !errors.Is(err, cuda.ErrNoDriver) {
		t.Errorf("cuda without a driver: %v, want ErrNoDriver", err)
	}
	stub := func() (cuda.Driver, error) { return cudafake.New(cudafake.Config{Stub: true}), nil }
	if _, err := cuda.OpenMemory(cuda.MemoryCUDA, "0", stub); !errors.Is(err, cuda.ErrStubLibrary) {
		t.Errorf("cuda on the stub: %v, want ErrStubLibrary", err)
	}
}
