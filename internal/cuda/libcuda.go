//go:build linux && (amd64 || arm64) && !nocuda

package cuda

import (
	"fmt"
	"os"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

// Library is the SONAME Open loads: the driver, never the toolkit's
// libcuda.so (a stub that fails every call with CUDA_ERROR_STUB_LIBRARY).
const Library = "libcuda.so.1"

// lib is the real driver, loaded with dlopen and called through purego
// (no cgo). Each field is one driver entry point, resolved by its versioned
// name: the unsuffixed names still exist with their old ABIs (cuMemAlloc
// takes a 32-bit size), so they are never looked up.
type lib struct {
	path   string
	handle uintptr

	cuInit                         func(flags uint32) Result
	cuDriverGetVersion             func(v *int32) Result
	cuDeviceGetCount               func(n *int32) Result
	cuDeviceGet                    func(d *Dev, ordinal int32) Result
	cuDeviceGetUuid_v2             func(u *UUID, d Dev) Result
	cuDeviceGetAttribute           func(v *int32, attr DeviceAttribute, d Dev) Result
	cuDevicePrimaryCtxRetain       func(c *Context, d Dev) Result
	cuDevicePrimaryCtxRelease_v2   func(d Dev) Result
	cuCtxSetCurrent                func(c Context) Result
	cuCtxGetCurrent                func(c *Context) Result
	cuMemAlloc_v2                  func(p *DevicePtr, size uint64) Result
	cuMemFree_v2                   func(p DevicePtr) Result
	cuMemGetAddressRange_v2        func(base *DevicePtr, size *uint64, p DevicePtr) Result
	cuMemHostAlloc                 func(p *HostPtr, size uint64, flags uint32) Result
	cuMemFreeHost                  func(p HostPtr) Result
	cuPointerGetAttribute          func(data unsafe.Pointer, attr PointerAttribute, p DevicePtr) Result
	cuMemcpyHtoD_v2                func(dst DevicePtr, src unsafe.Pointer, n uint64) Result
	cuMemcpyDtoH_v2                func(dst unsafe.Pointer, src DevicePtr, n uint64) Result
	cuMemcpyHtoDAsync_v2           func(dst DevicePtr, src HostPtr, n uint64, s Stream) Result
	cuMemcpyDtoHAsync_v2           func(dst HostPtr, src DevicePtr, n uint64, s Stream) Result
	cuMemcpyDtoDAsync_v2           func(dst, src DevicePtr, n uint64, s Stream) Result
	cuIpcGetMemHandle              func(h *IpcMemHandle, p DevicePtr) Result
	cuIpcOpenMemHandle_v2          func(p *DevicePtr, h IpcMemHandle, flags uint32) Result
	cuIpcCloseMemHandle            func(p DevicePtr) Result
	cuMemGetAllocationGranularity  func(g *uint64, prop *memAllocationProp, option int32) Result
	cuMemCreate                    func(h *MemHandle, size uint64, prop *memAllocationProp, flags uint64) Result
	cuMemRelease                   func(h MemHandle) Result
	cuMemExportToShareableHandle   func(fd unsafe.Pointer, h MemHandle, kind int32, flags uint64) Result
	cuMemImportFromShareableHandle func(h *MemHandle, osHandle uintptr, kind int32) Result
	cuMemAddressReserve            func(p *DevicePtr, size, align uint64, addr DevicePtr, flags uint64) Result
	cuMemAddressFree               func(p DevicePtr, size uint64) Result
	cuMemMap                       func(p DevicePtr, size, offset uint64, h MemHandle, flags uint64) Result
	cuMemUnmap                     func(p DevicePtr, size uint64) Result
	cuMemSetAccess                 func(p DevicePtr, size uint64, desc *memAccessDesc, count uint64) Result
	cuStreamCreate                 func(s *Stream, flags uint32) Result
	cuStreamSynchronize            func(s Stream) Result
	cuStreamDestroy_v2             func(s Stream) Result
	cuEventCreate                  func(e *Event, flags uint32) Result
	cuEventRecord                  func(e Event, s Stream) Result
	cuEventQuery                   func(e Event) Result
	cuEventDestroy_v2              func(e Event) Result
}

// symbols lists every entry point with the field it fills. The names are
// the ABIs the field types are written for.
func (l *lib) symbols() []struct {
	name string
	fn   any
} {
	return []struct {
		name string
		fn   any
	}{
		{"cuInit", &l.cuInit},
		{"cuDriverGetVersion", &l.cuDriverGetVersion},
		{"cuDeviceGetCount", &l.cuDeviceGetCount},
		{"cuDeviceGet", &l.cuDeviceGet},
		{"cuDeviceGetUuid_v2", &l.cuDeviceGetUuid_v2},
		{"cuDeviceGetAttribute", &l.cuDeviceGetAttribute},
		{"cuDevicePrimaryCtxRetain", &l.cuDevicePrimaryCtxRetain},
		{"cuDevicePrimaryCtxRelease_v2", &l.cuDevicePrimaryCtxRelease_v2},
		{"cuCtxSetCurrent", &l.cuCtxSetCurrent},
		{"cuCtxGetCurrent", &l.cuCtxGetCurrent},
		{"cuMemAlloc_v2", &l.cuMemAlloc_v2},
		{"cuMemFree_v2", &l.cuMemFree_v2},
		{"cuMemGetAddressRange_v2", &l.cuMemGetAddressRange_v2},
		{"cuMemHostAlloc", &l.cuMemHostAlloc},
		{"cuMemFreeHost", &l.cuMemFreeHost},
		{"cuPointerGetAttribute", &l.cuPointerGetAttribute},
		{"cuMemcpyHtoD_v2", &l.cuMemcpyHtoD_v2},
		{"cuMemcpyDtoH_v2", &l.cuMemcpyDtoH_v2},
		{"cuMemcpyHtoDAsync_v2", &l.cuMemcpyHtoDAsync_v2},
		{"cuMemcpyDtoHAsync_v2", &l.cuMemcpyDtoHAsync_v2},
		{"cuMemcpyDtoDAsync_v2", &l.cuMemcpyDtoDAsync_v2},
		{"cuIpcGetMemHandle", &l.cuIpcGetMemHandle},
		{"cuIpcOpenMemHandle_v2", &l.cuIpcOpenMemHandle_v2},
		{"cuIpcCloseMemHandle", &l.cuIpcCloseMemHandle},
		{"cuMemGetAllocationGranularity", &l.cuMemGetAllocationGranularity},
		{"cuMemCreate", &l.cuMemCreate},
		{"cuMemRelease", &l.cuMemRelease},
		{"cuMemExportToShareableHandle", &l.cuMemExportToShareableHandle},
		{"cuMemImportFromShareableHandle", &l.cuMemImportFromShareableHandle},
		{"cuMemAddressReserve", &l.cuMemAddressReserve},
		{"cuMemAddressFree", &l.cuMemAddressFree},
		{"cuMemMap", &l.cuMemMap},
		{"cuMemUnmap", &l.cuMemUnmap},
		{"cuMemSetAccess", &l.cuMemSetAccess},
		{"cuStreamCreate", &l.cuStreamCreate},
		{"cuStreamSynchronize", &l.cuStreamSynchronize},
		{"cuStreamDestroy_v2", &l.cuStreamDestroy_v2},
		{"cuEventCreate", &l.cuEventCreate},
		{"cuEventRecord", &l.cuEventRecord},
		{"cuEventQuery", &l.cuEventQuery},
		{"cuEventDestroy_v2", &l.cuEventDestroy_v2},
	}
}

var (
	loadMu sync.Mutex
	loaded = map[string]*lib{} // by path: dlopen'ed once, never closed
)

// LibraryEnv names a library Open loads instead of Library: a fake
// driver for the workers' tests (testdata/fakecuda.c), or a driver outside
// the linker's path.
const LibraryEnv = "HANDOFF_LIBCUDA"

// Open loads the CUDA driver (Library, or $HANDOFF_LIBCUDA) and resolves
// its entry points. It does not call cuInit. Without a driver it returns
// an error matching ErrNoDriver, so callers fall back to host memory.
func Open() (Driver, error) {
	if p := os.Getenv(LibraryEnv); p != "" {
		return Load(p)
	}
	return Load(Library)
}

// Load is Open for a library at path (a name the dynamic linker searches,
// or a file); tests load a fake driver with it. A library is loaded once
// per process and stays loaded: drivers are not meant to be unloaded.
func Load(path string) (Driver, error) {
	loadMu.Lock()
	defer loadMu.Unlock()
	if l, ok := loaded[path]; ok {
		return l, nil
	}
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return nil, fmt.Errorf("%w: dlopen %s: %v", ErrNoDriver, path, err)
	}
	l := &lib{path: path, handle: h}
	var missing []string
	for _, s := range l.symbols() {
		p, err := purego.Dlsym(h, s.name)
		if err != nil || p == 0 {
			missing = append(missing, s.name)
			continue
		}
		purego.RegisterFunc(s.fn, p)
	}
	if len(missing) > 0 {
		_ = purego.Dlclose(h)
		return nil, fmt.Errorf("%w in %s: %v", ErrSymbol, path, missing)
	}
	loaded[path] = l
	return l, nil
}

