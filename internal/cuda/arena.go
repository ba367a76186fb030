package cuda

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"sync/atomic"
)

// Arena is one device allocation that a pool lays out its blocks or rows
// in (the KV block pool, the Mamba state pool) when the caches live in
// device memory. It is its own allocation, so CUDA IPC can export it
// whole. ReadAt and WriteAt copy synchronously through the driver: what a
// CPU reference model needs to read and write its cache, a copy per step.
type Arena struct {
	d    *Device
	ptr  DevicePtr
	size uint64
	// opened is the base of another process's allocation this arena lies
	// in (OpenIPC), 0 for an allocation of its own: Free closes the
	// mapping instead of freeing.
	opened DevicePtr
	handle IpcMemHandle // the handle opened: Free lets it go
	// from is that allocation as its exporter's handle names it, for
	// Export (Offset 0); nil where the exporter is not known.
	from *IPCBuffer
	// vmm is the mapping of another process's VMM allocation this arena
	// lies in (OpenVMM): Free unmaps it.
	vmm   *vmmMapping
	view  bool        // a View: Free frees nothing
	freed atomic.Bool // an opened arena's Free ran: a second one lets nothing go
}

var (
	_ io.ReaderAt = (*Arena)(nil)
	_ io.WriterAt = (*Arena)(nil)
)

// NewArena allocates size bytes of device memory, zeroed (as host arenas
// are).
func (d *Device) NewArena(size uint64) (*Arena, error) {
	p, err := d.Alloc(size)
	if err != nil {
		return nil, err
	}
	a := &Arena{d: d, ptr: p, size: size}
	zero := make([]byte, min(size, 4<<20))
	for off := uint64(0); off < size; off += uint64(len(zero)) {
		if err := d.CopyToDevice(p+DevicePtr(off), zero[:min(uint64(len(zero)), size-off)]); err != nil {
			return nil, errors.Join(err, d.Free(p))
		}
	}
	return a, nil
}

// Device returns the device the arena is on.
func (a *Arena) Device() *Device { return a.d }

// Ptr returns the arena's base address.
func (a *Arena) Ptr() DevicePtr { return a.ptr }

// Size returns the arena's length in bytes.
func (a *Arena) Size() uint64 { return a.size }

// ReadAt copies len(p) bytes at off into p. Past the end it copies what
// there is and returns io.EOF, as io.ReaderAt says.
func (a *Arena) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("%w: negative offset %d", ErrInvalidValue, off)
	}
	if uint64(off) >= a.size {
		return 0, io.EOF
	}
	n := min(uint64(len(p)), a.size-uint64(off))
	if err := a.d.CopyFromDevice(p[:n], a.ptr+DevicePtr(off)); err != nil {
		return 0, err
	}
	if n < uint64(len(p)) {
		return int(n), io.EOF
	}
	return int(n), nil
}

