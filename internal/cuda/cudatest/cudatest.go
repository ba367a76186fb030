// Package cudatest is the conformance suite for cuda.Driver
// implementations: the fake in Go (cudafake), the real driver loaded
// through purego with a fake libcuda.so.1 built from C, and the real
// driver on a GPU machine. One suite keeps the fakes honest: whatever they
// accept or refuse, the real driver must too.
//
// A test package runs it with
//
//	func TestMain(m *testing.M) {
//		cudatest.Child(open) // a child process of the IPC test runs here and exits
//		os.Exit(m.Run())
//	}
//
//	func TestConformance(t *testing.T) { cudatest.Run(t, cudatest.Options{Open: open}) }
package cudatest

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/leakcheck"
)

// Options configures Run.
type Options struct {
	// Open returns the driver under test. It may return the same driver
	// each time (a real library is loaded once per process).
	Open func() (cuda.Driver, error)
	// Strict adds the checks whose real-driver behaviour is undefined or
	// version-dependent (error codes of misuse), for the fakes.
	Strict bool
}

const childEnv = "CUDATEST_CHILD"

// onThread runs fn on a goroutine locked to a fresh OS thread with device
// 0's primary context current, as cuda.Device's executor does, and
// releases the context after.
func onThread(t testing.TB, drv cuda.Driver, fn func(cuda.Dev)) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		if err := drv.Init(0); err != nil {
			t.Errorf("cuInit: %v", err)
			return
		}
		dev, err := drv.DeviceGet(0)
		if err != nil {
			t.Errorf("cuDeviceGet: %v", err)
			return
		}
		ctx, err := drv.DevicePrimaryCtxRetain(dev)
		if err != nil {
			t.Errorf("retain: %v", err)
			return
		}
		defer func() {
			if err := drv.DevicePrimaryCtxRelease(dev); err != nil {
				t.Errorf("release: %v", err)
			}
		}()
		if err := drv.CtxSetCurrent(ctx); err != nil {
			t.Errorf("cuCtxSetCurrent: %v", err)
			return
		}
		defer drv.CtxSetCurrent(0) //nolint:errcheck // best effort; the thread ends next
		fn(dev)
	}()
	<-done
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7) ^ seed
	}
	return b
}

func must(t testing.TB, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func wantIs(t testing.TB, what string, err, target error) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Errorf("%s: got %v, want %v", what, err, target)
	}
}

