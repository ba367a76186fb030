package agent

import (
	"errors"
	"fmt"
	"math"
	"sync"

	"github.com/handoff-io/handoff/internal/cuda"
)

// Device memory. An engine whose caches are on a GPU registers each pool
// by the allocation it lies in, its offset there and the device's UUID
// (CUDAMemory): a cuMemAlloc allocation by its CUDA IPC handle, a VMM
// allocation (cuMemCreate) by a POSIX fd passed as host memory's are. The
// agent loads the driver the first time (Config.CUDA, by default libcuda
// through purego: no cgo), opens the device by UUID once, maps the
// allocation (cuda.Device.OpenIPC or OpenVMM: refused when the pool would
// run past it) and registers the range as a device region
// (rdma.Engine.RegisterDevice).
// Grants, extents, the reserved rows' Forbid and the fences are offsets
// and work unchanged; bytes reach device regions as the workers' do (tcp
// staged through pinned buffers, device to device within a process, and
// with cuda-ipc between agents on one host the receiving agent pulls from
// the sending engine's allocation: the arena exports the engine's own
// handle, with the engine's pid, since a mapping opened by handle cannot
// be exported again; shm is never used for them; a VMM allocation has no
// IPC handle, so its peers reach it by tcp). The mapping is closed
// when the engine's session ends, after its rdma engine (so after every
// grant was revoked): the engine's allocation is its own.

// agentCUDA is the driver and the devices opened for engines' pools. A
// device stays open while a mapping of an engine's memory on it does (its
// users), so that the agent's GPU is the one of the engines it serves, not
// of the first engine that named one, whose registration may have failed.
type agentCUDA struct {
	mu    sync.Mutex
	drv   cuda.Driver
	devs  map[string]*cuda.Device // by the UUID engines name
	users map[*cuda.Device]int
}

// openCUDA maps size bytes of the device memory dm names, which process
// pid (the engine) exported.
func (a *Agent) openCUDA(dm *CUDAMemory, pid int, size uint64) (*cuda.Arena, error) {
	var h cuda.IpcMemHandle
	if len(dm.Handle) != len(h.Reserved) {
		return nil, fmt.Errorf("%w: a CUDA IPC handle of %d bytes, want %d", ErrInvalidLayout, len(dm.Handle), len(h.Reserved))
	}
	copy(h.Reserved[:], dm.Handle)
	d, err := a.cuda.device(a.cfg.CUDA, dm.Device)
	if err != nil {
		return nil, err
	}
	m, err := d.OpenIPC(h, pid, dm.Offset, size)
	if err != nil {
		if errors.Is(err, cuda.ErrInvalidValue) {
			// The engine's handle, offset or size: not the agent's fault.
			err = fmt.Errorf("%w: %w", ErrInvalidLayout, err)
		}
		return nil, errors.Join(err, a.cuda.release(d))
	}
	return m, nil
}

// openVMM maps size bytes from off of the VMM allocation of allocSize
// bytes on device uuid that the engine passed as fd.
func (a *Agent) openVMM(uuid string, fd int, allocSize, off, size uint64) (*cuda.Arena, error) {
	d, err := a.cuda.device(a.cfg.CUDA, uuid)
	if err != nil {
		return nil, err
	}
	m, err := d.OpenVMM(fd, allocSize, off, size)
	if err != nil {
		if errors.Is(err, cuda.ErrInvalidValue) {
			// The engine's fd, sizes or offset: not the agent's fault.
			err = fmt.Errorf("%w: %w", ErrInvalidLayout, err)
		}
		return nil, errors.Join(err, a.cuda.release(d))
	}
	return m, nil
}

