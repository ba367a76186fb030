package agent

import (
	"fmt"
	"math"
	"sort"

	"github.com/handoff-io/handoff/rdma"
)

// Where a cache's bytes lie in the memory an engine registered. The agent
// plans, grants and places in the pools' block-major terms (a block is
// every attention layer's K then V; a row every Mamba layer's conv state
// then its SSM state): a unit's "virtual" bytes. An engine that keeps
// those planes apart (vLLM's and SGLang's per-layer buffers, each a
// [blocks][heads][tokens][head_dim] plane per layer's K and V) declares
// where each plane lies instead; only the extents a grant or a write
// names are translated, so plans, tickets and the layer-by-layer ranges
// stay in virtual terms and a per-layer engine and a block-major one
// exchange requests unchanged.

// Plane places one plane of a cache in the registered memory: the plane's
// part of unit u (block or row) lies at Offset + u*Stride, in the pool's
// element order (heads, then tokens, then head_dim for K and V).
type Plane struct {
	Offset int64 `msgpack:"offset"`
	Stride int64 `msgpack:"stride"`
}

// placement maps a cache's virtual unit bytes to offsets in its region.
type placement struct {
	unit   uint64   // a unit's virtual bytes
	starts []uint64 // each plane's virtual start in the unit, ascending; nil: units back to back
	lens   []uint64
	planes []Plane
	size   uint64 // the bytes the registered memory must hold at least
}

// newPlacement validates planes (nil: units back to back) for units units
// whose virtual bytes are the planes' lens in order. It refuses planes
// that overlap themselves or each other: a write into one block would
// land in another's bytes. Two planes whose footprints overlap must share
// a stride (interleaved, as K and V of a layer in one [blocks][2] tensor)
// and occupy disjoint residues of it; differing strides over shared
// bytes are refused rather than proven disjoint.
func newPlacement(what string, units int, lens []uint64, planes []Plane) (placement, error) {
	m := placement{}
	for _, n := range lens {
		m.unit += n
	}
	if planes == nil {
		m.size = uint64(units) * m.unit
		return m, nil
	}
	bad := func(format string, args ...any) (placement, error) {
		return placement{}, fmt.Errorf("%w: %s planes: "+format, append([]any{ErrInvalidLayout, what}, args...)...)
	}
	if len(planes) != len(lens) {
		return bad("%d declared, the layout has %d", len(planes), len(lens))
	}
	m.planes, m.lens = planes, lens
	m.starts = make([]uint64, len(lens))
	ends := make([]uint64, len(lens))
	var at uint64
	for i, pl := range planes {
		m.starts[i], at = at, at+lens[i]
		if pl.Offset < 0 || pl.Stride < int64(lens[i]) {
			return bad("plane %d at offset %d with stride %d, want offset ≥ 0 and stride ≥ its %d bytes", i, pl.Offset, pl.Stride, lens[i])
		}
		last := uint64(units - 1)
		if uint64(pl.Stride) > (math.MaxInt64-uint64(pl.Offset)-lens[i])/max(last, 1) {
			return bad("plane %d of %d units at stride %d overflows", i, units, pl.Stride)
		}
		ends[i] = uint64(pl.Offset) + last*uint64(pl.Stride) + lens[i]
		m.size = max(m.size, ends[i])
	}
	for i := range planes {
		for j := i + 1; j < len(planes); j++ {
			a, b := planes[i], planes[j]
			if ends[i] <= uint64(b.Offset) || ends[j] <= uint64(a.Offset) {
				continue // apart
			}
			if a.Stride != b.Stride {
				return bad("planes %d and %d share bytes at different strides (%d, %d)", i, j, a.Stride, b.Stride)
			}
			s := uint64(a.Stride)
			ra, rb := uint64(a.Offset)%s, uint64(b.Offset)%s
			if (rb+s-ra)%s < lens[i] || (ra+s-rb)%s < lens[j] {
				return bad("planes %d and %d overlap (offsets %d and %d, stride %d)", i, j, a.Offset, b.Offset, s)
			}
		}
	}
	return m, nil
}

// at returns where virtual byte off of unit u lies in the region and how
// many bytes from there are contiguous in the unit's virtual order.
func (m *placement) at(u int, off uint64) (uint64, uint64) {
	if m.starts == nil {
		return uint64(u)*m.unit + off, m.unit - off
	}
	i := sort.Search(len(m.starts), func(i int) bool { return m.starts[i] > off }) - 1
	d := off - m.starts[i]
	return uint64(m.planes[i].Offset) + uint64(u)*uint64(m.planes[i].Stride) + d, m.lens[i] - d
}

// spans appends the extents of region holding n virtual bytes of unit u
// from off, in virtual order.
func (m *placement) spans(out []rdma.Extent, region rdma.RegionID, u int, off, n uint64) []rdma.Extent {
	for n > 0 {
		o, run := m.at(u, off)
		run = min(run, n)
		out = append(out, rdma.Extent{Region: region, Offset: o, Length: run})
		off, n = off+run, n-run
	}
	return out
}
