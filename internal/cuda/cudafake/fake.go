//go:build linux

// Package cudafake is a CUDA driver in Go over host memory, for tests on
// machines without a GPU. It implements cuda.Driver with the real driver's
// rules and error codes, so code that breaks a rule fails here as it
// would on a GPU:
//
//   - cuInit first (CUDA_ERROR_NOT_INITIALIZED), a device ordinal that
//     exists (CUDA_ERROR_INVALID_DEVICE);
//   - a context current on the calling OS thread (it keys contexts by
//     gettid, as the driver keys them by thread): memory, copy, stream,
//     event and IPC calls without one fail with CUDA_ERROR_INVALID_CONTEXT;
//   - device pointers are addresses in a fake device address space, never
//     host addresses; a pointer that is not inside a live allocation, or a
//     free of a non-base or freed pointer (double free), is
//     CUDA_ERROR_INVALID_VALUE;
//   - asynchronous copies run only when the program waits for them (an
//     event's query after Config.Polls NOT_READY answers, a stream
//     synchronisation, a free; a synchronous copy waits only for blocking
//     streams, not for CU_STREAM_NON_BLOCKING ones): code that reads before
//     it waited sees old bytes; their host side must be pinned memory from
//     MemHostAlloc (this module's rule: never the Go heap);
//   - IPC: a handle names an allocation's base; "device memory" is a memfd,
//     so another process opens the handle (through /proc/PID/fd) and sees
//     the same bytes. Opening it in the exporting process is
//     CUDA_ERROR_INVALID_CONTEXT, opening it twice in one process
//     CUDA_ERROR_ALREADY_MAPPED, a handle whose exporter freed the
//     allocation or exited CUDA_ERROR_MAP_FAILED;
//   - virtual memory management (cuMemCreate and the calls around it, POSIX
//     fd handles only): the granularity is 2 MiB on every device, and
//     handle sizes, reservations and mappings are non-zero multiples of it
//     (CUDA_ERROR_INVALID_VALUE); a handle's memory is a memfd named
//     fakecuda-vmm-<device uuid> and counts against Config.MemLimit. An
//     export is a duplicate of that memfd, so another process imports it
//     and sees the same bytes; an fd that is not such an export, or an
//     unknown or released handle, is CUDA_ERROR_INVALID_VALUE. A mapping
//     lies inside one reservation, overlaps no other, maps its handle from
//     the start, and is unmapped exactly as it was made; a reservation is
//     freed exactly as it was made and only with nothing mapped in it
//     (CUDA_ERROR_INVALID_VALUE). Memory lives until its handles are
//     released and its mappings unmapped. A mapping is device memory to the
//     copies, cuPointerGetAttribute and cuMemGetAddressRange (which answers
//     the mapping's range), but a copy touching it before cuMemSetAccess
//     covered it is CUDA_ERROR_INVALID_VALUE (access granted to any device
//     opens it to every context), and cuMemFree and cuIpcGetMemHandle
//     refuse it (CUDA_ERROR_INVALID_VALUE: legacy IPC cannot export VMM
//     memory);
//   - releasing a primary context's last reference frees its memory: its
//     allocations, and the VMM handles, reservations and mappings made
//     while it was current.
//
// Config.Stub makes every call fail with CUDA_ERROR_STUB_LIBRARY, as the
// toolkit's stub libcuda.so does; Config.NoDevice is a driver without a
// device (cuInit: CUDA_ERROR_NO_DEVICE).
package cudafake

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"os"
	"sort"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/handoff-io/handoff/internal/cuda"
)

// Config shapes a fake driver.
type Config struct {
	// Devices is the number of devices (0: 1), with UUIDs derived from
	// their ordinals.
	Devices int
	// NoDevice is a driver that sees no device: cuInit answers
	// CUDA_ERROR_NO_DEVICE.
	NoDevice bool
	// MemLimit caps each device's allocations in bytes (0: 1 GiB).
	MemLimit uint64
	// Polls is how many times cuEventQuery answers NOT_READY before the
	// copies recorded before the event run (0: 1).
	Polls int
	// Stub answers every call with CUDA_ERROR_STUB_LIBRARY.
	Stub bool
	// Version is what cuDriverGetVersion reports (0: 12060).
	Version int
	// PID is the process id the driver takes itself to run in (0:
	// os.Getpid()): a second fake in one process with another PID opens
	// the first one's IPC handles as another process would, where the
	// first would refuse its own.
	PID int
}

