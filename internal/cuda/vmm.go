package cuda

import (
	"errors"
	"fmt"
)

// vmmMapping is an address range this process reserved and mapped another
// process's VMM allocation into (OpenVMM): what Free gives back.
type vmmMapping struct {
	base DevicePtr
	size uint64
}

// OpenVMM maps the VMM allocation (cuMemCreate) that another process, the
// engine, exported as the POSIX file descriptor fd
// (cuMemExportToShareableHandle), all allocSize bytes of it, and returns an
// arena over size bytes of it from off: how a sidecar reaches caches that
// an allocator built on the VMM API placed, which CUDA IPC handles cannot
// name. fd stays the caller's. The mapping holds the physical memory until
// Free, whatever the exporter does with its own handle and mappings
// meanwhile. What the exporter named wrongly (an fd that is no export, a
// size the allocation does not have) matches ErrInvalidValue.
//
// The arena cannot be exported again for CUDA IPC (Export fails: a legacy
// handle cannot name VMM memory), so an rdma engine's peers reach it by
// tcp.
func (d *Device) OpenVMM(fd int, allocSize, off, size uint64) (*Arena, error) {
	if size == 0 || off > allocSize || size > allocSize-off {
		return nil, fmt.Errorf("%w: %d bytes at offset %d of a VMM allocation of %d", ErrInvalidValue, size, off, allocSize)
	}
	var base DevicePtr
	err := d.Do(func(drv Driver) error {
		g, err := drv.MemGetAllocationGranularity(d.dev)
		if err != nil {
			return err
		}
		if g == 0 || allocSize%g != 0 {
			return fmt.Errorf("%w: a VMM allocation of %d bytes, not a multiple of the device's granularity %d", ErrInvalidValue, allocSize, g)
		}
		h, err := drv.MemImportFromShareableHandle(fd)
		if err != nil {
			// The driver's code for an fd that is no export varies.
			return fmt.Errorf("%w: importing the VMM allocation's fd: %w", ErrInvalidValue, err)
		}
		p, err := drv.MemAddressReserve(allocSize, 0)
		if err != nil {
			return errors.Join(err, drv.MemRelease(h))
		}
		if err := drv.MemMap(p, allocSize, h); err != nil {
			// Most likely an allocation smaller than allocSize.
			return errors.Join(fmt.Errorf("%w: mapping %d bytes of the VMM allocation: %w", ErrInvalidValue, allocSize, err),
				drv.MemRelease(h), drv.MemAddressFree(p, allocSize))
		}
		unmap := func(err error) error {
			return errors.Join(err, drv.MemUnmap(p, allocSize), drv.MemAddressFree(p, allocSize))
		}
		// The mapping holds the memory from here on.
		if err := drv.MemRelease(h); err != nil {
			return unmap(err)
		}
		if err := drv.MemSetAccess(p, allocSize, d.dev); err != nil {
			return unmap(err)
		}
		// As OpenIPC's: the arena is this device's memory, or its copies
		// would cross the bus.
		if dev, err := drv.PointerGetAttribute(PointerAttributeDeviceOrdinal, p); err != nil || int(dev) != d.ordinal {
			if err == nil {
				err = fmt.Errorf("%w: the VMM allocation is on device %d, not on %s (device %d)", ErrInvalidValue, dev, d.uuid, d.ordinal)
			}
			return unmap(err)
		}
		base = p
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &Arena{d: d, ptr: base + DevicePtr(off), size: size, vmm: &vmmMapping{base: base, size: allocSize}}, nil
}

// closeVMM unmaps an OpenVMM arena's allocation and frees its range.
func (a *Arena) closeVMM() error {
	if a.freed.Swap(true) {
		return fmt.Errorf("%w: a VMM arena freed twice", ErrInvalidValue)
	}
	m := a.vmm
	return a.d.Do(func(drv Driver) error {
		return errors.Join(drv.MemUnmap(m.base, m.size), drv.MemAddressFree(m.base, m.size))
	})
}