var _ Driver = (*lib)(nil)

func (l *lib) Init(flags uint32) error { return Check("cuInit", l.cuInit(flags)) }

func (l *lib) DriverGetVersion() (int, error) {
	var v int32
	err := Check("cuDriverGetVersion", l.cuDriverGetVersion(&v))
	return int(v), err
}

func (l *lib) DeviceGetCount() (int, error) {
	var n int32
	err := Check("cuDeviceGetCount", l.cuDeviceGetCount(&n))
	return int(n), err
}

func (l *lib) DeviceGet(ordinal int) (Dev, error) {
	var d Dev
	err := Check("cuDeviceGet", l.cuDeviceGet(&d, int32(ordinal)))
	return d, err
}

func (l *lib) DeviceGetUUID(d Dev) (UUID, error) {
	var u UUID
	err := Check("cuDeviceGetUuid_v2", l.cuDeviceGetUuid_v2(&u, d))
	return u, err
}

func (l *lib) DeviceGetAttribute(attr DeviceAttribute, d Dev) (int, error) {
	var v int32
	err := Check("cuDeviceGetAttribute", l.cuDeviceGetAttribute(&v, attr, d))
	return int(v), err
}

func (l *lib) DevicePrimaryCtxRetain(d Dev) (Context, error) {
	var c Context
	err := Check("cuDevicePrimaryCtxRetain", l.cuDevicePrimaryCtxRetain(&c, d))
	return c, err
}

