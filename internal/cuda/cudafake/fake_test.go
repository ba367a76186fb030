//go:build linux

package cudafake_test

import (
	"bytes"
	"errors"
	"runtime"
	"testing"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
	"github.com/handoff-io/handoff/internal/cuda/cudatest"
	"github.com/handoff-io/handoff/internal/leakcheck"
)

func open() (cuda.Driver, error) { return cudafake.New(cudafake.Config{Devices: 2}), nil }

func TestMain(m *testing.M) {
	cudatest.Child(open)
	leakcheck.Main(m)
}

func TestConformance(t *testing.T) {
	cudatest.Run(t, cudatest.Options{Open: open, Strict: true})
}

// onCtx runs fn on a locked thread with device 0's primary context current.
func onCtx(t *testing.T, d *cudafake.Driver, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		if err := d.Init(0); err != nil {
			t.Error(err)
			return
		}
		c, err := d.DevicePrimaryCtxRetain(0)
		if err != nil {
			t.Error(err)
			return
		}
		if err := d.CtxSetCurrent(c); err != nil {
			t.Error(err)
			return
		}
		fn()
		if err := d.DevicePrimaryCtxRelease(0); err != nil {
			t.Error(err)
		}
	}()
	<-done
}

func TestBeforeInit(t *testing.T) {
	d := cudafake.New(cudafake.Config{})
	_, err := d.DeviceGetCount()
	if !errors.Is(err, cuda.ErrNotInitialized) {
		t.Fatalf("cuDeviceGetCount before cuInit: %v", err)
	}
}

func TestStubAndNoDevice(t *testing.T) {
	stub := cudafake.New(cudafake.Config{Stub: true})
	err := stub.Init(0)
	if !errors.Is(err, cuda.ErrStubLibrary) || !errors.Is(err, cuda.ErrNoDriver) {
		t.Errorf("stub cuInit: %v, want ErrStubLibrary and ErrNoDriver", err)
	}
	if got := err.Error(); got != "cuda: cuInit: CUDA_ERROR_STUB_LIBRARY (34)" {
		t.Errorf("stub error text %q", got)
	}
	none := cudafake.New(cudafake.Config{NoDevice: true})
	err = none.Init(0)
	if !errors.Is(err, cuda.ErrNoDevice) || !errors.Is(err, cuda.ErrNoDriver) {
		t.Errorf("no-device cuInit: %v", err)
	}
}

// TestAsyncLandsOnlyAfterWait: a reader that does not wait for a copy's
// event sees the old bytes, as it may on a GPU.
func TestAsyncLandsOnlyAfterWait(t *testing.T) {
	d := cudafake.New(cudafake.Config{Polls: 3})
	onCtx(t, d, func() {
		p, _ := d.MemAlloc(64)
		q, _ := d.MemAlloc(64)
		_ = d.MemcpyHtoD(p, bytes.Repeat([]byte{7}, 64))
		s, _ := d.StreamCreate(cuda.StreamNonBlocking)
		e, _ := d.EventCreate(cuda.EventDisableTiming)
		if err := d.MemcpyDtoDAsync(q, p, 64, s); err != nil {
			t.Fatal(err)
		}
		_ = d.EventRecord(e, s)
		polls := 0
		for errors.Is(d.EventQuery(e), cuda.ErrNotReady) {
			polls++
		}
		if polls != 3 {
			t.Errorf("%d NOT_READY answers, want 3", polls)
		}
		got := make([]byte, 64)
		_ = d.MemcpyDtoH(got, q)
		if got[0] != 7 {
			t.Errorf("copy not landed after its event completed")
		}
		// A synchronous copy does not wait for a non-blocking stream: the
		// second copy is pending until its stream is synchronised.
		_ = d.MemcpyHtoD(p, bytes.Repeat([]byte{9}, 64))
		_ = d.MemcpyDtoDAsync(q, p, 64, s)
		_ = d.EventRecord(e, s)
		if err := d.EventQuery(e); !errors.Is(err, cuda.ErrNotReady) {
			t.Errorf("fresh event: %v, want NOT_READY", err)
		}
		_ = d.StreamSynchronize(s)
		if err := d.EventQuery(e); err != nil {
			t.Errorf("event after synchronize: %v", err)
		}
		var buf [64]byte
		_ = d.MemcpyDtoH(buf[:], q)
		if buf[0] != 9 {
			t.Errorf("copy not landed after synchronize")
		}
		// The host side of an async copy must be pinned memory.
		pageable := make([]byte, 64)
		err := d.MemcpyDtoHAsync(cuda.HostPtr(&pageable[0]), q, 64, s)
		if !errors.Is(err, cuda.ErrInvalidValue) {
			t.Errorf("async copy into the Go heap: %v, want ErrInvalidValue", err)
		}
		_ = d.EventDestroy(e)
		_ = d.StreamDestroy(s)
		_ = d.MemFree(p)
		_ = d.MemFree(q)
	})
	if s := d.Stats(); s.Allocs+s.Streams+s.Events+s.Pinned != 0 || s.Retained[0] != 0 {
		t.Errorf("left behind: %+v", s)
	}
}

func TestOutOfMemoryAndOverrun(t *testing.T) {
	d := cudafake.New(cudafake.Config{MemLimit: 1 << 20})
	onCtx(t, d, func() {
		if _, err := d.MemAlloc(2 << 20); !errors.Is(err, cuda.ErrOutOfMemory) {
			t.Errorf("over the limit: %v", err)
		}
		p, err := d.MemAlloc(4096)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.MemcpyHtoD(p+4000, make([]byte, 200)); !errors.Is(err, cuda.ErrInvalidValue) {
			t.Errorf("copy past the allocation's end: %v", err)
		}
		_ = d.MemFree(p)
	})
}

// TestReleaseFreesContextMemory: the last release of a primary context
// frees what it held, so a pointer kept past it is invalid.
func TestReleaseFreesContextMemory(t *testing.T) {
	d := cudafake.New(cudafake.Config{})
	var p cuda.DevicePtr
	onCtx(t, d, func() {
		p, _ = d.MemAlloc(4096)
		_, _ = d.MemHostAlloc(4096, cuda.MemHostAllocPortable)
	})
	if s := d.Stats(); s.Allocs != 0 || s.Pinned != 0 {
		t.Errorf("%d allocations and %d pinned buffers survive the context", s.Allocs, s.Pinned)
	}
	onCtx(t, d, func() {
		if err := d.MemFree(p); !errors.Is(err, cuda.ErrInvalidValue) {
			t.Errorf("free after the context went: %v", err)
		}
	})
}
