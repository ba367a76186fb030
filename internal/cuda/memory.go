package cuda

import (
	"fmt"
	"strings"
)

// Memory is where a worker keeps its caches: the value of --memory
// (HANDOFF_MEMORY).
type Memory string

const (
	// MemoryHost keeps the pools in host memory (memfd regions). The
	// default; the driver is never loaded.
	MemoryHost Memory = "host"
	// MemoryCUDA keeps the pools' arenas in device memory.
	MemoryCUDA Memory = "cuda"
)

// ParseMemory parses a --memory value ("" is host).
func ParseMemory(s string) (Memory, error) {
	switch m := Memory(strings.ToLower(strings.TrimSpace(s))); m {
	case "", MemoryHost:
		return MemoryHost, nil
	case MemoryCUDA:
		return m, nil
	}
	return "", fmt.Errorf("%w: --memory %q: want host or cuda", ErrInvalidValue, s)
}

// OpenMemory opens what m needs: nothing for host (a nil Device, and the
// driver is not loaded, so binaries run where there is none), and for cuda
// the driver (open: Open, or a fake in tests) and the device sel names
// (--cuda-device: ordinal or UUID). An explicit cuda without a usable
// driver fails (errors.Is(err, ErrNoDriver)); it never falls back to host
// memory silently.
func OpenMemory(m Memory, sel string, open func() (Driver, error)) (*Device, error) {
	switch m {
	case MemoryHost, "":
		return nil, nil
	case MemoryCUDA:
	default:
		return nil, fmt.Errorf("%w: memory %q", ErrInvalidValue, m)
	}
	drv, err := open()
	if err != nil {
		return nil, fmt.Errorf("--memory cuda: %w", err)
	}
	d, err := OpenDevice(drv, sel)
	if err != nil {
		return nil, fmt.Errorf("--memory cuda --cuda-device %q: %w", sel, err)
	}
	return d, nil
}
