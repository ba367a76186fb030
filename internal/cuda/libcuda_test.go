//go:build linux && (amd64 || arm64)

package cuda_test

import (
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
	"github.com/handoff-io/handoff/internal/cuda/cudatest"
)

// TestConformanceFakeLib runs the driver suite through the purego loader
// over the C fake: versioned symbols, pointer outputs, the by-value
// 64-byte IPC handle, NOT_READY from cuEventQuery, cross-process IPC.
func TestConformanceFakeLib(t *testing.T) {
	needFake(t)
	os.Setenv(childLib, "c")
	cudatest.Run(t, cudatest.Options{Open: openFor("c"), Strict: true})
}

func TestConformanceGoFake(t *testing.T) {
	os.Setenv(childLib, "go")
	cudatest.Run(t, cudatest.Options{Open: openFor("go"), Strict: true})
}

func TestConformanceReal(t *testing.T) {
	needReal(t)
	os.Setenv(childLib, "real")
	cudatest.Run(t, cudatest.Options{Open: cuda.Open})
}

func TestLoadNoLibrary(t *testing.T) {
	_, err := cuda.Load("/nonexistent/libcuda.so.1")
	if !errors.Is(err, cuda.ErrNoDriver) {
		t.Fatalf("Load of a missing library: %v, want ErrNoDriver", err)
	}
}

func TestOpenLibraryEnv(t *testing.T) {
	needFake(t)
	t.Setenv(cuda.LibraryEnv, fakeLib("stub"))
	drv, err := cuda.Open()
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Init(0); !errors.Is(err, cuda.ErrStubLibrary) {
		t.Fatalf("Open with %s naming the stub: cuInit %v", cuda.LibraryEnv, err)
	}
	t.Setenv(cuda.LibraryEnv, "/nonexistent/libcuda.so.1")
	if _, err := cuda.Open(); !errors.Is(err, cuda.ErrNoDriver) {
		t.Fatalf("Open of a missing library: %v", err)
	}
}

func TestLoadStubLibrary(t *testing.T) {
	needFake(t)
	drv, err := cuda.Load(fakeLib("stub"))
	if err != nil {
		t.Fatal(err)
	}
	err = drv.Init(0)
	if !errors.Is(err, cuda.ErrStubLibrary) || !errors.Is(err, cuda.ErrNoDriver) {
		t.Fatalf("cuInit on the stub: %v, want ErrStubLibrary and ErrNoDriver", err)
	}
	if _, err := cuda.OpenDevice(drv, "0"); !errors.Is(err, cuda.ErrNoDriver) {
		t.Fatalf("OpenDevice on the stub: %v, want ErrNoDriver", err)
	}
}

func TestLoadMissingVersionedSymbol(t *testing.T) {
	needFake(t)
	_, err := cuda.Load(fakeLib("old"))
	if !errors.Is(err, cuda.ErrSymbol) || !strings.Contains(err.Error(), "cuMemAlloc_v2") {
		t.Fatalf("Load without cuMemAlloc_v2: %v, want ErrSymbol naming it", err)
	}
}

// TestNoDriverFallback is what a binary does at start: no driver means host
// memory, whatever the reason.
func TestNoDriverFallback(t *testing.T) {
	for name, drv := range map[string]cuda.Driver{
		"stub":      cudafake.New(cudafake.Config{Stub: true}),
		"no device": cudafake.New(cudafake.Config{NoDevice: true}),
	} {
		if _, err := cuda.OpenDevice(drv, ""); !errors.Is(err, cuda.ErrNoDriver) {
			t.Errorf("%s: %v, want ErrNoDriver", name, err)
		}
	}
}