func (l *lib) DevicePrimaryCtxRelease(d Dev) error {
	return Check("cuDevicePrimaryCtxRelease_v2", l.cuDevicePrimaryCtxRelease_v2(d))
}

func (l *lib) CtxSetCurrent(c Context) error {
	return Check("cuCtxSetCurrent", l.cuCtxSetCurrent(c))
}

func (l *lib) CtxGetCurrent() (Context, error) {
	var c Context
	err := Check("cuCtxGetCurrent", l.cuCtxGetCurrent(&c))
	return c, err
}

func (l *lib) MemAlloc(size uint64) (DevicePtr, error) {
	var p DevicePtr
	err := Check("cuMemAlloc_v2", l.cuMemAlloc_v2(&p, size))
	return p, err
}

func (l *lib) MemFree(p DevicePtr) error { return Check("cuMemFree_v2", l.cuMemFree_v2(p)) }

func (l *lib) MemGetAddressRange(p DevicePtr) (DevicePtr, uint64, error) {
	var base DevicePtr
	var size uint64
	err := Check("cuMemGetAddressRange_v2", l.cuMemGetAddressRange_v2(&base, &size, p))
	return base, size, err
}

func (l *lib) MemHostAlloc(size uint64, flags uint32) (HostPtr, error) {
	var p HostPtr
	err := Check("cuMemHostAlloc", l.cuMemHostAlloc(&p, size, flags))
	return p, err
}