// Stats counts what is live, for leak checks.
type Stats struct {
	Allocs, Pinned, Imports, Streams, Events int
	// Pending counts queued asynchronous copies nobody waited for yet.
	Pending int
	// Retained counts primary-context references per device.
	Retained []int
	// Handles, Reserved and Mapped count live VMM handles, address
	// reservations and mappings.
	Handles, Reserved, Mapped int
}

// Driver is the fake. It is safe for concurrent use.
type Driver struct {
	cfg Config
	pid int

	mu       sync.Mutex
	inited   bool
	devs     []*device
	current  map[int]cuda.Context // by thread id
	allocs   []*alloc             // sorted by base; owned and imported
	nextAddr uint64
	nextBuf  uint64
	pinned   map[uintptr][]byte
	streams  map[cuda.Stream]*stream
	events   map[cuda.Event]*event
	nextH    uintptr
	handles  map[cuda.MemHandle]*vhandle
	reserved []*vrange
}

type device struct {
	uuid     cuda.UUID
	retained int
	ctx      cuda.Context // 0 while the primary context is inactive
	used     uint64
}

type alloc struct {
	base, size uint64
	dev        int // of the context that allocated or opened it
	// on is the device the memory is on: dev, or for an import the
	// exporter's device where this process sees it (peer access).
	on       int
	mem      []byte // mmap of fd
	fd       int
	inode    uint64
	bufferID uint64
	imported bool   // opened from another process's handle
	key      string // imported: exporter pid/inode, for ALREADY_MAPPED
}

type op struct {
	run func()
}

type stream struct {
	ctx         cuda.Context
	nonBlocking bool // CU_STREAM_NON_BLOCKING: the legacy stream does not wait for it
	pending     []op
}

type event struct {
	ctx     cuda.Context
	s       *stream
	upto    int // ops of s to run for the event to complete; -1: never recorded
	polls   int
	done    bool
	pending bool
}

// New returns a fake driver.
func New(cfg Config) *Driver {
	if cfg.Devices <= 0 {
		cfg.Devices = 1
	}
	if cfg.NoDevice {
		cfg.Devices = 0
	}
	if cfg.MemLimit == 0 {
		cfg.MemLimit = 1 << 30
	}
	if cfg.Polls == 0 {
		cfg.Polls = 1
	}
	if cfg.Version == 0 {
		cfg.Version = 12060
	}
	d := &Driver{
		cfg:      cfg,
		pid:      cmp.Or(cfg.PID, os.Getpid()),
		current:  map[int]cuda.Context{},
		nextAddr: 0x3000_0000_0000 + uint64(os.Getpid()%4096)<<32,
		pinned:   map[uintptr][]byte{},
		streams:  map[cuda.Stream]*stream{},
		events:   map[cuda.Event]*event{},
		nextH:    0x5000,
		handles:  map[cuda.MemHandle]*vhandle{},
	}
	for i := range cfg.Devices {
		var u cuda.UUID
		copy(u[:], "fakecuda")
		binary.LittleEndian.PutUint32(u[8:], uint32(i))
		binary.LittleEndian.PutUint32(u[12:], 0x600d)
		d.devs = append(d.devs, &device{uuid: u})
	}
	return d
}

var _ cuda.Driver = (*Driver)(nil)

// ProcessID is the process the driver takes itself to run in
// (Config.PID): a cuda.Device over it exports and imports as that process.
func (d *Driver) ProcessID() int { return d.pid }

// Stats returns what is live.
func (d *Driver) Stats() Stats {
	d.mu.Lock()
	defer d.mu.Unlock()
	var s Stats
	for _, a := range d.allocs {
		if a.imported {
			s.Imports++
		} else {
			s.Allocs++
		}
	}
	s.Pinned = len(d.pinned)
	s.Streams = len(d.streams)
	for _, st := range d.streams {
		s.Pending += len(st.pending)
	}
	s.Events = len(d.events)
	for _, dv := range d.devs {
		s.Retained = append(s.Retained, dv.retained)
	}
	s.Handles = len(d.handles)
	s.Reserved = len(d.reserved)
	for _, r := range d.reserved {
		s.Mapped += len(r.maps)
	}
	return s
}