// Run runs the suite.
func Run(t *testing.T, o Options) {
	open := func(t *testing.T) cuda.Driver {
		drv, err := o.Open()
		if err != nil {
			t.Fatalf("open driver: %v", err)
		}
		return drv
	}
	t.Run("Version", func(t *testing.T) {
		v, err := open(t).DriverGetVersion()
		must(t, "cuDriverGetVersion", err)
		if v < 11000 {
			t.Errorf("driver version %d, want >= 11000", v)
		}
	})
	t.Run("Devices", func(t *testing.T) {
		drv := open(t)
		must(t, "cuInit", drv.Init(0))
		n, err := drv.DeviceGetCount()
		must(t, "count", err)
		if n < 1 {
			t.Fatalf("%d devices", n)
		}
		_, err = drv.DeviceGet(n)
		wantIs(t, "cuDeviceGet past the last device", err, cuda.ErrInvalidDevice)
		dev, err := drv.DeviceGet(0)
		must(t, "cuDeviceGet", err)
		u, err := drv.DeviceGetUUID(dev)
		must(t, "uuid", err)
		if u == (cuda.UUID{}) {
			t.Errorf("zero uuid")
		}
		back, err := cuda.ParseUUID(u.String())
		if err != nil || back != u {
			t.Errorf("uuid %s round trip: %v %v", u, back, err)
		}
		ua, err := drv.DeviceGetAttribute(cuda.DeviceAttributeUnifiedAddressing, dev)
		must(t, "unified addressing", err)
		if ua != 1 {
			t.Errorf("unified addressing %d", ua)
		}
	})
	t.Run("NoContext", func(t *testing.T) {
		drv := open(t)
		must(t, "cuInit", drv.Init(0))
		done := make(chan struct{})
		go func() {
			defer close(done)
			runtime.LockOSThread() // a fresh thread has no current context
			_, err := drv.MemAlloc(4096)
			wantIs(t, "cuMemAlloc without a context", err, cuda.ErrInvalidContext)
		}()
		<-done
	})
	t.Run("AllocCopyFree", func(t *testing.T) {
		drv := open(t)
		onThread(t, drv, func(cuda.Dev) {
			const n = 1 << 20
			p, err := drv.MemAlloc(n)
			must(t, "alloc", err)
			q, err := drv.MemAlloc(n)
			must(t, "alloc", err)
			src := pattern(n, 1)
			must(t, "HtoD", drv.MemcpyHtoD(p, src))
			base, size, err := drv.MemGetAddressRange(p + 4096)
			must(t, "address range", err)
			if base != p || size < n {
				t.Errorf("range of p+4096 = %#x+%d, want %#x+%d", base, size, p, n)
			}
			b1, err := drv.PointerGetAttribute(cuda.PointerAttributeBufferID, p)
			must(t, "buffer id", err)
			b2, err := drv.PointerGetAttribute(cuda.PointerAttributeBufferID, q)
			must(t, "buffer id", err)
			if b1 == b2 {
				t.Errorf("two allocations share buffer id %d", b1)
			}
			ord, err := drv.PointerGetAttribute(cuda.PointerAttributeDeviceOrdinal, p)
			must(t, "device ordinal", err)
			if ord != 0 {
				t.Errorf("device ordinal %d", ord)
			}
			// Asynchronous DtoD, completion by event polling.
			s, err := drv.StreamCreate(cuda.StreamNonBlocking)
			must(t, "stream", err)
			ev, err := drv.EventCreate(cuda.EventDisableTiming)
			must(t, "event", err)
			must(t, "DtoD", drv.MemcpyDtoDAsync(q, p, n, s))
			must(t, "record", drv.EventRecord(ev, s))
			for polls := 0; ; polls++ {
				err := drv.EventQuery(ev)
				if err == nil {
					break
				}
				if !errors.Is(err, cuda.ErrNotReady) {
					t.Fatalf("event query: %v", err)
				}
				if polls > 1e8 {
					t.Fatal("event never completed")
				}
			}
			got := make([]byte, n)
			must(t, "DtoH", drv.MemcpyDtoH(got, q))
			if !bytes.Equal(got, src) {
				t.Errorf("DtoD copy differs")
			}
			// Pinned staging both ways.
			h, err := drv.MemHostAlloc(n, cuda.MemHostAllocPortable)
			must(t, "pinned", err)
			must(t, "DtoH async", drv.MemcpyDtoHAsync(h, p, n, s))
			must(t, "sync", drv.StreamSynchronize(s))
			hb := unsafeBytes(h, n)
			if !bytes.Equal(hb, src) {
				t.Errorf("DtoH async into pinned memory differs")
			}
			copy(hb, pattern(n, 9))
			must(t, "HtoD async", drv.MemcpyHtoDAsync(q, h, n, s))
			must(t, "sync", drv.StreamSynchronize(s))
			must(t, "DtoH", drv.MemcpyDtoH(got, q))
			if !bytes.Equal(got, pattern(n, 9)) {
				t.Errorf("HtoD async from pinned memory differs")
			}
			must(t, "free pinned", drv.MemFreeHost(h))
			must(t, "event destroy", drv.EventDestroy(ev))
			must(t, "stream destroy", drv.StreamDestroy(s))
			wantIs(t, "free of an interior pointer", drv.MemFree(p+4096), cuda.ErrInvalidValue)
			must(t, "free", drv.MemFree(p))
			must(t, "free", drv.MemFree(q))
			if o.Strict {
				wantIs(t, "double free", drv.MemFree(p), cuda.ErrInvalidValue)
				wantIs(t, "HtoD into freed memory", drv.MemcpyHtoD(p, src[:16]), cuda.ErrInvalidValue)
				wantIs(t, "destroyed stream", drv.StreamDestroy(s), cuda.ErrInvalidHandle)
				wantIs(t, "destroyed event", drv.EventQuery(ev), cuda.ErrInvalidHandle)
			}
		})
	})
	t.Run("IPCSelfOpen", func(t *testing.T) {
		drv := open(t)
		onThread(t, drv, func(cuda.Dev) {
			p, err := drv.MemAlloc(1 << 16)
			must(t, "alloc", err)
			defer func() { must(t, "free", drv.MemFree(p)) }()
			h, err := drv.IpcGetMemHandle(p)
			must(t, "cuIpcGetMemHandle", err)
			q, err := drv.IpcOpenMemHandle(h, cuda.IpcLazyEnablePeerAccess)
			if err == nil {
				t.Errorf("opening a handle in its exporting process succeeded (%#x)", q)
				_ = drv.IpcCloseMemHandle(q)
			}
			if o.Strict {
				wantIs(t, "open in the exporter", err, cuda.ErrInvalidContext)
				_, err = drv.IpcGetMemHandle(p + 4096)
				wantIs(t, "handle of an interior pointer", err, cuda.ErrInvalidValue)
			}
		})
	})
	t.Run("IPCCrossProcess", func(t *testing.T) { runIPC(t, open(t), o.Strict) })
	t.Run("IPCImporterKilled", func(t *testing.T) { runKilled(t, open(t)) })
	t.Run("VMM", func(t *testing.T) {
		if o.Strict {
			leakcheck.CheckFDs(t) // the fakes' memfds and duplicates all closed
		}
		runVMM(t, open(t), o.Strict)
	})
}

