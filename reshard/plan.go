package reshard

import (
	"fmt"
	"iter"
	"slices"
	"strings"
)

// Copy moves Count pieces of Len bytes: piece i from offset Src+i·SrcStride
// of a source shard's unit to offset Dst+i·DstStride of a destination
// shard's unit. The strides are the two shards' row sizes, or, for a copy
// that covers whole units on both sides, the unit sizes with Count 1; in
// both cases Count·SrcStride and Count·DstStride are the two unit sizes,
// which is what lets Repeat extend a copy over a run of units.
type Copy struct {
	Src, Dst             int64
	Len                  int64
	Count                int
	SrcStride, DstStride int64
}

// Piece is one contiguous byte copy.
type Piece struct{ Src, Dst, Len int64 }

// Bytes is the number of bytes c moves: Count·Len.
func (c Copy) Bytes() int64 { return int64(c.Count) * c.Len }

// Pieces yields c's contiguous copies in order.
func (c Copy) Pieces() iter.Seq[Piece] {
	return func(yield func(Piece) bool) {
		s, d := c.Src, c.Dst
		for range c.Count {
			if !yield(Piece{s, d, c.Len}) {
				return
			}
			s, d = s+c.SrcStride, d+c.DstStride
		}
	}
}

// Repeat returns c extended over n consecutive units (a run of n KV blocks
// or Mamba rows), offsets relative to the run's first unit. n must be ≥ 1.
func (c Copy) Repeat(n int) Copy {
	if n < 1 {
		panic(fmt.Sprintf("reshard: Repeat(%d), want n >= 1", n))
	}
	if c.Count == 1 && c.Len == c.SrcStride && c.Len == c.DstStride {
		c.Len *= int64(n) // whole units on both sides: one contiguous copy
		c.SrcStride, c.DstStride = c.Len, c.Len
		return c
	}
	c.Count *= n
	return c
}

// String renders c as "src→dst len×count (strides)".
func (c Copy) String() string {
	if c.Count == 1 {
		return fmt.Sprintf("%d→%d %d", c.Src, c.Dst, c.Len)
	}
	return fmt.Sprintf("%d→%d %d×%d (%d/%d)", c.Src, c.Dst, c.Len, c.Count, c.SrcStride, c.DstStride)
}

// Apply performs cs on one unit (or, for repeated copies, one run): it
// copies from src, a source shard's unit, into dst, a destination shard's.
// It panics if a copy falls outside either slice.
func Apply(dst, src []byte, cs []Copy) {
	for _, c := range cs {
		s, d := c.Src, c.Dst
		for range c.Count {
			copy(dst[d:d+c.Len], src[s:s+c.Len])
			s, d = s+c.SrcStride, d+c.DstStride
		}
	}
}

// ApplyRange is Apply restricted to the destination bytes [lo, hi): the
// parts of cs's copies that land there, and nothing else.
func ApplyRange(dst, src []byte, cs []Copy, lo, hi int64) {
	for _, c := range cs {
		s, d := c.Src, c.Dst
		for range c.Count {
			if a, b := max(d, lo), min(d+c.Len, hi); a < b {
				copy(dst[a:b], src[s+a-d:s+b-d])
			}
			s, d = s+c.SrcStride, d+c.DstStride
		}
	}
}

// Plan is the resharding of one cache unit (a KV block or a Mamba row) from
// a TP-From group to a TP-To group: for every (source shard, destination
// shard) pair, the copies from the source's unit into the destination's.
// Every byte of every destination unit is written by exactly one copy of
// one pair. A Plan is immutable and safe for concurrent use.
type Plan struct {
	Layout   Layout
	From, To int
	SrcBytes int64 // one unit on a TP-From shard
	DstBytes int64 // one unit on a TP-To shard
	copies   [][]Copy
}

// New computes the plan that moves units of layout l from a TP-from group
// to a TP-to group. It refuses, by name, a layout that does not split over
// either size: the error wraps ErrInvalidShape, ErrInvalidTP or
// ErrIndivisible.
//
// The errors of the two sides are prefixed "source: " and "destination: ".
//
// For each pair and each section it is the overlap rule: the items the
// source writes (those it holds, and for replicated items only on the
// replica chosen for that destination) intersected with the items the
// destination holds, one
// contiguous run of items, one Copy repeated over the rows. Copies adjacent
// on both sides are merged, so a pair has at most one copy per section, a
// plan at most len(Sections)·(from+to-1) copies, and a pair whose shards
// hold the same items one copy of the whole unit.
func New(l Layout, from, to int) (*Plan, error) {
	if err := l.Check(from); err != nil {
		return nil, fmt.Errorf("source: %w", err)
	}
	if err := l.Check(to); err != nil {
		return nil, fmt.Errorf("destination: %w", err)
	}
	l.Sections = slices.Clone(l.Sections) // the plan's own: immutable
	p := &Plan{
		Layout: l, From: from, To: to,
		SrcBytes: l.UnitBytes(from), DstBytes: l.UnitBytes(to),
		copies: make([][]Copy, from*to),
	}
	srcRow, dstRow := l.RowBytes(from), l.RowBytes(to)
	for rs := range from {
		for rd := range to {
			var cs []Copy
			var srcOff, dstOff int64 // the section's start in a source / destination row
			for _, s := range l.Sections {
				wlo, whi := writes(s.Items, from, rs, rd)
				dlo, dhi := holds(s.Items, to, rd)
				if lo, hi := max(wlo, dlo), min(whi, dhi); lo < hi {
					slo, _ := holds(s.Items, from, rs)
					cs = appendMerged(cs, Copy{
						Src:   srcOff + int64(lo-slo)*s.ItemBytes,
						Dst:   dstOff + int64(lo-dlo)*s.ItemBytes,
						Len:   int64(hi-lo) * s.ItemBytes,
						Count: l.Rows, SrcStride: srcRow, DstStride: dstRow,
					})
				}
				srcOff += int64(local(s.Items, from)) * s.ItemBytes
				dstOff += int64(local(s.Items, to)) * s.ItemBytes
			}
			for i, c := range cs {
				if c.Len == c.SrcStride && c.Len == c.DstStride {
					cs[i] = Copy{Src: c.Src, Dst: c.Dst, Len: c.Bytes(), Count: 1, SrcStride: c.Bytes(), DstStride: c.Bytes()}
				}
			}
			p.copies[rs*to+rd] = cs
		}
	}
	return p, nil
}