func fail(call string, r cuda.Result) error { return cuda.Check(call, r) }

// enter takes the lock and checks stub and initialisation.
func (d *Driver) enter(call string) error {
	d.mu.Lock()
	if d.cfg.Stub {
		d.mu.Unlock()
		return fail(call, cuda.ErrorStubLibrary)
	}
	if !d.inited {
		d.mu.Unlock()
		return fail(call, cuda.ErrorNotInitialized)
	}
	return nil
}

// ctxDev returns the device of the calling thread's current context.
func (d *Driver) ctxDev(call string) (int, error) {
	c := d.current[unix.Gettid()]
	if c == 0 {
		return -1, fail(call, cuda.ErrorInvalidContext)
	}
	for i, dv := range d.devs {
		if dv.ctx == c {
			return i, nil
		}
	}
	return -1, fail(call, cuda.ErrorCtxIsDestroyed)
}

// enterCtx is enter plus a current context.
func (d *Driver) enterCtx(call string) (int, error) {
	if err := d.enter(call); err != nil {
		return -1, err
	}
	dev, err := d.ctxDev(call)
	if err != nil {
		d.mu.Unlock()
	}
	return dev, err
}

func (d *Driver) Init(flags uint32) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case d.cfg.Stub:
		return fail("cuInit", cuda.ErrorStubLibrary)
	case flags != 0:
		return fail("cuInit", cuda.ErrorInvalidValue)
	case len(d.devs) == 0:
		return fail("cuInit", cuda.ErrorNoDevice)
	}
	d.inited = true
	return nil
}

func (d *Driver) DriverGetVersion() (int, error) {
	if d.cfg.Stub {
		return 0, fail("cuDriverGetVersion", cuda.ErrorStubLibrary)
	}
	return d.cfg.Version, nil
}

func (d *Driver) DeviceGetCount() (int, error) {
	if err := d.enter("cuDeviceGetCount"); err != nil {
		return 0, err
	}
	defer d.mu.Unlock()
	return len(d.devs), nil
}

func (d *Driver) DeviceGet(ordinal int) (cuda.Dev, error) {
	if err := d.enter("cuDeviceGet"); err != nil {
		return 0, err
	}
	defer d.mu.Unlock()
	if ordinal < 0 || ordinal >= len(d.devs) {
		return 0, fail("cuDeviceGet", cuda.ErrorInvalidDevice)
	}
	return cuda.Dev(ordinal), nil
}

func (d *Driver) dev(call string, dv cuda.Dev) (*device, error) {
	if dv < 0 || int(dv) >= len(d.devs) {
		return nil, fail(call, cuda.ErrorInvalidDevice)
	}
	return d.devs[dv], nil
}

func (d *Driver) DeviceGetUUID(dv cuda.Dev) (cuda.UUID, error) {
	if err := d.enter("cuDeviceGetUuid_v2"); err != nil {
		return cuda.UUID{}, err
	}
	defer d.mu.Unlock()
	x, err := d.dev("cuDeviceGetUuid_v2", dv)
	if err != nil {
		return cuda.UUID{}, err
	}
	return x.uuid, nil
}

func (d *Driver) DeviceGetAttribute(attr cuda.DeviceAttribute, dv cuda.Dev) (int, error) {
	if err := d.enter("cuDeviceGetAttribute"); err != nil {
		return 0, err
	}
	defer d.mu.Unlock()
	if _, err := d.dev("cuDeviceGetAttribute", dv); err != nil {
		return 0, err
	}
	switch attr {
	case cuda.DeviceAttributeUnifiedAddressing:
		return 1, nil
	case cuda.DeviceAttributeDMABufSupported:
		return 0, nil
	case cuda.DeviceAttributePCIBusID:
		return 0x18 + int(dv), nil
	case cuda.DeviceAttributePCIDeviceID, cuda.DeviceAttributePCIDomainID:
		return 0, nil
	}
	return 0, fail("cuDeviceGetAttribute", cuda.ErrorInvalidValue)
}

