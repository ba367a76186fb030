//go:build linux && (amd64 || arm64)

package cuda_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
	"github.com/handoff-io/handoff/internal/leakcheck"
)

// drivers returns the implementations a Device test runs over, by the name
// a child process opens them with.
func drivers(t *testing.T) map[string]func() (cuda.Driver, error) {
	m := map[string]func() (cuda.Driver, error){"go": openFor("go")}
	if libErr == nil {
		m["c"] = openFor("c")
	} else {
		t.Logf("C fake skipped: %v", libErr)
	}
	if os.Getenv(realEnv) == "1" {
		m["real"] = openFor("real")
	}
	return m
}

func eachDriver(t *testing.T, fn func(t *testing.T, name string, drv cuda.Driver)) {
	for name, open := range drivers(t) {
		t.Run(name, func(t *testing.T) {
			drv, err := open()
			if err != nil {
				t.Fatal(err)
			}
			fn(t, name, drv)
		})
	}
}

func openDev(t *testing.T, drv cuda.Driver, sel string) *cuda.Device {
	t.Helper()
	d, err := cuda.OpenDevice(drv, sel)
	if err != nil {
		t.Fatalf("OpenDevice(%q): %v", sel, err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return d
}

func fill(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*31>>3) ^ seed
	}
	return b
}

func TestDeviceSelect(t *testing.T) {
	leakcheck.Check(t)
	fake := cudafake.New(cudafake.Config{Devices: 3})
	d2 := openDev(t, fake, "2")
	byUUID := openDev(t, fake, d2.UUID().String())
	if byUUID.Ordinal() != 2 {
		t.Errorf("device by uuid %s: ordinal %d, want 2", d2.UUID(), byUUID.Ordinal())
	}
	if _, err := cuda.OpenDevice(fake, "3"); !errors.Is(err, cuda.ErrInvalidDevice) {
		t.Errorf("ordinal 3 of 3: %v", err)
	}
	if _, err := cuda.OpenDevice(fake, "GPU-00000000-0000-0000-0000-000000000000"); !errors.Is(err, cuda.ErrInvalidDevice) {
		t.Errorf("unknown uuid: %v", err)
	}
	if _, err := cuda.OpenDevice(fake, "GPU-nonsense"); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("malformed uuid: %v", err)
	}
}

func TestDeviceCopiesAndClose(t *testing.T) {
	leakcheck.Check(t)
	eachDriver(t, func(t *testing.T, _ string, drv cuda.Driver) {
		d, err := cuda.OpenDevice(drv, "0")
		if err != nil {
			t.Fatal(err)
		}
		const n = 3<<20 + 123
		p, err := d.Alloc(n)
		if err != nil {
			t.Fatal(err)
		}
		q, _ := d.Alloc(n)
		src := fill(n, 1)
		if err := d.CopyToDevice(p, src); err != nil {
			t.Fatal(err)
		}
		if got, err := d.CopyChunked(context.Background(), q, p, n, 1<<20, nil); err != nil || got != n {
			t.Fatalf("CopyChunked: %d, %v", got, err)
		}
		got := make([]byte, n)
		if err := d.CopyFromDevice(got, q); err != nil || !bytes.Equal(got, src) {
			t.Fatalf("chunked DtoD differs (%v)", err)
		}
		// Staging: device -> pinned -> device.
		pin, err := d.AllocPinned(n)
		if err != nil {
			t.Fatal(err)
		}
		c, err := d.SubmitDtoH(pin.Ptr(), p, n)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Wait(); err != nil || !bytes.Equal(pin.Bytes(), src) {
			t.Fatalf("DtoH into pinned memory differs (%v)", err)
		}
		copy(pin.Bytes(), fill(n, 2))
		c, _ = d.SubmitHtoD(q, pin.Ptr(), n)
		if err := c.Wait(); err != nil {
			t.Fatal(err)
		}
		if err := d.CopyFromDevice(got, q); err != nil || !bytes.Equal(got, fill(n, 2)) {
			t.Fatalf("HtoD from pinned memory differs (%v)", err)
		}
		if err := pin.Free(); err != nil {
			t.Fatal(err)
		}
		if err := errors.Join(d.Free(p), d.Free(q)); err != nil {
			t.Fatal(err)
		}
		if err := d.Free(p); !errors.Is(err, cuda.ErrInvalidValue) {
			t.Errorf("double free: %v, want ErrInvalidValue", err)
		}
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		if err := d.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
		if _, err := d.Alloc(1); !errors.Is(err, cuda.ErrClosed) {
			t.Errorf("Alloc after Close: %v, want ErrClosed", err)
		}
		if f, ok := drv.(*cudafake.Driver); ok {
			if s := f.Stats(); s.Allocs+s.Pinned+s.Streams+s.Events+s.Imports != 0 || s.Retained[0] != 0 {
				t.Errorf("left behind: %+v", s)
			}
		}
	})
}

