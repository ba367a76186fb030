package service

import (
	"errors"
	"fmt"
	"log/slog"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/worker/config"
)

// cacheMemory is where a node's pool arenas live (--memory): host memory,
// or allocations on one CUDA device (--cuda-device).
type cacheMemory struct {
	dev    *cuda.Device // nil: host memory
	allocs []*cuda.Arena
}

// openMemory opens what --memory asks for. Host memory never loads the
// driver; cuda without a usable driver or device fails by name, it never
// falls back to host memory.
func openMemory(cfg config.Config, log *slog.Logger, open func() (cuda.Driver, error)) (*cacheMemory, error) {
	m, err := cuda.ParseMemory(cfg.Memory)
	if err != nil {
		return nil, err
	}
	if open == nil {
		open = cuda.Open
	}
	d, err := cuda.OpenMemory(m, cfg.CUDADevice, open)
	if err != nil {
		return nil, err
	}
	if d != nil {
		log.Info("caches in device memory", "memory", string(m), "device", d.UUID().String(), "ordinal", d.Ordinal())
	}
	return &cacheMemory{dev: d}, nil
}

// device reports whether the arenas are device allocations.
func (c *cacheMemory) device() bool { return c != nil && c.dev != nil }

// arenas allocates a rank's KV and Mamba arenas on the device.
func (c *cacheMemory) arenas(kvBytes, mambaBytes int64) (kv, mamba *cuda.Arena, err error) {
	for _, p := range []struct {
		a    **cuda.Arena
		size int64
		what string
	}{{&kv, kvBytes, "kv"}, {&mamba, mambaBytes, "mamba"}} {
		if *p.a, err = c.dev.NewArena(uint64(p.size)); err != nil {
			return nil, nil, fmt.Errorf("%s arena of %d bytes on %s: %w", p.what, p.size, c.dev.UUID(), err)
		}
		c.allocs = append(c.allocs, *p.a)
	}
	return kv, mamba, nil
}

// register registers an arena with the data plane: the device arena a, or
// a host region of size bytes when a is nil.
func (c *cacheMemory) register(e *rdma.Engine, name string, a *cuda.Arena, size int64) (*rdma.Region, error) {
	if a != nil {
		return e.RegisterDevice(name, a)
	}
	return e.Register(name, size)
}

// close frees the arenas and closes the device; the data plane must be
// closed first.
func (c *cacheMemory) close(log *slog.Logger) {
	if !c.device() {
		return
	}
	var errs []error
	for _, a := range c.allocs {
		errs = append(errs, a.Free())
	}
	c.allocs = nil
	errs = append(errs, c.dev.Close())
	if err := errors.Join(errs...); err != nil {
		log.Warn("device memory release", "err", err)
	}
}
