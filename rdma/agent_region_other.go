//go:build !linux

package rdma

import "fmt"

func mapFD(fd int, size int64) ([]byte, int, error) {
	return nil, -1, fmt.Errorf("%w: regions from file descriptors need linux", ErrUnsupported)
}