func (d *Driver) DevicePrimaryCtxRetain(dv cuda.Dev) (cuda.Context, error) {
	if err := d.enter("cuDevicePrimaryCtxRetain"); err != nil {
		return 0, err
	}
	defer d.mu.Unlock()
	x, err := d.dev("cuDevicePrimaryCtxRetain", dv)
	if err != nil {
		return 0, err
	}
	if x.ctx == 0 {
		d.nextH += 0x10
		x.ctx = cuda.Context(d.nextH)
	}
	x.retained++
	return x.ctx, nil
}

func (d *Driver) DevicePrimaryCtxRelease(dv cuda.Dev) error {
	const call = "cuDevicePrimaryCtxRelease_v2"
	if err := d.enter(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	x, err := d.dev(call, dv)
	if err != nil {
		return err
	}
	if x.retained == 0 {
		return fail(call, cuda.ErrorInvalidContext)
	}
	x.retained--
	if x.retained > 0 {
		return nil
	}
	// The last reference: the context and everything in it go.
	ctx := x.ctx
	x.ctx = 0
	for h, s := range d.streams {
		if s.ctx == ctx {
			delete(d.streams, h)
		}
	}
	for h, e := range d.events {
		if e.ctx == ctx {
			delete(d.events, h)
		}
	}
	kept := d.allocs[:0]
	for _, a := range d.allocs {
		if a.dev == int(dv) {
			if !a.imported {
				d.devs[a.on].used -= a.size
			}
			d.release(a)
			continue
		}
		kept = append(kept, a)
	}
	clear(d.allocs[len(kept):])
	d.allocs = kept
	d.releaseVMM(int(dv))
	// Pinned host memory belongs to a context too (portable memory to all
	// of them; this fake's devices share one release point per device).
	if d.liveContexts() == 0 {
		for p, mem := range d.pinned {
			_ = unix.Munmap(mem)
			delete(d.pinned, p)
		}
	}
	return nil
}

// liveContexts counts devices whose primary context is active.
func (d *Driver) liveContexts() int {
	n := 0
	for _, dv := range d.devs {
		if dv.ctx != 0 {
			n++
		}
	}
	return n
}

func (d *Driver) CtxSetCurrent(c cuda.Context) error {
	if err := d.enter("cuCtxSetCurrent"); err != nil {
		return err
	}
	defer d.mu.Unlock()
	tid := unix.Gettid()
	if c == 0 {
		delete(d.current, tid)
		return nil
	}
	for _, dv := range d.devs {
		if dv.ctx == c {
			d.current[tid] = c
			return nil
		}
	}
	return fail("cuCtxSetCurrent", cuda.ErrorInvalidContext)
}

func (d *Driver) CtxGetCurrent() (cuda.Context, error) {
	if err := d.enter("cuCtxGetCurrent"); err != nil {
		return 0, err
	}
	defer d.mu.Unlock()
	return d.current[unix.Gettid()], nil
}

// find returns the allocation holding [p, p+n), or nil.
func (d *Driver) find(p, n uint64) *alloc {
	i := sort.Search(len(d.allocs), func(i int) bool { return d.allocs[i].base+d.allocs[i].size > p })
	if i == len(d.allocs) {
		return nil
	}
	a := d.allocs[i]
	if p < a.base || n > a.base+a.size-p {
		return nil
	}
	return a
}

func (d *Driver) insert(a *alloc) {
	i := sort.Search(len(d.allocs), func(i int) bool { return d.allocs[i].base > a.base })
	d.allocs = append(d.allocs, nil)
	copy(d.allocs[i+1:], d.allocs[i:])
	d.allocs[i] = a
}

func (d *Driver) remove(a *alloc) {
	for i, x := range d.allocs {
		if x == a {
			d.allocs = append(d.allocs[:i], d.allocs[i+1:]...)
			return
		}
	}
}

func (d *Driver) release(a *alloc) {
	_ = unix.Munmap(a.mem)
	if a.fd >= 0 {
		_ = unix.Close(a.fd)
	}
}

// reserve hands out size bytes of fake device address space, 2 MiB
// aligned as cuMemAlloc's large allocations are.
func (d *Driver) reserve(size uint64) uint64 {
	const align = 2 << 20
	base := d.nextAddr
	d.nextAddr += (size + align - 1) &^ (align - 1)
	d.nextAddr += align // a guard gap: an overrun is an invalid address
	return base
}

func (d *Driver) MemAlloc(size uint64) (cuda.DevicePtr, error) {
	const call = "cuMemAlloc_v2"
	dev, err := d.enterCtx(call)
	if err != nil {
		return 0, err
	}
	defer d.mu.Unlock()
	if size == 0 {
		return 0, fail(call, cuda.ErrorInvalidValue)
	}
	x := d.devs[dev]
	if size > d.cfg.MemLimit-x.used {
		return 0, fail(call, cuda.ErrorOutOfMemory)
	}
	fd, err := unix.MemfdCreate("fakecuda", unix.MFD_CLOEXEC)
	if err != nil {
		return 0, fail(call, cuda.ErrorOutOfMemory)
	}
	page := uint64(os.Getpagesize())
	mapped := (size + page - 1) &^ (page - 1)
	if err := unix.Ftruncate(fd, int64(mapped)); err != nil {
		unix.Close(fd)
		return 0, fail(call, cuda.ErrorOutOfMemory)
	}
	mem, err := unix.Mmap(fd, 0, int(mapped), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return 0, fail(call, cuda.ErrorOutOfMemory)
	}
	var st unix.Stat_t
	_ = unix.Fstat(fd, &st)
	d.nextBuf++
	a := &alloc{base: d.reserve(size), size: size, dev: dev, on: dev, mem: mem[:size], fd: fd, inode: st.Ino, bufferID: d.nextBuf}
	d.insert(a)
	x.used += size
	return cuda.DevicePtr(a.base), nil
}

func (d *Driver) MemFree(p cuda.DevicePtr) error {
	const call = "cuMemFree_v2"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	a := d.find(uint64(p), 1)
	if a == nil || a.base != uint64(p) || a.imported {
		return fail(call, cuda.ErrorInvalidValue)
	}
	d.drainAll() // cuMemFree waits for work in flight
	d.remove(a)
	d.devs[a.dev].used -= a.size
	d.release(a)
	return nil
}

func (d *Driver) MemGetAddressRange(p cuda.DevicePtr) (cuda.DevicePtr, uint64, error) {
	const call = "cuMemGetAddressRange_v2"
	if _, err := d.enterCtx(call); err != nil {
		return 0, 0, err
	}
	defer d.mu.Unlock()
	if a := d.find(uint64(p), 1); a != nil {
		return cuda.DevicePtr(a.base), a.size, nil
	}
	if _, m := d.vmapAt(uint64(p)); m != nil {
		return cuda.DevicePtr(m.base), m.size, nil
	}
	return 0, 0, fail(call, cuda.ErrorNotFound)
}

func (d *Driver) MemHostAlloc(size uint64, flags uint32) (cuda.HostPtr, error) {
	const call = "cuMemHostAlloc"
	if _, err := d.enterCtx(call); err != nil {
		return nil, err
	}
	defer d.mu.Unlock()
	if size == 0 || flags&^uint32(0xf) != 0 {
		return nil, fail(call, cuda.ErrorInvalidValue)
	}
	mem, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fail(call, cuda.ErrorOutOfMemory)
	}
	p := cuda.HostPtr(unsafe.Pointer(unsafe.SliceData(mem)))
	d.pinned[uintptr(p)] = mem
	return p, nil
}

