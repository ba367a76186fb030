//go:build !linux

package rdma

import (
	"testing"

	"github.com/handoff-io/handoff/internal/cuda"
)

// The fake driver (cudafake) is linux only: no device cases elsewhere.
func devicePairCases() []pairCase { return nil }

func deviceRegion(t testing.TB, _ *Engine, _ string, _ int64, _ int) (*Region, func()) {
	t.Skip("device regions are tested over the fake CUDA driver, which needs linux")
	return nil, nil
}

func bufFor(size uint64, pid int) cuda.IPCBuffer {
	return cuda.IPCBuffer{Base: 1 << 40, Size: size, BufferID: 1, PID: pid}
}
