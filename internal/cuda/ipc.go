package cuda

// CUDA IPC: exporting a device allocation to processes on this host,
// opening theirs (Import, its cache and the peers counted on it), and the
// handles this process has open, shared by OpenIPC's arenas and Import.

import (
	"errors"
	"fmt"
	"os"
)

type handleRef struct {
	ptr  DevicePtr
	size uint64 // the allocation's, as the driver maps it
	refs int
}

type importKey struct {
	pid    int
	device UUID
	base   DevicePtr
}

type mapping struct {
	bufferID uint64
	ptr      DevicePtr
	size     uint64
	handle   IpcMemHandle
}

// processID is the process a driver runs in: its ProcessID where it has
// one (cudafake, standing for another process of a test), else this one.
func processID(drv Driver) int {
	if p, ok := drv.(interface{ ProcessID() int }); ok {
		return p.ProcessID()
	}
	return os.Getpid()
}

// IPCBuffer describes a device allocation exported to processes on the same
// host: what a peer needs to open it once and to know when its cached
// mapping went stale.
//
// An allocation that a process opened by handle and passes on (Arena.Export
// of an OpenIPC arena) names its exporter's handle and pid, but Base is the
// forwarding process's mapping: a cache key, not an address of the
// exporter's. The exporter itself never imports it (Import would take Base
// for its own address).
type IPCBuffer struct {
	Handle   IpcMemHandle
	Base     DevicePtr // in the exporter's address space; the cache key
	Size     uint64
	BufferID uint64 // changes when the exporter reallocates at Base
	Device   UUID
	PID      int
	// Offset is where the exported arena starts in the allocation (0 for
	// an allocation's base; Arena.Export of a part of one). It is the
	// exporter's: a peer is told offsets in the allocation.
	Offset uint64
}

// Export describes the allocation whose base is p for CUDA IPC. p must be
// an allocation's base (handles name whole allocations).
func (d *Device) Export(p DevicePtr) (IPCBuffer, error) {
	b := IPCBuffer{Device: d.uuid, PID: d.pid}
	err := d.Do(func(drv Driver) error {
		base, size, err := drv.MemGetAddressRange(p)
		if err != nil {
			return err
		}
		if base != p {
			return fmt.Errorf("%w: export of %#x inside the allocation at %#x; export the base", ErrInvalidValue, p, base)
		}
		if b.BufferID, err = drv.PointerGetAttribute(PointerAttributeBufferID, p); err != nil {
			return err
		}
		b.Handle, err = drv.IpcGetMemHandle(p)
		b.Base, b.Size = p, size
		return err
	})
	return b, err
}

// Import returns this process's address of an exported allocation. The
// first Import of an allocation opens its handle (about a millisecond on
// a real driver); later ones are answered from a cache keyed by exporter
// pid, device and base, which reopens when the buffer id changed (the
// exporter freed and reallocated). An allocation exported by this process
// is its own address: the driver refuses to open a handle in its exporter.
// A reopen closes the stale mapping: the caller must not copy through an
// address of an allocation its exporter has freed (it would read or write
// whatever the exporter allocated there next), and the same holds once
// ForgetPeer, the last ReleasePeer or Close ran. A handle this process has
// open already (OpenIPC, another key) is that mapping, shared.
//
// b comes from a peer: the allocation must hold b.Size bytes (a peer that
// claims more is refused rather than read past the mapping), and one of
// this process's own must be an allocation's base on this device.
func (d *Device) Import(b IPCBuffer) (DevicePtr, error) {
	if b.PID == d.pid {
		err := d.Do(func(drv Driver) error {
			base, n, err := drv.MemGetAddressRange(b.Base)
			if err == nil && (base != b.Base || n < b.Size) {
				err = fmt.Errorf("%w: %d bytes at %#x, this process's allocation there is %d bytes at %#x", ErrInvalidValue, b.Size, b.Base, n, base)
			}
			return err
		})
		if err != nil {
			return 0, err
		}
		return b.Base, nil
	}
	k := importKey{pid: b.PID, device: b.Device, base: b.Base}
	if p, ok, err := d.cached(k, b); ok {
		return p, err
	}
	var p DevicePtr
	err := d.Do(func(drv Driver) error {
		// Jobs run one at a time: a concurrent Import of the same buffer
		// opened it while this one waited.
		if ptr, ok, err := d.cached(k, b); ok {
			p = ptr
			return err
		}
		d.mu.Lock()
		stale := d.imports[k]
		delete(d.imports, k)
		d.mu.Unlock()
		if stale != nil {
			if err := d.closeHandle(drv, stale.handle); err != nil {
				return err
			}
		}
		ptr, size, err := d.openHandle(drv, b.Handle)
		if err != nil {
			return err
		}
		if size < b.Size {
			return errors.Join(tooSmall(b, size), d.closeHandle(drv, b.Handle))
		}
		d.mu.Lock()
		d.opens++
		d.imports[k] = &mapping{bufferID: b.BufferID, ptr: ptr, size: size, handle: b.Handle}
		d.mu.Unlock()
		p = ptr
		return nil
	})
	return p, err
}

