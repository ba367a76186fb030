package cuda

import (
	"errors"
	"fmt"
	"io"
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
	view   bool // a View: Free frees nothing
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

// OpenIPC maps the allocation another process exported as h (its
// cuIpcGetMemHandle) and returns an arena over size bytes of it from off:
// how a sidecar reaches an engine's cache tensors, which lie at an offset
// in an allocation of the engine's allocator. Free closes the mapping; the
// exporter keeps its allocation. A range past the allocation is refused.
func (d *Device) OpenIPC(h IpcMemHandle, off, size uint64) (*Arena, error) {
	if size == 0 {
		return nil, fmt.Errorf("%w: an arena of 0 bytes", ErrInvalidValue)
	}
	var base DevicePtr
	err := d.Do(func(drv Driver) error {
		p, err := drv.IpcOpenMemHandle(h, IpcLazyEnablePeerAccess)
		if err != nil {
			return err
		}
		_, n, err := drv.MemGetAddressRange(p)
		if err == nil && (off > n || size > n-off) {
			err = fmt.Errorf("%w: %d bytes at offset %d of an allocation of %d", ErrInvalidValue, size, off, n)
		}
		if err != nil {
			return errors.Join(err, drv.IpcCloseMemHandle(p))
		}
		base = p
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &Arena{d: d, ptr: base + DevicePtr(off), size: size, opened: base}, nil
}

// View returns an arena over size bytes of a from off, sharing its memory:
// its Free frees nothing, a's frees both.
func (a *Arena) View(off, size uint64) (*Arena, error) {
	if size == 0 || off > a.size || size > a.size-off {
		return nil, fmt.Errorf("%w: a view of %d bytes at %d of an arena of %d", ErrInvalidValue, size, off, a.size)
	}
	return &Arena{d: a.d, ptr: a.ptr + DevicePtr(off), size: size, view: true}, nil
}

// Export describes the arena for CUDA IPC.
func (a *Arena) Export() (IPCBuffer, error) { return a.d.Export(a.ptr) }

// Free frees the arena's memory, or closes the mapping of an arena that
// OpenIPC opened.
func (a *Arena) Free() error {
	if a.view {
		return nil
	}
	if a.opened != 0 {
		return a.d.Do(func(drv Driver) error { return drv.IpcCloseMemHandle(a.opened) })
	}
	return a.d.Free(a.ptr)
}
