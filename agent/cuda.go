package agent

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"sync"

	"github.com/handoff-io/handoff/internal/cuda"
)

// Device memory. An engine whose caches are on a GPU registers each pool
// by the CUDA IPC handle of the allocation it lies in, its offset there
// and the device's UUID (CUDAMemory) instead of by fd. The agent loads the
// driver the first time (Config.CUDA, by default libcuda through purego:
// no cgo), opens the device by UUID once, maps the allocation
// (cuda.Device.OpenIPC: refused when the pool would run past it) and
// registers the range as a device region (rdma.Engine.RegisterDevice).
// Grants, extents, the reserved rows' Forbid and the fences are offsets
// and work unchanged; bytes reach device regions as the workers' do (tcp
// staged through pinned buffers, device to device within a process, and
// with cuda-ipc between agents on one host the receiving agent pulls from
// the sending engine's allocation: the arena exports the engine's own
// handle, with the engine's pid, since a mapping opened by handle cannot
// be exported again; shm is never used for them). The mapping is closed
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

// openPools maps the pools q registers in device memory (nil for a pool
// in host memory). Two pools in one allocation (the same handle) are mapped
// once, as a driver opens a handle once per context, and must not overlap.
func (s *session) openPools(q Request) (kv, mam *cuda.Arena, err error) {
	k, m := q.KVCUDA, q.MambaCUDA
	if k != nil && m != nil && bytes.Equal(k.Handle, m.Handle) && q.KVBytes > 0 && q.MambaBytes > 0 {
		kLo, mLo := k.Offset, m.Offset
		kN, mN := uint64(q.KVBytes), uint64(q.MambaBytes)
		if kLo > math.MaxUint64-kN || mLo > math.MaxUint64-mN {
			return nil, nil, fmt.Errorf("%w: pool offsets %d and %d", ErrInvalidLayout, kLo, mLo)
		}
		if kLo < mLo+mN && mLo < kLo+kN {
			return nil, nil, fmt.Errorf("%w: the kv pool [%d, %d) and the mamba pool [%d, %d) overlap in one allocation",
				ErrInvalidLayout, kLo, kLo+kN, mLo, mLo+mN)
		}
		if k.Device != m.Device {
			return nil, nil, fmt.Errorf("%w: one allocation on devices %q and %q", ErrInvalidLayout, k.Device, m.Device)
		}
		lo := min(kLo, mLo)
		whole, err := s.a.openCUDA(&CUDAMemory{Handle: k.Handle, Offset: lo, Device: k.Device}, s.pid, max(kLo+kN, mLo+mN)-lo)
		if err != nil {
			return nil, nil, fmt.Errorf("agent: pools in device memory: %w", err)
		}
		s.arenas = append(s.arenas, whole)
		if kv, err = whole.View(kLo-lo, kN); err == nil {
			mam, err = whole.View(mLo-lo, mN)
		}
		return kv, mam, err
	}
	open := func(name string, dm *CUDAMemory, size int64) (*cuda.Arena, error) {
		if dm == nil || size <= 0 {
			return nil, nil
		}
		a, err := s.a.openCUDA(dm, s.pid, uint64(size))
		if err != nil {
			return nil, fmt.Errorf("agent: %s pool in device memory: %w", name, err)
		}
		s.arenas = append(s.arenas, a)
		return a, nil
	}
	if kv, err = open("kv", k, q.KVBytes); err != nil {
		return nil, nil, err
	}
	mam, err = open("mamba", m, q.MambaBytes)
	return kv, mam, err
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

// memoryOf names where a pool is, for logs.
func memoryOf(dm *CUDAMemory) string {
	if dm == nil {
		return "host"
	}
	return "cuda " + dm.Device
}
