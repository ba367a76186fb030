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
// part of unit u (block or row) lies at Offset + u*Stride of buffer
// Buffer, in the pool's element order (heads, then tokens, then head_dim
// for K and V, unless the KV order says otherwise). Buffer indexes the
// buffers a registration passes (Request.Buffers); a registration by pool
// (KVBytes, MambaBytes) has one buffer per cache, Buffer 0.
type Plane struct {
	Offset int64 `msgpack:"offset"`
	Stride int64 `msgpack:"stride"`
	Buffer int   `msgpack:"buffer,omitempty"`
}

// placement maps a cache's virtual unit bytes to offsets in the
// registration's buffers (by their index).
type placement struct {
	unit   uint64   // a unit's virtual bytes
	starts []uint64 // each plane's virtual start in the unit, ascending; nil: units back to back
	parts  []part   // the bytes each plane occupies (one part for units back to back)
	need   []uint64 // by buffer: the bytes it must hold at least
}

// part is the bytes one plane occupies in buffer buf: len bytes at off +
// u*stride for every unit u, the last ending at end.
type part struct {
	buf                   int
	off, stride, len, end uint64
}

// clash says how parts a and b, in one buffer, share a byte, or "" when
// they do not. Parts whose spans overlap must share a stride
// (interleaved, as K and V of a layer in one [blocks][2] tensor) and
// occupy disjoint residues of it; differing strides over shared bytes are
// refused rather than proven apart.
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

// newPlacement validates planes for units units whose virtual bytes are
// the planes' lens in order; home is the buffer of a cache without planes
// (units back to back from its start), -1 where planes are required. It
// refuses planes that overlap themselves or each other in a buffer: a
// write into one block would land in another's bytes.
func newPlacement(what string, units int, lens []uint64, planes []Plane, home int) (placement, error) {
	m := placement{}
	for _, n := range lens {
		m.unit += n
	}
	bad := func(format string, args ...any) (placement, error) {
		return placement{}, fmt.Errorf("%w: %s planes: "+format, append([]any{ErrInvalidLayout, what}, args...)...)
	}
	if planes == nil {
		if home < 0 {
			return bad("none declared, and buffers were registered: each plane must name its buffer")
		}
		size := uint64(units) * m.unit
		m.parts = []part{{home, 0, m.unit, m.unit, size}}
		m.need = make([]uint64, home+1)
		m.need[home] = size
		return m, nil
	}
	if len(planes) != len(lens) {
		return bad("%d declared, the layout has %d", len(planes), len(lens))
	}
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
		b := pl.Buffer
		if home >= 0 {
			if b != 0 {
				return bad("plane %d names buffer %d, but the memory was registered by pool (no buffers)", i, b)
			}
			b = home
		} else if b < 0 || b >= maxBuffers {
			return bad("plane %d names buffer %d, want 0..%d", i, b, maxBuffers-1)
		}
		m.parts[i] = part{b, uint64(pl.Offset), uint64(pl.Stride), lens[i], uint64(pl.Offset) + last*uint64(pl.Stride) + lens[i]}
		if b >= len(m.need) {
			m.need = append(m.need, make([]uint64, b+1-len(m.need))...)
		}
		m.need[b] = max(m.need[b], m.parts[i].end)
	}
	for i := range m.parts {
		for j := i + 1; j < len(m.parts); j++ {
			if m.parts[i].buf != m.parts[j].buf {
				continue
			}
			if c := clash(m.parts[i], m.parts[j]); c != "" {
				return bad("planes %d and %d %s", i, j, c)
			}
		}
	}
	return m, nil
}

// placed reports whether the layout placed the cache in planes.
func (m *placement) placed() bool { return m.starts != nil }

// at returns where virtual byte off of unit u lies (buffer and offset in
// it) and how many bytes from there are contiguous in the unit's virtual
// order.
func (m *placement) at(u int, off uint64) (buf int, o, run uint64) {
	if m.starts == nil {
		return m.parts[0].buf, uint64(u)*m.unit + off, m.unit - off
	}
	i := sort.Search(len(m.starts), func(i int) bool { return m.starts[i] > off }) - 1
	d := off - m.starts[i]
	pt := m.parts[i]
	return pt.buf, pt.off + uint64(u)*pt.stride + d, pt.len - d
}

// spans appends the extents holding n virtual bytes of unit u from off, in
// virtual order, in the regions of the registration's buffers (by index).
func (m *placement) spans(out []rdma.Extent, regions []rdma.RegionID, u int, off, n uint64) []rdma.Extent {
	for n > 0 {
		b, o, run := m.at(u, off)
		run = min(run, n)
		out = append(out, rdma.Extent{Region: regions[b], Offset: o, Length: run})
		off, n = off+run, n-run
	}
	return out
}
