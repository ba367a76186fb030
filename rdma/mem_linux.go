//go:build linux

package rdma

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// allocShared allocates size bytes backed by a memfd, mapped shared, so a
// peer on the same host can map the same pages (the shm transport). It
// returns the mapping and the memfd.
func allocShared(name string, size int64) ([]byte, int, error) {
	if len(name) > 200 {
		name = name[:200]
	}
	fd, err := unix.MemfdCreate("handoff:"+name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, -1, fmt.Errorf("rdma: memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		unix.Close(fd)
		return nil, -1, fmt.Errorf("rdma: ftruncate memfd to %d bytes: %w", size, err)
	}
	// Its size is fixed: the peers that map it never meet a page past the
	// end of the file (see sealShrink).
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
		unix.Close(fd)
		return nil, -1, fmt.Errorf("rdma: sealing memfd: %w", err)
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, -1, fmt.Errorf("rdma: mmap %d bytes: %w", size, err)
	}
	return mem, fd, nil
}

// freeShared unmaps mem and closes fd (either may be absent).
func freeShared(mem []byte, fd int) {
	if mem != nil {
		_ = unix.Munmap(mem)
	}
	if fd >= 0 {
		_ = unix.Close(fd)
	}
}

// mapShared maps size bytes of a memfd received from a peer.
func mapShared(fd int, size int64) ([]byte, error) {
	// Checked before the seal, so that a file refused keeps its seals, and
	// after it, so that it did not shrink in between.
	for seal := range 2 {
		if seal == 1 {
			sealShrink(fd)
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return nil, fmt.Errorf("rdma: fstat shared region: %w", err)
		}
		if st.Size < size {
			return nil, fmt.Errorf("%w: shared region is %d bytes, descriptor says %d", ErrOutOfRange, st.Size, size)
		}
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("rdma: mmap shared region: %w", err)
	}
	return mem, nil
}

// sealShrink forbids shrinking the file fd refers to, where its seals
// allow (a memfd made with MFD_ALLOW_SEALING): a mapping's pages past the
// end of a file that shrank fault with SIGBUS, which the Go runtime does
// not survive, so a peer or engine that shrank memory it shared would kill
// every process mapping it. A file that refuses seals (a memfd without
// sealing, a tmpfs file) is mapped all the same: its owner must keep its
// size (docs/agent.md).
func sealShrink(fd int) {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&(unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL) != 0 {
		return
	}
	_, _ = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK)
}