func (l *lib) MemFreeHost(p HostPtr) error { return Check("cuMemFreeHost", l.cuMemFreeHost(p)) }

func (l *lib) PointerGetAttribute(attr PointerAttribute, p DevicePtr) (uint64, error) {
	var v uint64 // wide enough for every attribute this package reads; ints land in the low half
	err := Check("cuPointerGetAttribute", l.cuPointerGetAttribute(unsafe.Pointer(&v), attr, p))
	if attr == PointerAttributeDeviceOrdinal {
		v = uint64(uint32(v))
	}
	return v, err
}

func (l *lib) MemcpyHtoD(dst DevicePtr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return Check("cuMemcpyHtoD_v2", l.cuMemcpyHtoD_v2(dst, unsafe.Pointer(unsafe.SliceData(src)), uint64(len(src))))
}

func (l *lib) MemcpyDtoH(dst []byte, src DevicePtr) error {
	if len(dst) == 0 {
		return nil
	}
	return Check("cuMemcpyDtoH_v2", l.cuMemcpyDtoH_v2(unsafe.Pointer(unsafe.SliceData(dst)), src, uint64(len(dst))))
}

func (l *lib) MemcpyHtoDAsync(dst DevicePtr, src HostPtr, n uint64, s Stream) error {
	return Check("cuMemcpyHtoDAsync_v2", l.cuMemcpyHtoDAsync_v2(dst, src, n, s))
}

func (l *lib) MemcpyDtoHAsync(dst HostPtr, src DevicePtr, n uint64, s Stream) error {
	return Check("cuMemcpyDtoHAsync_v2", l.cuMemcpyDtoHAsync_v2(dst, src, n, s))
}

func (l *lib) MemcpyDtoDAsync(dst, src DevicePtr, n uint64, s Stream) error {
	return Check("cuMemcpyDtoDAsync_v2", l.cuMemcpyDtoDAsync_v2(dst, src, n, s))
}

func (l *lib) IpcGetMemHandle(p DevicePtr) (IpcMemHandle, error) {
	var h IpcMemHandle
	err := Check("cuIpcGetMemHandle", l.cuIpcGetMemHandle(&h, p))
	return h, err
}

func (l *lib) IpcOpenMemHandle(h IpcMemHandle, flags uint32) (DevicePtr, error) {
	var p DevicePtr
	err := Check("cuIpcOpenMemHandle_v2", l.cuIpcOpenMemHandle_v2(&p, h, flags))
	return p, err
}

func (l *lib) IpcCloseMemHandle(p DevicePtr) error {
	return Check("cuIpcCloseMemHandle", l.cuIpcCloseMemHandle(p))
}

// memLocation, memAllocationProp and memAccessDesc are CUmemLocation,
// CUmemAllocationProp and CUmemAccessDesc (cuda.h, 64-bit): the driver
// reads them through the pointers passed.
type memLocation struct {
	kind int32 // CU_MEM_LOCATION_TYPE_DEVICE
	id   int32
}

type memAllocationProp struct {
	kind        int32 // CU_MEM_ALLOCATION_TYPE_PINNED
	handleTypes int32 // requestedHandleTypes
	location    memLocation
	_           uintptr // win32HandleMetaData
	_           [8]byte // allocFlags: compressionType, gpuDirectRDMACapable, usage, reserved: all 0
}

type memAccessDesc struct {
	location memLocation
	flags    int32 // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
}

const (
	memAllocationTypePinned    = 1
	memHandleTypePosixFD       = 1
	memLocationTypeDevice      = 1
	memAccessProtReadWrite     = 3
	memAllocGranularityMinimum = 0
)

