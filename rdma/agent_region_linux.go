//go:build linux

package rdma

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// mapFD duplicates fd and maps size bytes of it shared; it returns the
// mapping and the duplicate.
func mapFD(fd int, size int64) ([]byte, int, error) {
	own, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, -1, fmt.Errorf("rdma: dup region fd: %w", err)
	}
	mem, err := mapShared(own, size)
	if err != nil {
		unix.Close(own)
		return nil, -1, err
	}
	return mem, own, nil
}
