package cuda

import "unsafe"

// hostBytes views n bytes of memory outside the Go heap at p.
func hostBytes(p HostPtr, n uint64) []byte {
	return unsafe.Slice((*byte)(p), n)
}