// TestCopyChunkedFence: once Begin fails, nothing more is queued.
func TestCopyChunkedFence(t *testing.T) {
	eachDriver(t, func(t *testing.T, _ string, drv cuda.Driver) {
		d := openDev(t, drv, "0")
		const n, chunk = 8 << 10, 1 << 10
		p, _ := d.Alloc(n)
		q, _ := d.Alloc(n)
		defer d.Free(p) //nolint:errcheck
		defer d.Free(q) //nolint:errcheck
		_ = d.CopyToDevice(p, bytes.Repeat([]byte{0xaa}, n))
		_ = d.CopyToDevice(q, make([]byte, n))
		b := &countBracket{allow: 3}
		got, err := d.CopyChunked(context.Background(), q, p, n, chunk, b)
		if !errors.Is(err, errFenced) || got != 3*chunk || b.ends != 3 {
			t.Fatalf("fenced copy: %d bytes, %d ends, %v; want %d, 3, fenced", got, b.ends, err, 3*chunk)
		}
		buf := make([]byte, n)
		_ = d.CopyFromDevice(buf, q)
		if !bytes.Equal(buf[:3*chunk], bytes.Repeat([]byte{0xaa}, 3*chunk)) || !bytes.Equal(buf[3*chunk:], make([]byte, n-3*chunk)) {
			t.Errorf("bytes past the fence landed")
		}
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := d.CopyChunked(ctx, q, p, n, chunk, nil); !errors.Is(err, context.Canceled) {
			t.Errorf("cancelled copy: %v", err)
		}
	})
}

var errFenced = errors.New("fenced")

type countBracket struct{ allow, begins, ends int }

func (b *countBracket) Begin() error {
	if b.begins++; b.begins > b.allow {
		return errFenced
	}
	return nil
}
func (b *countBracket) End() error { b.ends++; return nil }

// slotBracket is the shm transport's slot word in small: open -> writing
// (Begin's CAS), writing -> open (End's CAS); a receiver's fence CASes open
// -> closed, or writing -> fencing and waits for the writer's End to find
// it and close the slot.
type slotBracket struct{ word atomic.Uint32 }

const (
	slotOpen uint32 = iota
	slotWriting
	slotFencing
	slotClosed
)

func (s *slotBracket) Begin() error {
	if !s.word.CompareAndSwap(slotOpen, slotWriting) {
		return errFenced
	}
	return nil
}

func (s *slotBracket) End() error {
	if s.word.CompareAndSwap(slotWriting, slotOpen) {
		return nil
	}
	s.word.Store(slotClosed) // fencing: the receiver waits for this
	return errFenced
}

// revoke fences the slot and returns once no copy can be in flight.
func (s *slotBracket) revoke() {
	for {
		if s.word.CompareAndSwap(slotOpen, slotClosed) || s.word.Load() == slotClosed {
			return
		}
		if s.word.CompareAndSwap(slotWriting, slotFencing) {
			for s.word.Load() != slotClosed {
				time.Sleep(10 * time.Microsecond)
			}
			return
		}
	}
}

// TestCopyChunkedRevoke: a receiver revokes while a writer copies chunk
// after chunk; what the destination holds when revoke returns is what it
// holds once the writer gave up. The Go fake runs a queued copy only when
// it is waited on, so a bracket closed before its chunk completed would
// let bytes land after the revoke.
func TestCopyChunkedRevoke(t *testing.T) {
	eachDriver(t, func(t *testing.T, name string, drv cuda.Driver) {
		if name == "go" {
			// Slow chunks: a revoke most likely finds one in flight.
			drv = cudafake.New(cudafake.Config{Polls: 100})
		}
		w := openDev(t, drv, "0")
		r := openDev(t, drv, "0")
		const n, chunk = 256 << 10, 4 << 10
		src, _ := w.Alloc(n)
		dst, _ := w.Alloc(n)
		defer w.Free(src) //nolint:errcheck
		defer w.Free(dst) //nolint:errcheck
		_ = w.CopyToDevice(src, bytes.Repeat([]byte{0x5a}, n))
		for round := range 5 {
			_ = w.CopyToDevice(dst, make([]byte, n))
			var slot slotBracket
			done := make(chan uint64, 1) // the writer reports once
			go func() {
				got, _ := w.CopyChunked(context.Background(), dst, src, n, chunk, &slot)
				done <- got
			}()
			time.Sleep(time.Duration(round*200) * time.Microsecond)
			slot.revoke()
			atRevoke := make([]byte, n)
			if err := r.CopyFromDevice(atRevoke, dst); err != nil {
				t.Fatal(err)
			}
			copied := <-done
			after := make([]byte, n)
			_ = r.CopyFromDevice(after, dst)
			if !bytes.Equal(atRevoke, after) {
				t.Fatalf("round %d: bytes landed after revoke returned (writer copied %d)", round, copied)
			}
			if landed := uint64(bytes.IndexByte(append(after, 0), 0)); landed < copied {
				t.Errorf("round %d: %d bytes landed, writer counted %d", round, landed, copied)
			}
		}
	})
}

