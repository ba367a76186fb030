package rdma

import "fmt"

// RegisterFD registers size bytes of memory another process shares by file
// descriptor (a memfd, or a file in /dev/shm) as a region: the engine maps
// the file shared, so bytes that land in the region land in that process's
// pages too, and serves it over shm like its own memory (the handoff agent,
// issue 33, registers an engine's cache tensors this way). fd stays the
// caller's: the engine keeps a duplicate, closed with the mapping by
// Engine.Close. The file must be at least size bytes long.
func (e *Engine) RegisterFD(name string, fd int, size int64) (*Region, error) {
	if size <= 0 {
		return nil, fmt.Errorf("%w: region %q of %d bytes", ErrOutOfRange, name, size)
	}
	mem, own, err := mapFD(fd, size)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		freeShared(mem, own)
		return nil, ErrClosed
	}
	r := &Region{id: RegionID(len(e.regions) + 1), name: name, mem: mem, size: uint64(size), fd: own}
	e.regions[r.id] = r
	e.log.Info("rdma: region registered from a file descriptor", "region", r.id, "name", name, "bytes", size)
	return r, nil
}
