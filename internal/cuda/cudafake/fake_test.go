//go:build linux

package cudafake_test

import (
	"bytes"
	"errors"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

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

// TestVMM: what the conformance suite cannot see from outside. Adjacent
// mappings of two handles are one range to a copy; memory counts against
// the limit until released and unmapped; an export imports in another
// fake (another process) on the exporter's device; Stats go back to zero.
func TestVMM(t *testing.T) {
	const g = cudafake.Granularity
	d := cudafake.New(cudafake.Config{Devices: 2, MemLimit: 4 * g})
	other := cudafake.New(cudafake.Config{Devices: 2, PID: 1})
	onCtx(t, d, func() {
		a, err := d.MemCreate(2*g, 1)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := d.MemCreate(g, 1)
		if _, err := d.MemCreate(2*g, 1); !errors.Is(err, cuda.ErrOutOfMemory) {
			t.Errorf("over the limit: %v", err)
		}
		r, _ := d.MemAddressReserve(4*g, 8*g)
		if r%(8*g) != 0 {
			t.Errorf("reservation %#x not aligned to %d", r, 8*g)
		}
		if err := d.MemMap(r, 2*g, a); err != nil {
			t.Fatal(err)
		}
		if err := d.MemMap(r+2*g, g, b); err != nil {
			t.Fatal(err)
		}
		if err := d.MemSetAccess(r, 2*g, 0); err != nil {
			t.Fatal(err)
		}
		if err := d.MemSetAccess(r, 4*g, 0); !errors.Is(err, cuda.ErrInvalidValue) {
			t.Errorf("access to a range with a hole: %v", err)
		}
		// Granule 2 has no access yet: a copy across the boundary fails,
		// then, once it has, works.
		src := bytes.Repeat([]byte{0xab}, 2*4096)
		edge := r + 2*g - 4096
		if err := d.MemcpyHtoD(edge, src); !errors.Is(err, cuda.ErrInvalidValue) {
			t.Errorf("copy into a granule without access: %v", err)
		}
		_ = d.MemSetAccess(r+2*g, g, 0)
		if err := d.MemcpyHtoD(edge, src); err != nil {
			t.Errorf("copy across two adjacent mappings: %v", err)
		}
		if ord, _ := d.PointerGetAttribute(cuda.PointerAttributeDeviceOrdinal, r); ord != 1 {
			t.Errorf("device ordinal %d, want 1", ord)
		}
		fd, _ := d.MemExportToShareableHandle(b)
		onCtx(t, other, func() {
			h, err := other.MemImportFromShareableHandle(fd)
			if err != nil {
				t.Fatal(err)
			}
			p, _ := other.MemAddressReserve(g, 0)
			_ = other.MemMap(p, g, h)
			_ = other.MemSetAccess(p, g, 0)
			got := make([]byte, 4096)
			if err := other.MemcpyDtoH(got, p); err != nil || got[0] != 0xab {
				t.Errorf("another process's import: %v %x", err, got[:4])
			}
			if ord, _ := other.PointerGetAttribute(cuda.PointerAttributeDeviceOrdinal, p); ord != 1 {
				t.Errorf("import on device %d, want the exporter's 1", ord)
			}
			_ = other.MemRelease(h)
			// Left mapped: the context's release unmaps and frees it.
		})
		if s := other.Stats(); s.Handles+s.Reserved+s.Mapped != 0 {
			t.Errorf("left behind by the context's release: %+v", s)
		}
		_ = unix.Close(fd)
		if s := d.Stats(); s.Handles != 2 || s.Reserved != 1 || s.Mapped != 2 {
			t.Errorf("stats %+v, want 2 handles, 1 reservation, 2 mappings", s)
		}
		_ = d.MemRelease(a)
		_ = d.MemRelease(b)
		if _, err := d.MemCreate(2*g, 1); !errors.Is(err, cuda.ErrOutOfMemory) {
			t.Errorf("released but mapped memory freed: %v", err)
		}
		_ = d.MemUnmap(r, 2*g)
		_ = d.MemUnmap(r+2*g, g)
		c, err := d.MemCreate(4*g, 1)
		if err != nil {
			t.Errorf("released and unmapped memory not freed: %v", err)
		}
		_ = d.MemRelease(c)
		if err := d.MemAddressFree(r, 4*g); err != nil {
			t.Error(err)
		}
	})
	if s := d.Stats(); s.Handles+s.Reserved+s.Mapped != 0 {
		t.Errorf("left behind: %+v", s)
	}
}

// TestVMMReleasedWithContext: the last release of the primary context
// frees the handles, reservations and mappings made in it.
func TestVMMReleasedWithContext(t *testing.T) {
	d := cudafake.New(cudafake.Config{MemLimit: 2 * cudafake.Granularity})
	for range 2 {
		onCtx(t, d, func() {
			h, err := d.MemCreate(2*cudafake.Granularity, 0)
			if err != nil {
				t.Fatal(err)
			}
			r, _ := d.MemAddressReserve(2*cudafake.Granularity, 0)
			_ = d.MemMap(r, 2*cudafake.Granularity, h)
		})
		if s := d.Stats(); s.Handles+s.Reserved+s.Mapped != 0 {
			t.Errorf("survive the context: %+v", s)
		}
	}
}
