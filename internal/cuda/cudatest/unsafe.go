package cudatest

import (
	"unsafe"

	"github.com/handoff-io/handoff/internal/cuda"
)

func unsafeBytes(p cuda.HostPtr, n int) []byte { return unsafe.Slice((*byte)(p), n) }