var (
	_ [32]byte = [unsafe.Sizeof(memAllocationProp{})]byte{}
	_ [12]byte = [unsafe.Sizeof(memAccessDesc{})]byte{}
)

func pinnedOn(d Dev) memAllocationProp {
	return memAllocationProp{kind: memAllocationTypePinned, handleTypes: memHandleTypePosixFD,
		location: memLocation{kind: memLocationTypeDevice, id: int32(d)}}
}

func (l *lib) MemGetAllocationGranularity(d Dev) (uint64, error) {
	var g uint64
	prop := pinnedOn(d)
	err := Check("cuMemGetAllocationGranularity", l.cuMemGetAllocationGranularity(&g, &prop, memAllocGranularityMinimum))
	return g, err
}

func (l *lib) MemCreate(size uint64, d Dev) (MemHandle, error) {
	var h MemHandle
	prop := pinnedOn(d)
	err := Check("cuMemCreate", l.cuMemCreate(&h, size, &prop, 0))
	return h, err
}

func (l *lib) MemRelease(h MemHandle) error { return Check("cuMemRelease", l.cuMemRelease(h)) }

func (l *lib) MemExportToShareableHandle(h MemHandle) (int, error) {
	var fd int32 = -1
	err := Check("cuMemExportToShareableHandle", l.cuMemExportToShareableHandle(unsafe.Pointer(&fd), h, memHandleTypePosixFD, 0))
	return int(fd), err
}

func (l *lib) MemImportFromShareableHandle(fd int) (MemHandle, error) {
	var h MemHandle
	// For a POSIX fd the "pointer" is the descriptor's value itself.
	err := Check("cuMemImportFromShareableHandle", l.cuMemImportFromShareableHandle(&h, uintptr(fd), memHandleTypePosixFD))
	return h, err
}

func (l *lib) MemAddressReserve(size, align uint64) (DevicePtr, error) {
	var p DevicePtr
	err := Check("cuMemAddressReserve", l.cuMemAddressReserve(&p, size, align, 0, 0))
	return p, err
}

func (l *lib) MemAddressFree(p DevicePtr, size uint64) error {
	return Check("cuMemAddressFree", l.cuMemAddressFree(p, size))
}

func (l *lib) MemMap(p DevicePtr, size uint64, h MemHandle) error {
	return Check("cuMemMap", l.cuMemMap(p, size, 0, h, 0))
}

func (l *lib) MemUnmap(p DevicePtr, size uint64) error {
	return Check("cuMemUnmap", l.cuMemUnmap(p, size))
}

func (l *lib) MemSetAccess(p DevicePtr, size uint64, d Dev) error {
	desc := memAccessDesc{location: memLocation{kind: memLocationTypeDevice, id: int32(d)}, flags: memAccessProtReadWrite}
	return Check("cuMemSetAccess", l.cuMemSetAccess(p, size, &desc, 1))
}

func (l *lib) StreamCreate(flags uint32) (Stream, error) {
	var s Stream
	err := Check("cuStreamCreate", l.cuStreamCreate(&s, flags))
	return s, err
}

func (l *lib) StreamSynchronize(s Stream) error {
	return Check("cuStreamSynchronize", l.cuStreamSynchronize(s))
}

func (l *lib) StreamDestroy(s Stream) error {
	return Check("cuStreamDestroy_v2", l.cuStreamDestroy_v2(s))
}

func (l *lib) EventCreate(flags uint32) (Event, error) {
	var e Event
	err := Check("cuEventCreate", l.cuEventCreate(&e, flags))
	return e, err
}

func (l *lib) EventRecord(e Event, s Stream) error {
	return Check("cuEventRecord", l.cuEventRecord(e, s))
}

func (l *lib) EventQuery(e Event) error { return Check("cuEventQuery", l.cuEventQuery(e)) }

func (l *lib) EventDestroy(e Event) error {
	return Check("cuEventDestroy_v2", l.cuEventDestroy_v2(e))
}