func (d *Driver) MemFreeHost(p cuda.HostPtr) error {
	const call = "cuMemFreeHost"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	mem, ok := d.pinned[uintptr(p)]
	if !ok {
		return fail(call, cuda.ErrorInvalidValue)
	}
	d.drainAll()
	delete(d.pinned, uintptr(p))
	_ = unix.Munmap(mem)
	return nil
}

// host returns the pinned bytes [p, p+n), or nil.
func (d *Driver) host(p cuda.HostPtr, n uint64) []byte {
	a := uintptr(p)
	for base, mem := range d.pinned {
		if a >= base && uint64(a-base) <= uint64(len(mem)) && n <= uint64(len(mem))-uint64(a-base) {
			off := uint64(a - base)
			return mem[off : off+n]
		}
	}
	return nil
}

func (d *Driver) PointerGetAttribute(attr cuda.PointerAttribute, p cuda.DevicePtr) (uint64, error) {
	const call = "cuPointerGetAttribute"
	if _, err := d.enterCtx(call); err != nil {
		return 0, err
	}
	defer d.mu.Unlock()
	var bufferID uint64
	var on int
	if a := d.find(uint64(p), 1); a != nil {
		bufferID, on = a.bufferID, a.on
	} else if _, m := d.vmapAt(uint64(p)); m != nil {
		bufferID, on = m.bufferID, m.m.on
	} else {
		return 0, fail(call, cuda.ErrorInvalidValue)
	}
	switch attr {
	case cuda.PointerAttributeBufferID:
		return bufferID, nil
	case cuda.PointerAttributeDeviceOrdinal:
		return uint64(on), nil
	}
	return 0, fail(call, cuda.ErrorInvalidValue)
}