// runVMM creates VMM memory, exports it as an fd and imports it here and
// in a child process, maps both handles side by side in one reservation
// and shows they are the same memory, then shows a mapping keeps the
// memory after its handles are released.
func runVMM(t *testing.T, drv cuda.Driver, strict bool) {
	onThread(t, drv, func(dev cuda.Dev) {
		g, err := drv.MemGetAllocationGranularity(dev)
		must(t, "granularity", err)
		if g == 0 || g&(g-1) != 0 {
			t.Fatalf("granularity %d, want a power of two", g)
		}
		size := 2 * g
		h, err := drv.MemCreate(size, dev)
		must(t, "cuMemCreate", err)
		fd, err := drv.MemExportToShareableHandle(h)
		must(t, "export", err)
		f := os.NewFile(uintptr(fd), "vmm-export")
		defer f.Close()
		h2, err := drv.MemImportFromShareableHandle(fd)
		must(t, "import in the exporting process", err)
		r, err := drv.MemAddressReserve(2*size, 0)
		must(t, "reserve", err)
		must(t, "map", drv.MemMap(r, size, h))
		must(t, "map the import", drv.MemMap(r+cuda.DevicePtr(size), size, h2))
		if strict {
			wantIs(t, "HtoD before cuMemSetAccess", drv.MemcpyHtoD(r, make([]byte, 16)), cuda.ErrInvalidValue)
		}
		must(t, "set access", drv.MemSetAccess(r, size, dev))
		must(t, "set access", drv.MemSetAccess(r+cuda.DevicePtr(size), size, dev))

		// One pattern into granule 0 through h, read back through the
		// import; a DtoD from granule 0 of one mapping into granule 1 of
		// the other lands in granule 1 of the first.
		src := pattern(int(g), 11)
		must(t, "HtoD", drv.MemcpyHtoD(r, src))
		got := make([]byte, g)
		must(t, "DtoH through the import", drv.MemcpyDtoH(got, r+cuda.DevicePtr(size)))
		if !bytes.Equal(got, src) {
			t.Errorf("the imported handle's mapping does not show the exported memory")
		}
		s, err := drv.StreamCreate(cuda.StreamNonBlocking)
		must(t, "stream", err)
		must(t, "DtoD between mappings", drv.MemcpyDtoDAsync(r+cuda.DevicePtr(size+g), r, g, s))
		must(t, "sync", drv.StreamSynchronize(s))
		must(t, "stream destroy", drv.StreamDestroy(s))
		clear(got)
		must(t, "DtoH", drv.MemcpyDtoH(got, r+cuda.DevicePtr(g)))
		if !bytes.Equal(got, src) {
			t.Errorf("a DtoD copy into one mapping does not show in the other")
		}
		ord, err := drv.PointerGetAttribute(cuda.PointerAttributeDeviceOrdinal, r+cuda.DevicePtr(g))
		must(t, "device ordinal of a mapping", err)
		if ord != uint64(dev) {
			t.Errorf("device ordinal of a mapping %d, want %d", ord, dev)
		}
		p := r + cuda.DevicePtr(size+4096)
		base, n, err := drv.MemGetAddressRange(p)
		must(t, "address range of a mapping", err)
		if p < base || uint64(p-base) >= n {
			t.Errorf("range of %#x = %#x+%d, which does not hold it", p, base, n)
		}

		// Another process imports the fd (inherited as its fd 3), checks
		// granule 0 and writes granule 1.
		cmd := childCmd(cuda.IpcMemHandle{}, "vmm", int(size), crc32.ChecksumIEEE(src))
		cmd.ExtraFiles = []*os.File{f}
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("vmm child: %v\n%s", err, out)
		} else {
			must(t, "DtoH", drv.MemcpyDtoH(got, r+cuda.DevicePtr(g)))
			if !bytes.Equal(got, pattern(int(g), 5)) {
				t.Errorf("the child's write through its import is not in the exporter's memory")
			}
		}

		if strict {
			b1, err := drv.PointerGetAttribute(cuda.PointerAttributeBufferID, r)
			must(t, "buffer id", err)
			b2, err := drv.PointerGetAttribute(cuda.PointerAttributeBufferID, r+cuda.DevicePtr(size))
			must(t, "buffer id", err)
			if b1 == b2 {
				t.Errorf("two mappings share buffer id %d", b1)
			}
			if base != r+cuda.DevicePtr(size) || n != size {
				t.Errorf("range of %#x = %#x+%d, want the mapping %#x+%d", p, base, n, r+cuda.DevicePtr(size), size)
			}
			_, err = drv.IpcGetMemHandle(r)
			wantIs(t, "cuIpcGetMemHandle of a VMM mapping", err, cuda.ErrInvalidValue)
			wantIs(t, "cuMemFree of a VMM mapping", drv.MemFree(r), cuda.ErrInvalidValue)
			wantIs(t, "free of a reservation with mappings in it", drv.MemAddressFree(r, 2*size), cuda.ErrInvalidValue)
			wantIs(t, "map over a mapping", drv.MemMap(r, g, h), cuda.ErrInvalidValue)
			wantIs(t, "unmap of part of a mapping", drv.MemUnmap(r, g), cuda.ErrInvalidValue)
			_, err = drv.MemCreate(g+g/2, dev)
			wantIs(t, "cuMemCreate of 1.5 granules", err, cuda.ErrInvalidValue)
			_, err = drv.MemAddressReserve(g/2, 0)
			wantIs(t, "reserve of half a granule", err, cuda.ErrInvalidValue)
			pr, pw, err := os.Pipe()
			must(t, "pipe", err)
			_, err = drv.MemImportFromShareableHandle(int(pr.Fd()))
			wantIs(t, "import of a pipe", err, cuda.ErrInvalidValue)
			pr.Close()
			pw.Close()
			_, err = drv.MemImportFromShareableHandle(-1)
			wantIs(t, "import of fd -1", err, cuda.ErrInvalidValue)
		}

		// Released while mapped, the memory stays until unmapped.
		must(t, "release", drv.MemRelease(h))
		if h2 != h { // the driver may answer an import with the handle it has
			must(t, "release the import", drv.MemRelease(h2))
		}
		clear(got)
		must(t, "DtoH after release", drv.MemcpyDtoH(got, r))
		if !bytes.Equal(got, src) {
			t.Errorf("a mapping lost its memory when the handles were released")
		}
		must(t, "unmap", drv.MemUnmap(r, size))
		must(t, "unmap", drv.MemUnmap(r+cuda.DevicePtr(size), size))
		must(t, "free the reservation", drv.MemAddressFree(r, 2*size))
		if strict {
			wantIs(t, "second release", drv.MemRelease(h), cuda.ErrInvalidValue)
			_, err = drv.MemExportToShareableHandle(h)
			wantIs(t, "export of a released handle", err, cuda.ErrInvalidValue)
			wantIs(t, "DtoH from a freed reservation", drv.MemcpyDtoH(got[:16], r), cuda.ErrInvalidValue)
		}
	})
}