// appendMerged appends c to cs, merged into the last copy when it continues
// it on both sides.
func appendMerged(cs []Copy, c Copy) []Copy {
	if n := len(cs); n > 0 {
		last := &cs[n-1]
		if last.Src+last.Len == c.Src && last.Dst+last.Len == c.Dst {
			last.Len += c.Len // same Count and strides: every copy of a plan has them
			return cs
		}
	}
	return append(cs, c)
}

// Copies returns the copies from source shard src (0..From-1) into
// destination shard dst (0..To-1), nil when src writes nothing there. The
// slice is the plan's: do not modify it. It panics on an out-of-range shard.
func (p *Plan) Copies(src, dst int) []Copy {
	if src < 0 || src >= p.From || dst < 0 || dst >= p.To {
		panic(fmt.Sprintf("reshard: pair (%d, %d) outside a %d→%d plan", src, dst, p.From, p.To))
	}
	return p.copies[src*p.To+dst]
}

// Len is the number of copies of the plan, all pairs together: the size of
// its descriptors, O(sections·(From+To)), whatever the unit's size.
func (p *Plan) Len() int {
	n := 0
	for _, cs := range p.copies {
		n += len(cs)
	}
	return n
}

// String renders the plan, one line per pair that copies anything.
func (p *Plan) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %d→%d (unit %d→%d bytes)", p.Layout.Name, p.From, p.To, p.SrcBytes, p.DstBytes)
	for rs := range p.From {
		for rd := range p.To {
			if cs := p.Copies(rs, rd); len(cs) > 0 {
				fmt.Fprintf(&b, "\n  %d→%d: %v", rs, rd, cs)
			}
		}
	}
	return b.String()
}

// Sourced is one contiguous stretch of a destination shard's unit and its
// one writer: Len bytes at offset Dst come from offset Src of source shard
// Shard's unit.
type Sourced struct {
	Shard         int
	Src, Dst, Len int64
}

// Order returns the stretches that fill destination shard dst's unit, in
// destination byte order, each with the source shard that writes it (the
// plan's copies of every pair, cut into pieces and sorted by destination
// offset; pieces that continue each other on both sides from the same
// source merge). They tile [0, DstBytes) exactly: a data path that reads
// the sources in this order produces the destination unit as one stream.
// It panics on an out-of-range shard, and if the pieces do not tile (which
// the plan's construction excludes).
func (p *Plan) Order(dst int) []Sourced {
	if dst < 0 || dst >= p.To {
		panic(fmt.Sprintf("reshard: Order(%d) outside a %d→%d plan", dst, p.From, p.To))
	}
	var out []Sourced
	for rs := range p.From {
		for _, c := range p.Copies(rs, dst) {
			for pc := range c.Pieces() {
				out = append(out, Sourced{Shard: rs, Src: pc.Src, Dst: pc.Dst, Len: pc.Len})
			}
		}
	}
	slices.SortFunc(out, func(a, b Sourced) int {
		switch {
		case a.Dst < b.Dst:
			return -1
		case a.Dst > b.Dst:
			return 1
		}
		return 0
	})
	merged := out[:0]
	var at int64
	for _, s := range out {
		if s.Dst != at {
			panic(fmt.Sprintf("reshard: %s %d→%d: destination %d byte %d written by no piece or twice", p.Layout.Name, p.From, p.To, dst, at))
		}
		at += s.Len
		if k := len(merged) - 1; k >= 0 && merged[k].Shard == s.Shard && merged[k].Src+merged[k].Len == s.Src {
			merged[k].Len += s.Len
			continue
		}
		merged = append(merged, s)
	}
	if at != p.DstBytes {
		panic(fmt.Sprintf("reshard: %s %d→%d: destination %d covered up to %d of %d bytes", p.Layout.Name, p.From, p.To, dst, at, p.DstBytes))
	}
	return slices.Clip(merged)
}

// LayerSlots yields the byte ranges [lo, hi) of a destination unit of p, a
// plan of KV(c) with c.TokensPerBlock = tpb, that hold KV layer layer's
// slots [s0, s1): one range per head of the layer's K row and of its V
// row, or, for all tpb slots, the two rows as one range.
func LayerSlots(p *Plan, tpb, layer int, s0, s1 int64) iter.Seq2[int64, int64] {
	return func(yield func(lo, hi int64) bool) {
		rb := p.Layout.RowBytes(p.To)          // one layer's K (or V) of a destination shard
		head := p.Layout.Sections[0].ItemBytes // one head's tpb slots in it
		k := int64(2*layer) * rb               // the K row; the V row follows
		if s0 == 0 && s1 == int64(tpb) {
			yield(k, k+2*rb)
			return
		}
		slot := head / int64(tpb)
		for h := k; h < k+2*rb; h += head {
			if !yield(h+s0*slot, h+s1*slot) {
				return
			}
		}
	}
}