// WriteAt copies p to off. A write past the end writes nothing and fails.
func (a *Arena) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 || uint64(off) > a.size || uint64(len(p)) > a.size-uint64(off) {
		return 0, fmt.Errorf("%w: write of %d bytes at %d outside an arena of %d", ErrInvalidValue, len(p), off, a.size)
	}
	if err := a.d.CopyToDevice(a.ptr+DevicePtr(off), p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// OpenIPC maps the allocation process pid exported as h (its
// cuIpcGetMemHandle) and returns an arena over size bytes of it from off:
// how a sidecar reaches an engine's cache tensors, which lie at an offset
// in an allocation of the engine's allocator. Free closes the mapping (once
// nothing else in this process uses the handle: Import shares it); the
// exporter keeps its allocation. A range past the allocation is refused.
//
// The arena (and its views) Export the exporter's handle, so that a third
// process opens the allocation itself: the driver refuses a handle of
// memory that was itself opened by handle. pid names the exporter in that
// export (the import caches of peers are per exporter); 0 (unknown) leaves
// the arena unexportable.
func (d *Device) OpenIPC(h IpcMemHandle, pid int, off, size uint64) (*Arena, error) {
	if size == 0 {
		return nil, fmt.Errorf("%w: an arena of 0 bytes", ErrInvalidValue)
	}
	var base DevicePtr
	var from *IPCBuffer
	err := d.Do(func(drv Driver) error {
		p, n, err := d.openHandle(drv, h)
		if err != nil {
			return err
		}
		if off > n || size > n-off {
			return errors.Join(fmt.Errorf("%w: %d bytes at offset %d of an allocation of %d", ErrInvalidValue, size, off, n), d.closeHandle(drv, h))
		}
		// The arena is this device's memory: a handle of another device's
		// opens too (peer access), but an arena's copies would cross the
		// bus. (Import, a pull's source, may be another GPU's.)
		if dev, err := drv.PointerGetAttribute(PointerAttributeDeviceOrdinal, p); err != nil || int(dev) != d.ordinal {
			if err == nil {
				err = fmt.Errorf("%w: the handle's memory is on device %d, not on %s (device %d)", ErrInvalidValue, dev, d.uuid, d.ordinal)
			}
			return errors.Join(err, d.closeHandle(drv, h))
		}
		base = p
		// Without a buffer id the arena still works; it only stays
		// unexportable (peers reach it by tcp).
		if id, err := drv.PointerGetAttribute(PointerAttributeBufferID, p); err == nil && pid > 0 {
			from = &IPCBuffer{Handle: h, Base: p, Size: n, BufferID: forwardedID(h, id), Device: d.uuid, PID: pid}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &Arena{d: d, ptr: base + DevicePtr(off), size: size, opened: base, handle: h, from: from}, nil
}

// forwardedID is the buffer id an opened allocation is exported under. Its
// Base there is this process's mapping (the exporter's address is not
// known here), which a later mapping of another allocation, in this process
// or in the next one at the same address, may reuse: the id mixes the
// handle, which names one allocation, with this mapping's own buffer id,
// so a peer's cached mapping of the earlier one is never taken for it.
func forwardedID(h IpcMemHandle, id uint64) uint64 {
	f := fnv.New64a()
	f.Write(h.Reserved[:])
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], id)
	f.Write(b[:])
	return f.Sum64()
}

// View returns an arena over size bytes of a from off, sharing its memory:
// its Free frees nothing, a's frees both.
func (a *Arena) View(off, size uint64) (*Arena, error) {
	if size == 0 || off > a.size || size > a.size-off {
		return nil, fmt.Errorf("%w: a view of %d bytes at %d of an arena of %d", ErrInvalidValue, size, off, a.size)
	}
	return &Arena{d: a.d, ptr: a.ptr + DevicePtr(off), size: size, opened: a.opened, handle: a.handle, from: a.from, vmm: a.vmm, view: true}, nil
}

// Export describes the arena for CUDA IPC: an allocation of this process
// (its base), or an arena of one that OpenIPC opened (then the exporter's
// handle, and Offset where the arena starts in that allocation).
func (a *Arena) Export() (IPCBuffer, error) {
	if a.vmm != nil {
		return IPCBuffer{}, fmt.Errorf("%w: an arena in a VMM allocation has no CUDA IPC handle", ErrInvalidValue)
	}
	if a.opened == 0 {
		return a.d.Export(a.ptr)
	}
	if a.from == nil {
		return IPCBuffer{}, fmt.Errorf("%w: an arena opened by IPC handle without its exporter's pid", ErrInvalidValue)
	}
	b := *a.from
	b.Offset = uint64(a.ptr - a.opened)
	return b, nil
}

// Free frees the arena's memory, or closes the mapping of an arena that
// OpenIPC or OpenVMM opened.
func (a *Arena) Free() error {
	if a.view {
		return nil
	}
	if a.vmm != nil {
		return a.closeVMM()
	}
	if a.opened != 0 {
		// The mapping may be shared (Import): a second Free must not take
		// another user's reference.
		if a.freed.Swap(true) {
			return fmt.Errorf("%w: an arena opened by IPC handle freed twice", ErrInvalidValue)
		}
		return a.d.Do(func(drv Driver) error { return a.d.closeHandle(drv, a.handle) })
	}
	return a.d.Free(a.ptr)
}