// dbytes returns device bytes [p, p+n) or nil: of one allocation, or of
// VMM mappings in one reservation, every byte mapped and accessible.
func (d *Driver) dbytes(p cuda.DevicePtr, n uint64) []byte {
	a := d.find(uint64(p), n)
	if a == nil {
		return d.vbytes(uint64(p), n)
	}
	off := uint64(p) - a.base
	return a.mem[off : off+n]
}

func (d *Driver) MemcpyHtoD(dst cuda.DevicePtr, src []byte) error {
	const call = "cuMemcpyHtoD_v2"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	if len(src) == 0 {
		return nil
	}
	b := d.dbytes(dst, uint64(len(src)))
	if b == nil {
		return fail(call, cuda.ErrorInvalidValue)
	}
	d.drainBlocking() // a synchronous copy waits for blocking streams only
	copy(b, src)
	return nil
}

func (d *Driver) MemcpyDtoH(dst []byte, src cuda.DevicePtr) error {
	const call = "cuMemcpyDtoH_v2"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	if len(dst) == 0 {
		return nil
	}
	b := d.dbytes(src, uint64(len(dst)))
	if b == nil {
		return fail(call, cuda.ErrorInvalidValue)
	}
	d.drainBlocking()
	copy(dst, b)
	return nil
}

// enqueue checks s and appends a copy to it.
func (d *Driver) enqueue(call string, s cuda.Stream, dst, src func() []byte) error {
	var st *stream
	if s != 0 {
		st = d.streams[s]
		if st == nil {
			return fail(call, cuda.ErrorInvalidHandle)
		}
	}
	dd, ss := dst(), src()
	if dd == nil || ss == nil {
		return fail(call, cuda.ErrorInvalidValue)
	}
	o := op{run: func() { copy(dd, ss) }}
	if st == nil {
		o.run() // the legacy stream: done before any later work
		return nil
	}
	st.pending = append(st.pending, o)
	return nil
}

func (d *Driver) MemcpyHtoDAsync(dst cuda.DevicePtr, src cuda.HostPtr, n uint64, s cuda.Stream) error {
	const call = "cuMemcpyHtoDAsync_v2"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	return d.enqueue(call, s, func() []byte { return d.dbytes(dst, n) }, func() []byte { return d.host(src, n) })
}

func (d *Driver) MemcpyDtoHAsync(dst cuda.HostPtr, src cuda.DevicePtr, n uint64, s cuda.Stream) error {
	const call = "cuMemcpyDtoHAsync_v2"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	return d.enqueue(call, s, func() []byte { return d.host(dst, n) }, func() []byte { return d.dbytes(src, n) })
}

func (d *Driver) MemcpyDtoDAsync(dst, src cuda.DevicePtr, n uint64, s cuda.Stream) error {
	const call = "cuMemcpyDtoDAsync_v2"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	return d.enqueue(call, s, func() []byte { return d.dbytes(dst, n) }, func() []byte { return d.dbytes(src, n) })
}

// run completes the first n pending copies of s.
func (s *stream) run(n int) {
	for _, o := range s.pending[:n] {
		o.run()
	}
	s.pending = s.pending[n:]
}

