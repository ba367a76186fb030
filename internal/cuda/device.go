package cuda

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Device runs driver calls for one device on one goroutine locked to its
// OS thread, with the device's primary context current on that thread. It
// owns a non-blocking stream for its asynchronous copies and the IPC
// mappings it opened. All methods are safe for concurrent use; they queue
// work to the executor goroutine and wait for it.
type Device struct {
	drv     Driver
	ordinal int
	uuid    UUID
	pid     int // the process the driver runs in (processID)

	jobs chan func()   // unbuffered: a job is handed over only when the executor takes it
	quit chan struct{} // closed by Close
	done chan struct{} // closed when the executor has released everything
	once sync.Once
	err  error // the executor's release error, read after done

	// Executor-owned state: touched only by jobs.
	dev    Dev
	stream Stream
	events []Event // idle events, reused: creating one per copy costs a driver call

	// The IPC import cache, guarded by mu: mappings are opened and closed
	// only by jobs; Import's fast path reads it without the executor (a
	// hit needs no driver call).
	mu      sync.Mutex
	imports map[importKey]*mapping
	opens   int // IPC handles opened (cache misses)
	hits    int // Import answered from the cache
	// handles are the IPC handles open in this process, each opened once
	// (the driver refuses a second open of a handle in one process) and
	// shared by OpenIPC's arenas and Import's mappings: closed when the
	// last of them lets go.
	handles map[IpcMemHandle]*handleRef
	// peers counts, per exporter pid, the users of Import's mappings of
	// that process's allocations (RetainPeer); the last ReleasePeer
	// closes them.
	peers map[int]int
}

// OpenDevice starts the executor for the device sel names: a CUDA ordinal
// ("0", "" meaning 0) or a UUID as nvidia-smi prints it ("GPU-…"; stable
// under CUDA_VISIBLE_DEVICES renumbering). It calls cuInit, retains the
// primary context and makes it current on the executor's thread.
func OpenDevice(drv Driver, sel string) (*Device, error) {
	d := &Device{
		drv:     drv,
		pid:     processID(drv),
		jobs:    make(chan func()),
		quit:    make(chan struct{}),
		done:    make(chan struct{}),
		imports: map[importKey]*mapping{},
		handles: map[IpcMemHandle]*handleRef{},
		peers:   map[int]int{},
	}
	ready := make(chan error, 1) // the executor reports once and never waits on it
	go d.run(sel, ready)
	if err := <-ready; err != nil {
		<-d.done
		return nil, err
	}
	return d, nil
}

// run is the executor goroutine. It never unlocks its thread: a thread
// that had a context current ends with the goroutine.
func (d *Device) run(sel string, ready chan<- error) {
	defer close(d.done)
	runtime.LockOSThread()
	if err := d.setup(sel); err != nil {
		ready <- err
		return
	}
	ready <- nil
	for {
		select {
		case job := <-d.jobs:
			job()
		case <-d.quit:
			d.err = d.teardown()
			return
		}
	}
}

func (d *Device) setup(sel string) error {
	drv := d.drv
	if err := drv.Init(0); err != nil {
		return err
	}
	n, err := drv.DeviceGetCount()
	if err != nil {
		return err
	}
	d.ordinal = -1
	if sel == "" {
		sel = "0"
	}
	if i, err := strconv.Atoi(sel); err == nil {
		if i < 0 || i >= n {
			return fmt.Errorf("%w: device %d of %d", ErrInvalidDevice, i, n)
		}
		d.ordinal = i
	} else {
		want, err := ParseUUID(sel)
		if err != nil {
			return err
		}
		for i := range n {
			dv, err := drv.DeviceGet(i)
			if err != nil {
				return err
			}
			u, err := drv.DeviceGetUUID(dv)
			if err != nil {
				return err
			}
			if u == want {
				d.ordinal = i
				break
			}
		}
		if d.ordinal < 0 {
			return fmt.Errorf("%w: no device %s among %d", ErrInvalidDevice, strings.ToUpper(sel), n)
		}
	}
	if d.dev, err = drv.DeviceGet(d.ordinal); err != nil {
		return err
	}
	if d.uuid, err = drv.DeviceGetUUID(d.dev); err != nil {
		return err
	}
	ctx, err := drv.DevicePrimaryCtxRetain(d.dev)
	if err != nil {
		return err
	}
	if err := drv.CtxSetCurrent(ctx); err != nil {
		return errors.Join(err, drv.DevicePrimaryCtxRelease(d.dev))
	}
	if d.stream, err = drv.StreamCreate(StreamNonBlocking); err != nil {
		return errors.Join(err, drv.CtxSetCurrent(0), drv.DevicePrimaryCtxRelease(d.dev))
	}
	return nil
}