// runKilled has a child open an export and copy into it in a loop, kills
// it mid-copy, and checks the exporter is unharmed: its bytes readable,
// its allocation freeable, a fresh export openable by the next process.
func runKilled(t *testing.T, drv cuda.Driver) {
	const n = 1 << 20
	onThread(t, drv, func(cuda.Dev) {
		p, err := drv.MemAlloc(n)
		must(t, "alloc", err)
		h, err := drv.IpcGetMemHandle(p)
		must(t, "handle", err)
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s:%s:%d:%d", childEnv, "loop", hex.EncodeToString(h.Reserved[:]), n, 0))
		stdout, err := cmd.StdoutPipe()
		must(t, "pipe", err)
		must(t, "start", cmd.Start())
		line := make([]byte, 8)
		if _, err := io.ReadFull(stdout, line); err != nil || string(line) != "copying\n" {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			t.Fatalf("child did not start copying: %q %v", line, err)
		}
		must(t, "kill", cmd.Process.Kill())
		_ = cmd.Wait()
		got := make([]byte, n)
		must(t, "read after the importer died", drv.MemcpyDtoH(got, p))
		if !bytes.Equal(got[:4], []byte{0xee, 0xee, 0xee, 0xee}) {
			t.Errorf("the killed child's copies never landed: %x", got[:4])
		}
		must(t, "free after the importer died", drv.MemFree(p))
		q, err := drv.MemAlloc(n)
		must(t, "alloc", err)
		src := pattern(n/2, 3)
		must(t, "HtoD", drv.MemcpyHtoD(q, src))
		h, err = drv.IpcGetMemHandle(q)
		must(t, "handle", err)
		if out, err := child(h, "check", n, crc32.ChecksumIEEE(src)); err != nil {
			t.Errorf("a fresh export after the kill: %v\n%s", err, out)
		}
		must(t, "free", drv.MemFree(q))
	})
}

