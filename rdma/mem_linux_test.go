//go:build linux

package rdma

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestSharedMemoryCannotShrink: memory that peers map cannot shrink under
// them (a page past the end of its file faults with SIGBUS, which kills
// the process that touches it): rdma's own regions are sealed at birth,
// and a sealable file a peer or engine passes is sealed when mapped. One
// that refuses seals is mapped all the same.
func TestSharedMemoryCannotShrink(t *testing.T) {
	mem, fd, err := allocShared("seal", 1<<16)
	require.NoError(t, err)
	defer freeShared(mem, fd)
	require.ErrorIs(t, unix.Ftruncate(fd, 4096), unix.EPERM, "rdma's own region")

	// A file refused for its size keeps its seals as they were.
	small, err := unix.MemfdCreate("engine", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	require.NoError(t, err)
	defer unix.Close(small)
	require.NoError(t, unix.Ftruncate(small, 4096))
	_, err = mapShared(small, 1<<16)
	require.ErrorIs(t, err, ErrOutOfRange)
	require.NoError(t, unix.Ftruncate(small, 0), "a refused file is not sealed")

	for _, c := range []struct {
		name   string
		flags  int
		sealed bool
	}{
		{"sealable", unix.MFD_CLOEXEC | unix.MFD_ALLOW_SEALING, true},
		{"unsealable", unix.MFD_CLOEXEC, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			fd, err := unix.MemfdCreate("engine", c.flags)
			require.NoError(t, err)
			defer unix.Close(fd)
			require.NoError(t, unix.Ftruncate(fd, 1<<16))
			mem, err := mapShared(fd, 1<<16)
			require.NoError(t, err)
			defer unix.Munmap(mem)
			err = unix.Ftruncate(fd, 4096)
			if c.sealed {
				require.ErrorIs(t, err, unix.EPERM, "shrinking memory a peer maps")
				require.NoError(t, unix.Ftruncate(fd, 1<<17), "growing it is harmless")
			} else {
				require.NoError(t, err)
			}
		})
	}
}
