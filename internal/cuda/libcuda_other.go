//go:build !(linux && (amd64 || arm64)) || nocuda

package cuda

import "fmt"

// Library is the SONAME Open loads on Linux.
const Library = "libcuda.so.1"

// LibraryEnv names a library Open loads instead of Library, on Linux.
const LibraryEnv = "HANDOFF_LIBCUDA"

// Open reports ErrNoDriver: this package loads the driver on linux/amd64
// and linux/arm64 only (purego passes the 64-byte IPC handle by value
// there), and not in a binary built with -tags nocuda. Loading a library
// at run time needs the dynamic loader, so a binary that can load the
// driver is dynamically linked even with CGO_ENABLED=0 (purego's
// fakecgo); -tags nocuda keeps a binary static, for FROM scratch images.
func Open() (Driver, error) { return Load(Library) }

// Load reports ErrNoDriver on this platform or build.
func Load(path string) (Driver, error) {
	return nil, fmt.Errorf("%w: %s is not loaded by this build (linux/amd64 or arm64, without -tags nocuda)", ErrNoDriver, path)
}