// runIPC exports an allocation, has a child process open it, check the
// parent's bytes and write its own, then checks them here; then frees the
// allocation and has a child try the stale handle.
func runIPC(t *testing.T, drv cuda.Driver, strict bool) {
	const n = 1 << 20
	onThread(t, drv, func(cuda.Dev) {
		p, err := drv.MemAlloc(n)
		must(t, "alloc", err)
		src := pattern(n/2, 3)
		must(t, "HtoD", drv.MemcpyHtoD(p, src))
		h, err := drv.IpcGetMemHandle(p)
		must(t, "handle", err)
		out, err := child(h, "check", n, crc32.ChecksumIEEE(src))
		if err != nil {
			t.Fatalf("child: %v\n%s", err, out)
		}
		got := make([]byte, n/2)
		must(t, "DtoH", drv.MemcpyDtoH(got, p+n/2))
		if !bytes.Equal(got, pattern(n/2, 5)) {
			t.Errorf("the child's write through its IPC mapping is not in the exporter's memory")
		}
		if strict && !strings.Contains(out, "second-open:"+cuda.ErrorAlreadyMapped.String()) {
			t.Errorf("second open of one handle in one process: want %v; child said:\n%s", cuda.ErrorAlreadyMapped, out)
		}
		must(t, "free", drv.MemFree(p))
		out, err = child(h, "stale", n, 0)
		if err != nil {
			t.Errorf("stale handle child: %v\n%s", err, out)
		}
		if strict && !strings.Contains(out, "stale:"+cuda.ErrorMapFailed.String()) {
			t.Errorf("open of a freed allocation's handle: want %v; child said:\n%s", cuda.ErrorMapFailed, out)
		}
	})
}

func child(h cuda.IpcMemHandle, mode string, n int, sum uint32) (string, error) {
	out, err := childCmd(h, mode, n, sum).CombinedOutput()
	return string(out), err
}

func childCmd(h cuda.IpcMemHandle, mode string, n int, sum uint32) *exec.Cmd {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s:%s:%d:%d", childEnv, mode, hex.EncodeToString(h.Reserved[:]), n, sum))
	return cmd
}

