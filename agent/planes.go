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
	parts  []part // the bytes each plane occupies (one part for units back to back)
	size   uint64 // the bytes the registered memory must hold at least
}

// part is the bytes one plane occupies: len bytes at off + u*stride for
// every unit u, the last ending at end.
type part struct{ off, stride, len, end uint64 }

// clash says how parts a and b share a byte, or "" when they do not. Parts
// whose spans overlap must share a stride (interleaved, as K and V of a
// layer in one [blocks][2] tensor) and occupy disjoint residues of it;
// differing strides over shared bytes are refused rather than proven
// apart.
func clash(a, b part) string {
	if a.end <= b.off || b.end <= a.off {
		return ""
	}
	if a.stride != b.stride {
		return fmt.Sprintf("share bytes at different strides (%d, %d)", a.stride, b.stride)
	}
	s := a.stride
	ra, rb := a.off%s, b.off%s
	if (rb+s-ra)%s < a.len || (ra+s-rb)%s < b.len {
		return fmt.Sprintf("overlap (offsets %d and %d, stride %d)", a.off, b.off, s)
	}
	return ""
}

// newPlacement validates planes (nil: units back to back) for units units
// whose virtual bytes are the planes' lens in order. It refuses planes
// that overlap themselves or each other: a write into one block would
// land in another's bytes.
func newPlacement(what string, units int, lens []uint64, planes []Plane) (placement, error) {
	m := placement{}
	for _, n := range lens {
		m.unit += n
	}
	if planes == nil {
		m.size = uint64(units) * m.unit
		m.parts = []part{{0, m.unit, m.unit, m.size}}
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
	m.parts = make([]part, len(lens))
	var at uint64
	for i, pl := range planes {
		m.starts[i], at = at, at+lens[i]
		if pl.Offset < 0 || pl.Stride < int64(lens[i]) {
			return bad("plane %d at offset %d with stride %d, want offset ≥ 0 and stride ≥ its %d bytes", i, pl.Offset, pl.Stride, lens[i])
		}
		last := uint64(units - 1)
		if uint64(pl.Offset) > math.MaxInt64-lens[i] || uint64(pl.Stride) > (math.MaxInt64-uint64(pl.Offset)-lens[i])/max(last, 1) {
			return bad("plane %d of %d units at stride %d overflows", i, units, pl.Stride)
		}
		m.parts[i] = part{uint64(pl.Offset), uint64(pl.Stride), lens[i], uint64(pl.Offset) + last*uint64(pl.Stride) + lens[i]}
		m.size = max(m.size, m.parts[i].end)
	}
	for i := range m.parts {
		for j := i + 1; j < len(m.parts); j++ {
			if c := clash(m.parts[i], m.parts[j]); c != "" {
				return bad("planes %d and %d %s", i, j, c)
			}
		}
	}
	return m, nil
}

// checkApart refuses KV and Mamba placements that share a byte, for pools
// registered in one piece of memory (one memfd for both).
func checkApart(kv, mamba placement) error {
	for i, a := range kv.parts {
		for j, b := range mamba.parts {
			if c := clash(a, b); c != "" {
				return fmt.Errorf("%w: in the one memory registered for both, kv plane %d and mamba plane %d %s", ErrInvalidLayout, i, j, c)
			}
		}
	}
	return nil
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
