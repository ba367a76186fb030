package cuda

import (
	"encoding/hex"
	"fmt"
	"strings"
	"unsafe"
)

// DevicePtr is a CUdeviceptr: an address in the device's (unified) virtual
// address space. It is never a Go pointer and must not be dereferenced.
type DevicePtr uint64

// HostPtr is the address of host memory outside the Go heap (pinned memory
// from cuMemHostAlloc, or an mmap). Asynchronous copies take only HostPtr:
// the Go heap may not be the source or destination of a copy that outlives
// the call.
type HostPtr unsafe.Pointer

// Dev is a CUdevice: a device ordinal as the driver numbers it (after
// CUDA_VISIBLE_DEVICES).
type Dev int32

// Context, Stream and Event are the driver's opaque CUcontext, CUstream and
// CUevent pointers. The zero Stream is the legacy default stream.
type (
	Context uintptr
	Stream  uintptr
	Event   uintptr
)

// UUID is a device's 16-byte CUuuid.
type UUID [16]byte

// String formats u as nvidia-smi and NVML do: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
func (u UUID) String() string {
	h := hex.EncodeToString(u[:])
	return "GPU-" + h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// ParseUUID parses the form String prints; the "GPU-" prefix is optional.
func ParseUUID(s string) (UUID, error) {
	var u UUID
	h := strings.ReplaceAll(strings.TrimPrefix(s, "GPU-"), "-", "")
	if len(h) != 32 {
		return u, fmt.Errorf("%w: device uuid %q", ErrInvalidValue, s)
	}
	if _, err := hex.Decode(u[:], []byte(h)); err != nil {
		return u, fmt.Errorf("%w: device uuid %q: %v", ErrInvalidValue, s, err)
	}
	return u, nil
}

// IpcMemHandle is a CUipcMemHandle: 64 opaque bytes, passed by value to
// cuIpcOpenMemHandle.
type IpcMemHandle struct {
	Reserved [64]byte
}

// MemHandle is a CUmemGenericAllocationHandle: physical device memory of
// the virtual memory management (VMM) API (cuMemCreate, or imported from
// another process's POSIX fd), which is reachable only once mapped into an
// address range reserved for it (MemAddressReserve, MemMap, MemSetAccess).
type MemHandle uint64

// Flags and attributes (cuda.h).
const (
	// IpcLazyEnablePeerAccess is CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
	IpcLazyEnablePeerAccess uint32 = 1
	// StreamNonBlocking is CU_STREAM_NON_BLOCKING: no implicit
	// synchronisation with the legacy default stream.
	StreamNonBlocking uint32 = 1
	// EventDisableTiming is CU_EVENT_DISABLE_TIMING: the cheapest event,
	// for completion polling only.
	EventDisableTiming uint32 = 2
	// MemHostAllocPortable is CU_MEMHOSTALLOC_PORTABLE: pinned memory usable
	// from every context.
	MemHostAllocPortable uint32 = 1
)

// PointerAttribute is a CUpointer_attribute.
type PointerAttribute int32

const (
	// PointerAttributeBufferID is CU_POINTER_ATTRIBUTE_BUFFER_ID: a 64-bit
	// id unique to one allocation for the process's lifetime, so a cached
	// IPC mapping of an address whose buffer id changed is stale.
	PointerAttributeBufferID PointerAttribute = 7
	// PointerAttributeDeviceOrdinal is CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
	// (an int).
	PointerAttributeDeviceOrdinal PointerAttribute = 9
)

// DeviceAttribute is a CUdevice_attribute.
type DeviceAttribute int32

const (
	// DeviceAttributePCIBusID, PCIDeviceID and PCIDomainID locate the device
	// on the PCI bus (matched to NVML and NICs).
	DeviceAttributePCIBusID    DeviceAttribute = 33
	DeviceAttributePCIDeviceID DeviceAttribute = 34
	DeviceAttributePCIDomainID DeviceAttribute = 50
	// DeviceAttributeUnifiedAddressing is 1 on every device CUDA IPC
	// supports.
	DeviceAttributeUnifiedAddressing DeviceAttribute = 41
	// DeviceAttributeDMABufSupported is CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
	// (the GPUDirect RDMA dma-buf path).
	DeviceAttributeDMABufSupported DeviceAttribute = 124
)

// Driver is the CUDA driver API as this module calls it: one method per
// driver entry point, Go-typed, returning an *Error for any CUresult but
// CUDA_SUCCESS. Implementations: the real driver (Open, through purego) and
// the fake in package cudafake; one conformance suite (package cudatest)
// runs over both.
//
// As with the real driver, a context is current per OS thread: every call
// but Init, DriverGetVersion and the Device* calls needs the calling thread
// to have a current context (CtxSetCurrent), so callers run them on one
// goroutine locked to its thread (Device does that). Host memory handed to
// the synchronous copies must stay valid for the call; asynchronous copies
// take HostPtr (memory outside the Go heap) because they outlive the call.
type Driver interface {
	Init(flags uint32) error
	DriverGetVersion() (int, error)
	DeviceGetCount() (int, error)
	DeviceGet(ordinal int) (Dev, error)
	DeviceGetUUID(d Dev) (UUID, error)
	DeviceGetAttribute(attr DeviceAttribute, d Dev) (int, error)
	DevicePrimaryCtxRetain(d Dev) (Context, error)
	DevicePrimaryCtxRelease(d Dev) error
	CtxSetCurrent(c Context) error
	CtxGetCurrent() (Context, error)

	MemAlloc(size uint64) (DevicePtr, error)
	MemFree(p DevicePtr) error
	MemGetAddressRange(p DevicePtr) (base DevicePtr, size uint64, err error)
	MemHostAlloc(size uint64, flags uint32) (HostPtr, error)
	MemFreeHost(p HostPtr) error
	PointerGetAttribute(attr PointerAttribute, p DevicePtr) (uint64, error)

	MemcpyHtoD(dst DevicePtr, src []byte) error
	MemcpyDtoH(dst []byte, src DevicePtr) error
	MemcpyHtoDAsync(dst DevicePtr, src HostPtr, n uint64, s Stream) error
	MemcpyDtoHAsync(dst HostPtr, src DevicePtr, n uint64, s Stream) error
	MemcpyDtoDAsync(dst, src DevicePtr, n uint64, s Stream) error

	IpcGetMemHandle(p DevicePtr) (IpcMemHandle, error)
	IpcOpenMemHandle(h IpcMemHandle, flags uint32) (DevicePtr, error)
	IpcCloseMemHandle(p DevicePtr) error

	// Virtual memory management, with POSIX fd handles only: pinned
	// memory on one device, which a process exports as a file descriptor
	// and another imports and maps (the way allocators built on cuMemCreate,
	// torch's expandable segments among them, share memory that CUDA IPC
	// handles cannot name). Sizes and reserved addresses are multiples of
	// MemGetAllocationGranularity; a handle maps from its start (the
	// driver's mapping offset must be 0).
	MemGetAllocationGranularity(d Dev) (uint64, error)
	MemCreate(size uint64, d Dev) (MemHandle, error)
	MemRelease(h MemHandle) error
	// MemExportToShareableHandle returns a new file descriptor the caller
	// owns (and closes).
	MemExportToShareableHandle(h MemHandle) (fd int, err error)
	// MemImportFromShareableHandle does not take fd: the caller still
	// closes it.
	MemImportFromShareableHandle(fd int) (MemHandle, error)
	MemAddressReserve(size, align uint64) (DevicePtr, error)
	MemAddressFree(p DevicePtr, size uint64) error
	MemMap(p DevicePtr, size uint64, h MemHandle) error
	MemUnmap(p DevicePtr, size uint64) error
	// MemSetAccess makes a mapped range readable and writable from d;
	// until then no copy may touch it.
	MemSetAccess(p DevicePtr, size uint64, d Dev) error

	StreamCreate(flags uint32) (Stream, error)
	StreamSynchronize(s Stream) error
	StreamDestroy(s Stream) error
	EventCreate(flags uint32) (Event, error)
	EventRecord(e Event, s Stream) error
	// EventQuery returns nil once the work recorded before e is done, and
	// an error matching ErrNotReady while it runs.
	EventQuery(e Event) error
	EventDestroy(e Event) error
}