// drainAll completes every pending copy and event (cuMemFree and the like
// synchronise the device).
func (d *Driver) drainAll() { d.drain(func(*stream) bool { return true }) }

// drainBlocking completes the work the legacy stream synchronises with: that
// of blocking streams. Work on non-blocking streams stays pending, as on a
// GPU, where a synchronous copy does not wait for it.
func (d *Driver) drainBlocking() { d.drain(func(s *stream) bool { return !s.nonBlocking }) }

func (d *Driver) drain(which func(*stream) bool) {
	for _, s := range d.streams {
		if which(s) {
			s.run(len(s.pending))
		}
	}
	for _, e := range d.events {
		if e.pending && e.s != nil && which(e.s) {
			e.done, e.pending = true, false
		}
	}
}

// handle layout: magic, exporter pid, memfd number, inode, size, buffer id,
// device uuid. 64 bytes, by value, as CUipcMemHandle.
var magic = [8]byte{'F', 'A', 'K', 'E', 'C', 'U', 'D', 'A'}

func (d *Driver) IpcGetMemHandle(p cuda.DevicePtr) (cuda.IpcMemHandle, error) {
	const call = "cuIpcGetMemHandle"
	var h cuda.IpcMemHandle
	if _, err := d.enterCtx(call); err != nil {
		return h, err
	}
	defer d.mu.Unlock()
	a := d.find(uint64(p), 1)
	if a == nil || a.base != uint64(p) || a.imported {
		return h, fail(call, cuda.ErrorInvalidValue)
	}
	b := h.Reserved[:]
	copy(b, magic[:])
	binary.LittleEndian.PutUint32(b[8:], uint32(d.pid))
	binary.LittleEndian.PutUint32(b[12:], uint32(a.fd))
	binary.LittleEndian.PutUint64(b[16:], a.inode)
	binary.LittleEndian.PutUint64(b[24:], a.size)
	binary.LittleEndian.PutUint64(b[32:], a.bufferID)
	copy(b[40:56], d.devs[a.dev].uuid[:])
	return h, nil
}

func (d *Driver) IpcOpenMemHandle(h cuda.IpcMemHandle, flags uint32) (cuda.DevicePtr, error) {
	const call = "cuIpcOpenMemHandle_v2"
	dev, err := d.enterCtx(call)
	if err != nil {
		return 0, err
	}
	defer d.mu.Unlock()
	b := h.Reserved[:]
	if [8]byte(b[:8]) != magic || flags&^cuda.IpcLazyEnablePeerAccess != 0 {
		return 0, fail(call, cuda.ErrorInvalidValue)
	}
	pid := int(binary.LittleEndian.Uint32(b[8:]))
	fdNum := int(binary.LittleEndian.Uint32(b[12:]))
	inode := binary.LittleEndian.Uint64(b[16:])
	size := binary.LittleEndian.Uint64(b[24:])
	if pid == d.pid {
		return 0, fail(call, cuda.ErrorInvalidContext)
	}
	key := fmt.Sprintf("%d/%d", pid, inode)
	for _, a := range d.allocs {
		if a.imported && a.key == key {
			return 0, fail(call, cuda.ErrorAlreadyMapped)
		}
	}
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/fd/%d", pid, fdNum), unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, fail(call, cuda.ErrorMapFailed)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Ino != inode || uint64(st.Size) < size {
		unix.Close(fd)
		return 0, fail(call, cuda.ErrorMapFailed)
	}
	mem, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	unix.Close(fd)
	if err != nil {
		return 0, fail(call, cuda.ErrorMapFailed)
	}
	// The memory stays on the device it was allocated on, where this
	// process sees that device (a real driver maps another device's
	// memory over peer access): its device ordinal says so.
	on := dev
	for i, x := range d.devs {
		if [16]byte(b[40:56]) == [16]byte(x.uuid) {
			on = i
		}
	}
	d.nextBuf++
	a := &alloc{base: d.reserve(size), size: size, dev: dev, on: on, mem: mem[:size], fd: -1, inode: inode, bufferID: d.nextBuf, imported: true, key: key}
	d.insert(a)
	return cuda.DevicePtr(a.base), nil
}