func (d *Device) teardown() error {
	var errs []error
	errs = append(errs, d.drv.StreamSynchronize(d.stream))
	for _, ev := range d.events {
		errs = append(errs, d.drv.EventDestroy(ev))
	}
	d.events = nil
	d.takeImports(func(importKey) bool { return true })
	d.mu.Lock()
	hs := d.handles
	d.handles = map[IpcMemHandle]*handleRef{}
	d.mu.Unlock()
	for _, h := range hs {
		errs = append(errs, d.drv.IpcCloseMemHandle(h.ptr))
	}
	errs = append(errs,
		d.drv.StreamDestroy(d.stream),
		d.drv.CtxSetCurrent(0),
		d.drv.DevicePrimaryCtxRelease(d.dev))
	return errors.Join(errs...)
}

// Close closes the IPC mappings this device opened, releases the primary
// context and stops the executor. Memory allocated through the device must
// be freed first (releasing the last reference to the primary context
// frees whatever is left). Close is idempotent; calls after it return
// ErrClosed.
func (d *Device) Close() error {
	d.once.Do(func() { close(d.quit) })
	<-d.done
	return d.err
}

// Do runs fn on the executor thread, with the context current, and returns
// its error. fn must not call methods of d (they would wait on the
// executor that runs fn).
func (d *Device) Do(fn func(Driver) error) error {
	res := make(chan error, 1) // the executor never blocks on its answer
	select {
	case d.jobs <- func() { res <- fn(d.drv) }:
		return <-res
	case <-d.quit:
		return ErrClosed
	}
}

// Ordinal returns the device's CUDA ordinal in this process.
func (d *Device) Ordinal() int { return d.ordinal }

// UUID returns the device's UUID.
func (d *Device) UUID() UUID { return d.uuid }

// Alloc allocates size bytes of device memory (cuMemAlloc: an allocation of
// its own, so it can be exported by CUDA IPC).
func (d *Device) Alloc(size uint64) (DevicePtr, error) {
	var p DevicePtr
	err := d.Do(func(drv Driver) (err error) {
		p, err = drv.MemAlloc(size)
		return err
	})
	return p, err
}

// Free frees an allocation from Alloc.
func (d *Device) Free(p DevicePtr) error {
	return d.Do(func(drv Driver) error { return drv.MemFree(p) })
}

// CopyToDevice copies src to dst and returns when the bytes are there.
func (d *Device) CopyToDevice(dst DevicePtr, src []byte) error {
	return d.Do(func(drv Driver) error { return drv.MemcpyHtoD(dst, src) })
}

// CopyFromDevice copies len(dst) bytes from src and returns when they are
// in dst.
func (d *Device) CopyFromDevice(dst []byte, src DevicePtr) error {
	return d.Do(func(drv Driver) error { return drv.MemcpyDtoH(dst, src) })
}

// Pinned is page-locked host memory from cuMemHostAlloc (portable: usable
// from every context). It is outside the Go heap, so an asynchronous copy
// may use it after the call that queued it returned.
type Pinned struct {
	d   *Device
	ptr HostPtr
	b   []byte
}