// Child runs the child role of the IPC test and exits, when this process
// is such a child; otherwise it returns at once. Call it first in TestMain.
func Child(open func() (cuda.Driver, error)) {
	spec, ok := os.LookupEnv(childEnv)
	if !ok {
		return
	}
	if err := childMain(open, spec); err != nil {
		fmt.Println("child:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func childMain(open func() (cuda.Driver, error), spec string) error {
	f := strings.Split(spec, ":")
	if len(f) != 4 {
		return fmt.Errorf("bad spec %q", spec)
	}
	var h cuda.IpcMemHandle
	if _, err := hex.Decode(h.Reserved[:], []byte(f[1])); err != nil {
		return err
	}
	n, _ := strconv.Atoi(f[2])
	sum, _ := strconv.ParseUint(f[3], 10, 32)
	drv, err := open()
	if err != nil {
		return err
	}
	var result error
	t := &fatalTB{}
	onThread(t, drv, func(dev cuda.Dev) {
		if f[0] == "vmm" {
			result = childVMM(drv, dev, 3, n, uint32(sum))
			return
		}
		result = childWork(drv, h, f[0], n, uint32(sum))
	})
	return errors.Join(result, t.err)
}

// childVMM imports the VMM export it inherited as fd, maps all n bytes of
// it, checks the first granule's crc and writes pattern 5 into the second.
// The handle goes as soon as it is mapped: the mapping holds the memory.
func childVMM(drv cuda.Driver, dev cuda.Dev, fd, n int, sum uint32) error {
	g, err := drv.MemGetAllocationGranularity(dev)
	if err != nil {
		return err
	}
	h, err := drv.MemImportFromShareableHandle(fd)
	if err != nil {
		return err
	}
	r, err := drv.MemAddressReserve(uint64(n), 0)
	if err != nil {
		return err
	}
	if err := drv.MemMap(r, uint64(n), h); err != nil {
		return err
	}
	if err := drv.MemRelease(h); err != nil {
		return err
	}
	if err := drv.MemSetAccess(r, uint64(n), dev); err != nil {
		return err
	}
	got := make([]byte, g)
	if err := drv.MemcpyDtoH(got, r); err != nil {
		return err
	}
	if c := crc32.ChecksumIEEE(got); c != sum {
		return fmt.Errorf("crc of the exporter's bytes %08x, want %08x", c, sum)
	}
	if err := drv.MemcpyHtoD(r+cuda.DevicePtr(g), pattern(int(g), 5)); err != nil {
		return err
	}
	if err := drv.MemUnmap(r, uint64(n)); err != nil {
		return err
	}
	return drv.MemAddressFree(r, uint64(n))
}

func childWork(drv cuda.Driver, h cuda.IpcMemHandle, mode string, n int, sum uint32) error {
	p, err := drv.IpcOpenMemHandle(h, cuda.IpcLazyEnablePeerAccess)
	if mode == "loop" {
		if err != nil {
			return err
		}
		return copyForever(drv, p, n)
	}
	if mode == "stale" {
		if err == nil {
			_ = drv.IpcCloseMemHandle(p)
			return errors.New("opened the handle of a freed allocation")
		}
		fmt.Printf("stale:%s\n", cuda.CodeOf(err))
		return nil
	}
	if err != nil {
		return err
	}
	got := make([]byte, n/2)
	if err := drv.MemcpyDtoH(got, p); err != nil {
		return err
	}
	if c := crc32.ChecksumIEEE(got); c != sum {
		return fmt.Errorf("crc of the exporter's bytes %08x, want %08x", c, sum)
	}
	_, err = drv.IpcOpenMemHandle(h, cuda.IpcLazyEnablePeerAccess)
	fmt.Printf("second-open:%s\n", cuda.CodeOf(err))
	// Write the second half with a DtoD copy from an allocation of ours,
	// on a non-blocking stream, waited on by event.
	own, err := drv.MemAlloc(uint64(n / 2))
	if err != nil {
		return err
	}
	defer drv.MemFree(own) //nolint:errcheck // the process ends next
	if err := drv.MemcpyHtoD(own, pattern(n/2, 5)); err != nil {
		return err
	}
	s, err := drv.StreamCreate(cuda.StreamNonBlocking)
	if err != nil {
		return err
	}
	if err := drv.MemcpyDtoDAsync(p+cuda.DevicePtr(n/2), own, uint64(n/2), s); err != nil {
		return err
	}
	if err := drv.StreamSynchronize(s); err != nil {
		return err
	}
	if err := drv.StreamDestroy(s); err != nil {
		return err
	}
	return drv.IpcCloseMemHandle(p)
}

// copyForever fills p with 0xee by DtoD copies on a non-blocking stream,
// over and over, until the process is killed; it says "copying" once the
// first copy completed.
func copyForever(drv cuda.Driver, p cuda.DevicePtr, n int) error {
	own, err := drv.MemAlloc(uint64(n))
	if err != nil {
		return err
	}
	if err := drv.MemcpyHtoD(own, bytes.Repeat([]byte{0xee}, n)); err != nil {
		return err
	}
	s, err := drv.StreamCreate(cuda.StreamNonBlocking)
	if err != nil {
		return err
	}
	for i := 0; ; i++ {
		if err := drv.MemcpyDtoDAsync(p, own, uint64(n), s); err != nil {
			return err
		}
		if i == 0 {
			if err := drv.StreamSynchronize(s); err != nil {
				return err
			}
			fmt.Print("copying\n")
		}
		if i%64 == 63 {
			if err := drv.StreamSynchronize(s); err != nil {
				return err
			}
		}
	}
}

// fatalTB collects onThread's errors in a child process (no testing.T).
type fatalTB struct {
	testing.TB
	err error
}

func (f *fatalTB) Helper() {}
func (f *fatalTB) Errorf(format string, args ...any) {
	f.err = errors.Join(f.err, fmt.Errorf(format, args...))
}