// tooSmall is Import's refusal of a peer's claim of more bytes than the
// allocation holds.
func tooSmall(b IPCBuffer, size uint64) error {
	return fmt.Errorf("%w: process %d's allocation holds %d bytes, a peer claims %d", ErrInvalidValue, b.PID, size, b.Size)
}

// cached returns the mapping of k if its buffer id is still b's, and
// whether it found one; the error refuses a claim of more than it holds.
func (d *Device) cached(k importKey, b IPCBuffer) (DevicePtr, bool, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if m := d.imports[k]; m != nil && m.bufferID == b.BufferID {
		if m.size < b.Size {
			return 0, true, tooSmall(b, m.size)
		}
		d.hits++
		return m.ptr, true, nil
	}
	return 0, false, nil
}

// ForgetPeer closes every mapping Import opened from process pid (a peer
// that left); its allocations are freed once the exporter frees them too.
// It ignores RetainPeer's count: for a Device with one user of pid's
// mappings (a tool, a test); shared ones use ReleasePeer.
func (d *Device) ForgetPeer(pid int) error {
	return d.Do(func(drv Driver) error {
		var errs []error
		for _, m := range d.takeImports(func(k importKey) bool { return k.pid == pid }) {
			errs = append(errs, d.closeHandle(drv, m.handle))
		}
		return errors.Join(errs...)
	})
}

// RetainPeer counts one more user of the mappings Import opens of process
// pid's allocations (a connection that pulls from it; call it before
// Import): they stay open until as many ReleasePeer calls. Users of one
// Device (engines sharing it) thus never close each other's mappings.
func (d *Device) RetainPeer(pid int) {
	d.mu.Lock()
	d.peers[pid]++
	d.mu.Unlock()
}

// ReleasePeer drops one user of pid's mappings; the last one closes them
// (ForgetPeer). The count drops and the mappings leave the cache together,
// on the executor: an Import after a RetainPeer that came too late for
// this release opens anew, after the close.
func (d *Device) ReleasePeer(pid int) error {
	return d.Do(func(drv Driver) error {
		d.mu.Lock()
		if d.peers[pid]--; d.peers[pid] > 0 {
			d.mu.Unlock()
			return nil
		}
		delete(d.peers, pid)
		var gone []*mapping
		for k, m := range d.imports {
			if k.pid == pid {
				gone = append(gone, m)
				delete(d.imports, k)
			}
		}
		d.mu.Unlock()
		var errs []error
		for _, m := range gone {
			errs = append(errs, d.closeHandle(drv, m.handle))
		}
		return errors.Join(errs...)
	})
}

// openHandle returns this process's mapping of h and the allocation's size,
// opening it the first time; every call is matched by a closeHandle.
// Memory on another device opens too, over peer access (a pull from
// another GPU of the host). Executor only.
func (d *Device) openHandle(drv Driver, h IpcMemHandle) (DevicePtr, uint64, error) {
	d.mu.Lock()
	if r := d.handles[h]; r != nil {
		r.refs++
		d.mu.Unlock()
		return r.ptr, r.size, nil
	}
	d.mu.Unlock()
	p, err := drv.IpcOpenMemHandle(h, IpcLazyEnablePeerAccess)
	if err != nil {
		return 0, 0, err
	}
	_, size, err := drv.MemGetAddressRange(p)
	if err != nil {
		return 0, 0, errors.Join(err, drv.IpcCloseMemHandle(p))
	}
	d.mu.Lock()
	d.handles[h] = &handleRef{ptr: p, size: size, refs: 1}
	d.mu.Unlock()
	return p, size, nil
}

// closeHandle lets one use of h's mapping go, closing the mapping with the
// last. Executor only.
func (d *Device) closeHandle(drv Driver, h IpcMemHandle) error {
	d.mu.Lock()
	r := d.handles[h]
	if r == nil {
		d.mu.Unlock()
		return fmt.Errorf("%w: closing an IPC handle that is not open", ErrInvalidValue)
	}
	if r.refs--; r.refs > 0 {
		d.mu.Unlock()
		return nil
	}
	delete(d.handles, h)
	d.mu.Unlock()
	return drv.IpcCloseMemHandle(r.ptr)
}

// ImportStats returns how many handles Import opened and how many it
// answered from its cache.
func (d *Device) ImportStats() (opens, hits int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.opens, d.hits
}

// takeImports removes the mappings whose keys match and returns them.
func (d *Device) takeImports(match func(importKey) bool) []*mapping {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []*mapping
	for k, m := range d.imports {
		if match(k) {
			out = append(out, m)
			delete(d.imports, k)
		}
	}
	return out
}