func TestDeviceConcurrent(t *testing.T) {
	d := openDev(t, cudafake.New(cudafake.Config{}), "0")
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			src := fill(64<<10, byte(i))
			p, err := d.Alloc(uint64(len(src)))
			if err != nil {
				t.Error(err)
				return
			}
			defer d.Free(p) //nolint:errcheck
			got := make([]byte, len(src))
			if err := errors.Join(d.CopyToDevice(p, src), d.CopyFromDevice(got, p)); err != nil || !bytes.Equal(got, src) {
				t.Errorf("worker %d: %v", i, err)
			}
		})
	}
	wg.Wait()
}

// TestImportCache: a child process imports an allocation twice (one open,
// one cache hit), writes through it, then imports a buffer at the same
// base with a new buffer id (the exporter reallocated): the cache reopens.
func TestImportCache(t *testing.T) {
	eachDriver(t, func(t *testing.T, name string, drv cuda.Driver) {
		d := openDev(t, drv, "0")
		const n = 1 << 20
		a, _ := d.Alloc(n)
		b, _ := d.Alloc(n)
		defer d.Free(a) //nolint:errcheck
		defer d.Free(b) //nolint:errcheck
		_ = d.CopyToDevice(a, fill(n, 1))
		_ = d.CopyToDevice(b, fill(n, 2))
		xa, err := d.Export(a)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := d.Export(a + 4096); !errors.Is(err, cuda.ErrInvalidValue) {
			t.Errorf("export of an interior pointer: %v", err)
		}
		xb, _ := d.Export(b)
		if p, err := d.Import(xa); err != nil || p != a {
			t.Errorf("own export imported as %#x, %v; want %#x", p, err, a)
		}
		// The exporter reallocated at a's base: same key, new buffer id.
		xb.Base = xa.Base
		spec, _ := json.Marshal([]cuda.IPCBuffer{xa, xb})
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), childLib+"="+name, devChildEnv+"="+string(spec),
			fmt.Sprintf("CUDATEST_SUMS=%d,%d", crc32.ChecksumIEEE(fill(n, 1)), crc32.ChecksumIEEE(fill(n, 2))))
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("child: %v\n%s", err, out)
		}
		if !strings.Contains(string(out), "opens=2 hits=1") {
			t.Errorf("child's import stats: %s, want opens=2 hits=1", out)
		}
		got := make([]byte, 16)
		_ = d.CopyFromDevice(got, a)
		if !bytes.Equal(got, []byte("written by child")) {
			t.Errorf("the child's write is not in the exporter's memory: %q", got)
		}
	})
}

const devChildEnv = "CUDATEST_DEVCHILD"

// childMain runs TestImportCache's child role when asked, and exits.
func childMain() {
	spec, ok := os.LookupEnv(devChildEnv)
	if !ok {
		return
	}
	if err := importChild(spec); err != nil {
		fmt.Println("child:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func importChild(spec string) error {
	var bufs []cuda.IPCBuffer
	if err := json.Unmarshal([]byte(spec), &bufs); err != nil {
		return err
	}
	var sa, sb uint32
	fmt.Sscanf(os.Getenv("CUDATEST_SUMS"), "%d,%d", &sa, &sb)
	drv, err := openFor(os.Getenv(childLib))()
	if err != nil {
		return err
	}
	d, err := cuda.OpenDevice(drv, "0")
	if err != nil {
		return err
	}
	defer d.Close()
	n := int(bufs[0].Size)
	sum := func(p cuda.DevicePtr) uint32 {
		b := make([]byte, n)
		if err := d.CopyFromDevice(b, p); err != nil {
			return 0
		}
		return crc32.ChecksumIEEE(b)
	}
	p1, err := d.Import(bufs[0])
	if err != nil {
		return err
	}
	p2, err := d.Import(bufs[0])
	if err != nil {
		return err
	}
	if p1 != p2 || sum(p1) != sa {
		return fmt.Errorf("cached import %#x vs %#x, or bad bytes", p1, p2)
	}
	if err := d.CopyToDevice(p1, []byte("written by child")); err != nil {
		return err
	}
	p3, err := d.Import(bufs[1])
	if err != nil {
		return err
	}
	if sum(p3) != sb {
		return errors.New("import after the buffer id changed reads the old allocation")
	}
	opens, hits := d.ImportStats()
	fmt.Printf("opens=%d hits=%d\n", opens, hits)
	return d.ForgetPeer(bufs[0].PID)
}

func TestVisibleDevices(t *testing.T) {
	fake := cudafake.New(cudafake.Config{Devices: 3})
	us, err := cuda.VisibleDevices(fake)
	if err != nil || len(us) != 3 {
		t.Fatalf("%v, %v", us, err)
	}
	d := openDev(t, fake, "2")
	if us[2] != d.UUID() {
		t.Errorf("device 2 is %s, VisibleDevices says %s", d.UUID(), us[2])
	}
	if _, err := cuda.VisibleDevices(cudafake.New(cudafake.Config{NoDevice: true})); !errors.Is(err, cuda.ErrNoDriver) {
		t.Errorf("no device: %v", err)
	}
}
