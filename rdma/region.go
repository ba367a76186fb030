package rdma

import (
	"fmt"
	"sort"
	"sync"

	"github.com/handoff-io/handoff/internal/cuda"
)

// Region is registered memory owned by an Engine: host memory (Register) or
// a device allocation (RegisterDevice). Bytes is valid until Engine.Close
// unmaps it; a Region is safe for concurrent use.
type Region struct {
	id   RegionID
	name string
	mem  []byte          // host memory; nil for a device region
	dev  *cuda.Arena     // device memory; nil for a host region
	ipc  *cuda.IPCBuffer // the device allocation exported for cuda-ipc; nil when not exported
	size uint64
	fd   int // memfd backing mem, or -1 when the memory is not shareable

	mu        sync.Mutex
	forbidden []span // sorted, merged
}

// span is a half-open byte range [off, end).
type span struct{ off, end uint64 }

// ID returns the region id peers name in extents.
func (r *Region) ID() RegionID { return r.id }

// Name returns the name given to Register.
func (r *Region) Name() string { return r.name }

// Bytes returns the region's memory. The slice is valid until Engine.Close;
// using it afterwards faults, because the memory is unmapped. A device
// region has no host bytes: Bytes returns nil, and its memory is reached
// through Arena.
func (r *Region) Bytes() []byte { return r.mem }

// Arena returns the device allocation of a device region, nil for a host
// region.
func (r *Region) Arena() *cuda.Arena { return r.dev }

// Memory reports where the region lives.
func (r *Region) Memory() Memory {
	if r.dev != nil {
		return MemoryCUDA
	}
	return MemoryHost
}

// Len returns the region length in bytes.
func (r *Region) Len() int64 { return int64(r.size) }

// Shareable reports whether a same-host peer can map the region (shm).
func (r *Region) Shareable() bool { return r.fd >= 0 }

// Forbid marks [offset, offset+length) as never grantable: OpenGrant over any
// byte of it fails with ErrForbidden. It is meant for reserved rows (the ADP
// dummy and padding rows of the Mamba pool). Forbidding a range outside the
// region is a programming error and panics.
func (r *Region) Forbid(offset, length uint64) {
	if length == 0 {
		return
	}
	if offset > r.size || length > r.size-offset {
		panic(fmt.Sprintf("rdma: Forbid(%d, %d) outside region %d of %d bytes", offset, length, r.id, r.size))
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.forbidden = append(r.forbidden, span{offset, offset + length})
	sort.Slice(r.forbidden, func(i, j int) bool { return r.forbidden[i].off < r.forbidden[j].off })
	merged := r.forbidden[:1]
	for _, s := range r.forbidden[1:] {
		last := &merged[len(merged)-1]
		if s.off <= last.end {
			last.end = max(last.end, s.end)
			continue
		}
		merged = append(merged, s)
	}
	r.forbidden = merged
}

// Forbidden returns a copy of the forbidden ranges as extents.
func (r *Region) Forbidden() []Extent {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Extent, len(r.forbidden))
	for i, s := range r.forbidden {
		out[i] = Extent{Region: r.id, Offset: s.off, Length: s.end - s.off}
	}
	return out
}

// checkExtent validates that e lies inside the region and, when grant is
// set, that it touches no forbidden byte.
func (r *Region) checkExtent(e Extent, grant bool) error {
	if e.Length == 0 {
		return fmt.Errorf("%w: empty extent in region %d", ErrOutOfRange, e.Region)
	}
	size := r.size
	if e.Offset > size || e.Length > size-e.Offset {
		return fmt.Errorf("%w: [%d, +%d) outside region %d of %d bytes", ErrOutOfRange, e.Offset, e.Length, e.Region, size)
	}
	if !grant {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	end := e.Offset + e.Length
	i := sort.Search(len(r.forbidden), func(i int) bool { return r.forbidden[i].end > e.Offset })
	if i < len(r.forbidden) && r.forbidden[i].off < end {
		f := r.forbidden[i]
		return fmt.Errorf("%w: [%d, %d) of region %d overlaps forbidden [%d, %d)", ErrForbidden, e.Offset, end, e.Region, f.off, f.end)
	}
	return nil
}

// slice returns the bytes of e; e must have passed checkExtent. A device
// region has none: nil.
func (r *Region) slice(e Extent) []byte {
	if r.mem == nil {
		return nil
	}
	return r.mem[e.Offset : e.Offset+e.Length : e.Offset+e.Length]
}