// AllocPinned allocates size bytes of pinned host memory.
func (d *Device) AllocPinned(size uint64) (*Pinned, error) {
	var p HostPtr
	err := d.Do(func(drv Driver) (err error) {
		p, err = drv.MemHostAlloc(size, MemHostAllocPortable)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &Pinned{d: d, ptr: p, b: hostBytes(p, size)}, nil
}

// Bytes returns the memory; valid until Free.
func (p *Pinned) Bytes() []byte { return p.b }

// Ptr returns the address for asynchronous copies.
func (p *Pinned) Ptr() HostPtr { return p.ptr }

// Free frees the memory; it waits for copies in flight that use it.
func (p *Pinned) Free() error {
	err := p.d.Do(func(drv Driver) error { return drv.MemFreeHost(p.ptr) })
	p.b = nil
	return err
}

// Copy is one asynchronous copy queued on the device's stream, with the
// event recorded after it. Copies complete in the order they were queued.
type Copy struct {
	d  *Device
	ev Event
}

// SubmitDtoD queues a copy of n bytes from src to dst (an opened IPC
// mapping included) on the device's non-blocking stream and records an
// event after it. The caller must Wait on the returned Copy exactly once.
func (d *Device) SubmitDtoD(dst, src DevicePtr, n uint64) (*Copy, error) {
	return d.submit(func(drv Driver) error { return drv.MemcpyDtoDAsync(dst, src, n, d.stream) })
}

// SubmitDtoH is SubmitDtoD from the device into pinned host memory.
func (d *Device) SubmitDtoH(dst HostPtr, src DevicePtr, n uint64) (*Copy, error) {
	return d.submit(func(drv Driver) error { return drv.MemcpyDtoHAsync(dst, src, n, d.stream) })
}

// SubmitHtoD is SubmitDtoD from pinned host memory into the device.
func (d *Device) SubmitHtoD(dst DevicePtr, src HostPtr, n uint64) (*Copy, error) {
	return d.submit(func(drv Driver) error { return drv.MemcpyHtoDAsync(dst, src, n, d.stream) })
}

func (d *Device) submit(queue func(Driver) error) (*Copy, error) {
	c := &Copy{d: d}
	err := d.Do(func(drv Driver) (err error) {
		c.ev, err = d.enqueue(drv, queue)
		return err
	})
	if err != nil {
		return nil, err
	}
	return c, nil
}

// enqueue queues a copy and records an idle event after it; on the
// executor.
func (d *Device) enqueue(drv Driver, queue func(Driver) error) (Event, error) {
	if err := queue(drv); err != nil {
		return 0, err
	}
	var ev Event
	if n := len(d.events); n > 0 {
		ev, d.events = d.events[n-1], d.events[:n-1]
	} else {
		var err error
		if ev, err = drv.EventCreate(EventDisableTiming); err != nil {
			return 0, errors.Join(err, drv.StreamSynchronize(d.stream))
		}
	}
	if err := drv.EventRecord(ev, d.stream); err != nil {
		return 0, errors.Join(err, drv.StreamSynchronize(d.stream), drv.EventDestroy(ev))
	}
	return ev, nil
}

// poll queries ev for up to limit; done reports whether the work before
// it completed (then ev is idle again and back in the pool). On the
// executor.
func (d *Device) poll(drv Driver, ev Event, limit time.Duration) (done bool, err error) {
	for start := time.Now(); ; {
		err := drv.EventQuery(ev)
		if !errors.Is(err, ErrNotReady) {
			if err != nil {
				return true, errors.Join(err, drv.EventDestroy(ev))
			}
			d.events = append(d.events, ev)
			return true, nil
		}
		if time.Since(start) > limit {
			return false, nil
		}
	}
}

// spin is how long one executor job polls an event before it hands the
// thread back to other jobs: a 4 MiB chunk takes a few microseconds
// device-local and tens over PCIe, so most waits end within one job.
const spin = 20 * time.Microsecond

// Wait polls the copy's event until the copy is done (a copy cannot be
// recalled, so Wait takes no context: a chunk is bounded work) and
// releases the event. It returns the copy's error, if any.
func (c *Copy) Wait() error {
	for backoff := time.Microsecond; ; {
		var done bool
		err := c.d.Do(func(drv Driver) (err error) {
			done, err = c.d.poll(drv, c.ev, spin)
			return err
		})
		if done || err != nil {
			return err
		}
		time.Sleep(backoff)
		backoff = min(2*backoff, 200*time.Microsecond)
	}
}

// Bracket fences a chunked copy as rdma's shm transport fences a writer's
// copies: Begin is called before each chunk is queued and must win the
// right to copy (once the receiver fenced, it fails); End is called once
// that chunk has completed on the device and fails when the receiver began
// a fence meanwhile (the receiver waits for that End before its revoke
// returns). So at most one chunk is in flight inside a bracket, and no
// byte lands after the fence's wait is over.
type Bracket interface {
	Begin() error
	End() error
}

// slice is how long one CopyChunked job keeps the executor before it lets
// other callers' jobs run.
const slice = time.Millisecond

// CopyChunked copies n bytes from src to dst (device memory, or an opened
// IPC mapping) in chunks of at most chunk bytes (0: 4 MiB), each queued on
// the device's stream and waited on before the next. Before each chunk it
// checks ctx, and when b is not nil each chunk runs inside b's bracket.
// Begin and End run on the executor's thread and must not call d. It
// returns the bytes copied; a chunk whose End failed counts (its bytes
// landed inside the bracket).
//
// The chunks run on the executor back to back, up to a millisecond per
// job, polling each chunk's event there: a device-local chunk takes
// microseconds, less than a hand-off to the executor costs.
func (d *Device) CopyChunked(ctx context.Context, dst, src DevicePtr, n, chunk uint64, b Bracket) (uint64, error) {
	if chunk == 0 {
		chunk = 4 << 20
	}
	var off uint64
	for off < n {
		err := d.Do(func(drv Driver) error {
			for start := time.Now(); off < n && time.Since(start) < slice; {
				if err := ctx.Err(); err != nil {
					return err
				}
				if b != nil {
					if err := b.Begin(); err != nil {
						return err
					}
				}
				m := min(chunk, n-off)
				err := d.copyChunk(drv, dst+DevicePtr(off), src+DevicePtr(off), m)
				if b != nil {
					// End even after a failed copy: the bracket must close.
					err = errors.Join(err, b.End())
				}
				if err != nil {
					return err
				}
				off += m
			}
			return nil
		})
		if err != nil {
			return off, err
		}
	}
	return off, nil
}

// copyChunk queues one DtoD copy and polls until it is done; on the
// executor.
func (d *Device) copyChunk(drv Driver, dst, src DevicePtr, n uint64) error {
	ev, err := d.enqueue(drv, func(drv Driver) error { return drv.MemcpyDtoDAsync(dst, src, n, d.stream) })
	if err != nil {
		return err
	}
	for {
		done, err := d.poll(drv, ev, spin)
		if done {
			return err
		}
		runtime.Gosched()
	}
}