// openBuffers maps the buffers in device memory (nil for one in host
// memory), by index. Buffers in one allocation (one IPC handle, or one VMM
// allocation's id) are mapped once, as a driver opens a handle once per
// context: one mapping from the lowest of their offsets to the highest
// end, a view of it each. Whether their planes overlap was checked before
// (checkBuffers).
func (s *session) openBuffers(bufs []Buffer, mems []bufferMem) ([]*cuda.Arena, error) {
	out := make([]*cuda.Arena, len(bufs))
	groups := map[string][]int{}
	var order []string
	for i, b := range bufs {
		if b.CUDA == nil || b.Bytes <= 0 {
			continue
		}
		k := "ipc " + string(b.CUDA.Handle)
		if b.CUDA.VMMBytes > 0 {
			k = fmt.Sprintf("vmm buffer %d", i) // an allocation of its own
			if b.CUDA.VMMID != 0 {
				k = mems[i].key
			}
		}
		if _, ok := groups[k]; !ok {
			order = append(order, k)
		}
		groups[k] = append(groups[k], i)
	}
	for _, k := range order {
		idx := groups[k]
		first := bufs[idx[0]].CUDA
		lo, hi := uint64(math.MaxUint64), uint64(0)
		for _, i := range idx {
			dm, n := bufs[i].CUDA, uint64(bufs[i].Bytes)
			if dm.Device != first.Device {
				return nil, fmt.Errorf("%w: one allocation on devices %q and %q", ErrInvalidLayout, first.Device, dm.Device)
			}
			if dm.VMMBytes != first.VMMBytes {
				return nil, fmt.Errorf("%w: one VMM allocation of %d and of %d bytes", ErrInvalidLayout, first.VMMBytes, dm.VMMBytes)
			}
			lo, hi = min(lo, dm.Offset), max(hi, dm.Offset+n)
		}
		var whole *cuda.Arena
		var err error
		if first.VMMBytes > 0 {
			whole, err = s.a.openVMM(first.Device, mems[idx[0]].fd, first.VMMBytes, lo, hi-lo)
		} else {
			whole, err = s.a.openCUDA(&CUDAMemory{Handle: first.Handle, Offset: lo, Device: first.Device}, s.pid, hi-lo)
		}
		if err != nil {
			return nil, fmt.Errorf("agent: %s in device memory: %w", mems[idx[0]].name, err)
		}
		s.arenas = append(s.arenas, whole)
		if len(idx) == 1 {
			out[idx[0]] = whole
			continue
		}
		for _, i := range idx {
			if out[i], err = whole.View(bufs[i].CUDA.Offset-lo, uint64(bufs[i].Bytes)); err != nil {
				return nil, err
			}
		}
	}
	return out, nil
}

// device returns the open device uuid names, opening the driver and the
// device the first time, for one more user (release).
func (c *agentCUDA) device(open func() (cuda.Driver, error), uuid string) (*cuda.Device, error) {
	if uuid == "" {
		return nil, fmt.Errorf("%w: device memory without the device's UUID", ErrInvalidLayout)
	}
	key := uuid // as the driver prints it, however the engine spelled it
	if u, err := cuda.ParseUUID(uuid); err == nil {
		key = u.String()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if d := c.devs[key]; d != nil {
		c.users[d]++
		return d, nil
	}
	// One GPU per agent, as one agent per engine worker: the IPC handles
	// an agent opens are shared by its engines' pools and pulls per
	// device, and a handle open on one device is not opened again on
	// another. The device an engine's memory is on is the agent's while
	// some engine's memory on it is mapped.
	for other := range c.devs {
		return nil, fmt.Errorf("%w: this agent serves device %s; memory on device %s needs an agent of its own", ErrInvalidLayout, other, key)
	}
	if c.drv == nil {
		if open == nil {
			open = cuda.Open
		}
		drv, err := open()
		if err != nil {
			return nil, fmt.Errorf("loading the CUDA driver: %w", err)
		}
		c.drv = drv
	}
	d, err := cuda.OpenDevice(c.drv, uuid)
	if errors.Is(err, cuda.ErrInvalidDevice) {
		return nil, fmt.Errorf("%w: %w", ErrInvalidLayout, err) // the engine named a device this agent does not see
	}
	if err != nil {
		return nil, err
	}
	if c.devs == nil {
		c.devs, c.users = map[string]*cuda.Device{}, map[*cuda.Device]int{}
	}
	c.devs[key] = d
	c.users[d] = 1
	return d, nil
}

// release drops a user of d; the last one closes it.
func (c *agentCUDA) release(d *cuda.Device) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.users[d]--; c.users[d] > 0 {
		return nil
	}
	delete(c.users, d)
	for k, x := range c.devs {
		if x == d {
			delete(c.devs, k)
		}
	}
	return d.Close()
}

// close closes the devices; every session has ended.
func (c *agentCUDA) close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var errs []error
	for _, d := range c.devs {
		errs = append(errs, d.Close())
	}
	c.devs, c.users = nil, nil
	return errors.Join(errs...)
}

// closeArenas closes the mappings of the engine's device memory, and
// the devices they were the last users of.
func (s *session) closeArenas() {
	for _, a := range s.arenas {
		if err := a.Free(); err != nil {
			s.log.Warn("agent: closing a device memory mapping", "err", err)
		}
		if err := s.a.cuda.release(a.Device()); err != nil {
			s.log.Warn("agent: closing a device", "err", err)
		}
	}
	s.arenas = nil
}

// memoryOf names where the buffers are, for logs: host, a GPU, or both.
func memoryOf(bufs []Buffer) string {
	dev, host := "", false
	for _, b := range bufs {
		switch {
		case b.Bytes == 0:
		case b.CUDA != nil:
			dev = "cuda " + b.CUDA.Device
		default:
			host = true
		}
	}
	switch {
	case dev == "":
		return "host"
	case host:
		return dev + " and host"
	}
	return dev
}
