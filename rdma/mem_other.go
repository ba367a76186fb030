//go:build !linux

package rdma

import "fmt"

// allocShared falls back to heap memory where memfd is unavailable; such
// regions are not reachable over shm.
func allocShared(name string, size int64) ([]byte, int, error) {
	return make([]byte, size), -1, nil
}

func freeShared(mem []byte, fd int) {}

func mapShared(fd int, size int64) ([]byte, error) {
	return nil, fmt.Errorf("%w: shared regions need linux", ErrUnsupported)
}