func (d *Driver) IpcCloseMemHandle(p cuda.DevicePtr) error {
	const call = "cuIpcCloseMemHandle"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	a := d.find(uint64(p), 1)
	if a == nil || a.base != uint64(p) || !a.imported {
		return fail(call, cuda.ErrorInvalidValue)
	}
	d.drainAll()
	d.remove(a)
	d.release(a)
	return nil
}

func (d *Driver) StreamCreate(flags uint32) (cuda.Stream, error) {
	const call = "cuStreamCreate"
	dev, err := d.enterCtx(call)
	if err != nil {
		return 0, err
	}
	defer d.mu.Unlock()
	if flags&^cuda.StreamNonBlocking != 0 {
		return 0, fail(call, cuda.ErrorInvalidValue)
	}
	d.nextH += 0x10
	h := cuda.Stream(d.nextH)
	d.streams[h] = &stream{ctx: d.devs[dev].ctx, nonBlocking: flags&cuda.StreamNonBlocking != 0}
	return h, nil
}

func (d *Driver) StreamSynchronize(s cuda.Stream) error {
	const call = "cuStreamSynchronize"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	if s == 0 {
		d.drainBlocking()
		return nil
	}
	st := d.streams[s]
	if st == nil {
		return fail(call, cuda.ErrorInvalidHandle)
	}
	st.run(len(st.pending))
	for _, e := range d.events {
		if e.s == st && e.pending {
			e.done, e.pending = true, false
		}
	}
	return nil
}

func (d *Driver) StreamDestroy(s cuda.Stream) error {
	const call = "cuStreamDestroy_v2"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	st := d.streams[s]
	if st == nil {
		return fail(call, cuda.ErrorInvalidHandle)
	}
	st.run(len(st.pending)) // work already queued still completes
	for _, e := range d.events {
		if e.s == st {
			if e.pending {
				e.done, e.pending = true, false
			}
			e.s = nil
		}
	}
	delete(d.streams, s)
	return nil
}

func (d *Driver) EventCreate(flags uint32) (cuda.Event, error) {
	const call = "cuEventCreate"
	dev, err := d.enterCtx(call)
	if err != nil {
		return 0, err
	}
	defer d.mu.Unlock()
	if flags&^uint32(0x7) != 0 {
		return 0, fail(call, cuda.ErrorInvalidValue)
	}
	d.nextH += 0x10
	h := cuda.Event(d.nextH)
	d.events[h] = &event{ctx: d.devs[dev].ctx, done: true, upto: -1}
	return h, nil
}

func (d *Driver) EventRecord(e cuda.Event, s cuda.Stream) error {
	const call = "cuEventRecord"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	ev := d.events[e]
	if ev == nil {
		return fail(call, cuda.ErrorInvalidHandle)
	}
	if s == 0 {
		ev.s, ev.done, ev.pending = nil, true, false
		return nil
	}
	st := d.streams[s]
	if st == nil {
		return fail(call, cuda.ErrorInvalidHandle)
	}
	ev.s, ev.upto, ev.polls = st, len(st.pending), d.cfg.Polls
	ev.done = ev.upto == 0
	ev.pending = !ev.done
	return nil
}

func (d *Driver) EventQuery(e cuda.Event) error {
	const call = "cuEventQuery"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	ev := d.events[e]
	if ev == nil {
		return fail(call, cuda.ErrorInvalidHandle)
	}
	if ev.done {
		return nil
	}
	if ev.polls > 0 {
		ev.polls--
		return fail(call, cuda.ErrorNotReady)
	}
	// Run the stream up to the event. Ops recorded earlier but already run
	// (by a synchronisation) shift the count.
	n := min(ev.upto, len(ev.s.pending))
	ev.s.run(n)
	for _, other := range d.events {
		if other.s == ev.s && other.pending {
			other.upto -= n
			if other.upto <= 0 {
				other.done, other.pending = true, false
			}
		}
	}
	ev.done, ev.pending = true, false
	return nil
}

func (d *Driver) EventDestroy(e cuda.Event) error {
	const call = "cuEventDestroy_v2"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	if d.events[e] == nil {
		return fail(call, cuda.ErrorInvalidHandle)
	}
	delete(d.events, e)
	return nil
}
