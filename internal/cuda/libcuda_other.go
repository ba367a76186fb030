//go:build !(linux && (amd64 || arm64))

package cuda

import "fmt"

// Library is the SONAME Open loads on Linux.
const Library = "libcuda.so.1"

// LibraryEnv names a library Open loads instead of Library, on Linux.
const LibraryEnv = "HANDOFF_LIBCUDA"

// Open reports ErrNoDriver: this package loads the driver on linux/amd64
// and linux/arm64 only (purego passes the 64-byte IPC handle by value
// there).
func Open() (Driver, error) { return Load(Library) }

// Load reports ErrNoDriver on this platform.
func Load(path string) (Driver, error) {
	return nil, fmt.Errorf("%w: %s is not loaded on this platform", ErrNoDriver, path)
}
