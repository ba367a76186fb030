package agent

import (
	"fmt"
	"sync"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/reshard"
)

// Tensor-parallel handoffs between agents. Each agent is one TP shard. A
// receiving shard rd of a TP-To group, told the sender's TP size From,
// opens one grant per source shard rs that writes anything into it: over
// the stretches of its named blocks and row that reshard's plan has rs
// write (Plan.Order(rd), the stretches of shard rs), in block order, then
// the row's. The ticket holds those grants' tickets, each under its source
// shard. Source shard rs's agent computes the same stretches from the same
// plan (both sides have the same fingerprint, so the same whole-model
// shapes) and writes, from its own blocks and row, the matching source
// stretches into its grant. Same TP sizes are the plan whose shard r
// writes all of shard r: one grant of one extent per block and one for the
// row.

// plans are the KV and Mamba plans of one (From, To) pair; nil for a
// cache the layout has not.
type plans struct {
	kv, mamba *reshard.Plan
}

type tpPair struct{ from, to int }

// planCache holds the plans of the TP pairs a registration has seen.
type planCache struct {
	mu sync.Mutex
	m  map[tpPair]*plans
}

// plans returns the plans moving this layout from TP from to TP to. Errors
// wrap ErrLayoutMismatch and name the dimension that does not split.
func (p *pools) plans(from, to int) (*plans, error) {
	p.pc.mu.Lock()
	defer p.pc.mu.Unlock()
	k := tpPair{from, to}
	if pl, ok := p.pc.m[k]; ok {
		return pl, nil
	}
	pl := &plans{}
	var err error
	if p.kv.Layers > 0 && from != to && p.l.KV.Order == "nhd" {
		return nil, fmt.Errorf("%w: TP %d → %d cuts the KV cache by heads, which its NHD order (tokens, heads, head_dim) does not allow", ErrLayoutMismatch, from, to)
	}
	if p.kv.Layers > 0 {
		if pl.kv, err = reshard.New(reshard.KV(p.wholeKV), from, to); err != nil {
			return nil, fmt.Errorf("%w: TP %d → %d: %w", ErrLayoutMismatch, from, to, err)
		}
	}
	if p.mamba.Layers > 0 {
		ml := reshard.Mamba(p.wholeMamba)
		if p.l.Mamba.ConvOrder == "sd" {
			ml = reshard.MambaSD(p.wholeMamba)
		}
		if pl.mamba, err = reshard.New(ml, from, to); err != nil {
			return nil, fmt.Errorf("%w: TP %d → %d: %w", ErrLayoutMismatch, from, to, err)
		}
	}
	if p.pc.m == nil {
		p.pc.m = make(map[tpPair]*plans)
	}
	p.pc.m[k] = pl
	return pl, nil
}

// piece is one stretch of a handoff: Len bytes at offset Dst of a
// destination unit (block Unit of the named blocks, or the row) from
// offset Src of the source unit.
type piece struct {
	mamba         bool
	unit          int
	src, dst, len uint64
}

// pieces returns the stretches source shard rs writes into destination
// shard rd for a request of blocks blocks and, when row, a row: block by
// block in order, then the row, each in destination byte order.
func (pl *plans) pieces(rs, rd, blocks int, row bool) []piece {
	var out []piece
	if pl.kv != nil && blocks > 0 {
		var mine []reshard.Sourced
		for _, s := range pl.kv.Order(rd) {
			if s.Shard == rs {
				mine = append(mine, s)
			}
		}
		out = make([]piece, 0, blocks*len(mine)+1)
		for i := range blocks {
			for _, s := range mine {
				out = append(out, piece{unit: i, src: uint64(s.Src), dst: uint64(s.Dst), len: uint64(s.Len)})
			}
		}
	}
	if pl.mamba != nil && row {
		for _, s := range pl.mamba.Order(rd) {
			if s.Shard == rs {
				out = append(out, piece{mamba: true, src: uint64(s.Src), dst: uint64(s.Dst), len: uint64(s.Len)})
			}
		}
	}
	return out
}

// planeMajor reorders pieces for a receiver whose KV cache lies in planes
// (ticket version 2): the KV pieces cut at the destination's rows (each
// a layer's K or V) and listed row by row, each row's in block order,
// then the Mamba pieces. A plane's consecutive blocks then lie back to
// back in its memory and merge into one extent, where block order would
// list one extent per block and plane. Both sides reorder alike; the
// concatenation they exchange is the reordered one.
func (pl *plans) planeMajor(pcs []piece) []piece {
	if pl.kv == nil {
		return pcs
	}
	rows := pl.kv.Layout.Rows
	rb := uint64(pl.kv.DstBytes) / uint64(rows)
	byRow := make([][]piece, rows)
	var mamba []piece
	for _, pc := range pcs {
		if pc.mamba {
			mamba = append(mamba, pc)
			continue
		}
		for a := pc.dst; a < pc.dst+pc.len; {
			i := a / rb
			b := min((i+1)*rb, pc.dst+pc.len)
			byRow[i] = append(byRow[i], piece{unit: pc.unit, src: pc.src + (a - pc.dst), dst: a, len: b - a})
			a = b
		}
	}
	out := make([]piece, 0, len(pcs)+rows)
	for _, r := range byRow {
		out = append(out, r...)
	}
	return append(out, mamba...)
}

// dstExtents places a grant's pieces in this registration's regions, for
// the named blocks and row, in order: a piece that crosses planes (planes.go)
// is one extent per plane.
func (p *pools) dstExtents(regions []rdma.RegionID, pcs []piece, blocks []int, row int) []rdma.Extent {
	out := make([]rdma.Extent, 0, len(pcs))
	for _, pc := range pcs {
		if pc.mamba {
			out = p.mamAt.spans(out, regions, row, pc.dst, pc.len)
		} else {
			out = p.kvAt.spans(out, regions, blocks[pc.unit], pc.dst, pc.len)
		}
	}
	return out
}

// grantExtents places a grant's pieces (dstExtents) and merges them. A
// plane-major grant (pm) merges each of the destination's KV rows apart
// (and the Mamba pieces after them), so that every row lists its blocks
// alike even where one plane ends where the next begins; n is how many
// extents each row has when they have as many (0 otherwise): the groups
// its ticket folds.
func (p *pools) grantExtents(regions []rdma.RegionID, pl *plans, pcs []piece, blocks []int, row int, pm bool) (ext []rdma.Extent, n int) {
	if !pm {
		return merge(p.dstExtents(regions, pcs, blocks, row)), 0
	}
	rows := pl.kv.Layout.Rows
	rb := uint64(pl.kv.DstBytes) / uint64(rows) // as planeMajor cut them
	i := 0
	for i < len(pcs) && !pcs[i].mamba {
		j := i + 1
		for j < len(pcs) && !pcs[j].mamba && pcs[j].dst/rb == pcs[i].dst/rb {
			j++
		}
		ext = append(ext, merge(p.dstExtents(regions, pcs[i:j], blocks, row))...)
		i = j
	}
	if len(ext)%rows == 0 {
		n = len(ext) / rows
	}
	return append(ext, merge(p.dstExtents(regions, pcs[i:], blocks, row))...), n
}

// merge joins extents that continue each other in one region: a run of
// consecutive blocks is one extent, as the workers send runs. A write
// lands the concatenation of its sources in the concatenation of its
// destinations, so either side merges on its own.
func merge(es []rdma.Extent) []rdma.Extent {
	out := es[:0:0]
	for _, e := range es {
		if k := len(out) - 1; k >= 0 && out[k].Region == e.Region && out[k].Offset+out[k].Length == e.Offset {
			out[k].Length += e.Length
			continue
		}
		out = append(out, e)
	}
	return out
}

// seg is one stretch of a send: bytes that lie at dst in their destination
// unit's virtual bytes (what a layer is cut by), at `at` in the ticket's
// extents, and from src, contiguous in this agent's memory.
type seg struct {
	mamba bool
	dst   uint64
	at    rdma.Range
	src   rdma.Extent
}

// mostExtents bounds the extents of a ticket for pcs: a receiver places a
// KV piece in one extent (its blocks are contiguous, or it lists them
// plane by plane and planeMajor cut the pieces at its planes), and cuts a
// Mamba piece at most into one extent per plane of its state (2 per
// layer, as ours, by the fingerprint); never more than a grant holds.
// More are not a receiver's, and would only cost this agent memory.
func (p *pools) mostExtents(pcs []piece) int {
	n := 0
	for _, pc := range pcs {
		if pc.mamba {
			n += 2 * max(p.mamba.Layers, 1)
		} else {
			n++
		}
	}
	return min(n, rdma.MaxExtents)
}

// segments cuts a send's pieces where they cross an extent of the ticket
// (the receiver's memory) or a plane of this agent's, and places each cut
// in both. The ticket's extents must hold the pieces' bytes exactly (no
// more than mostExtents of them, none empty).
func (p *pools) segments(regions []rdma.RegionID, pcs []piece, blocks []int, row int, ext []rdma.Extent) ([]seg, error) {
	for i, e := range ext {
		if e.Length == 0 {
			return nil, fmt.Errorf("%w: extent %d is empty", ErrBadTicket, i)
		}
	}
	out := make([]seg, 0, len(pcs))
	k, at := 0, uint64(0)
	for j, pc := range pcs {
		m, u := &p.mamAt, row
		if !pc.mamba {
			m, u = &p.kvAt, blocks[pc.unit]
		}
		for off := uint64(0); off < pc.len; {
			if k >= len(ext) {
				return nil, fmt.Errorf("%w: piece %d of %d bytes runs past the ticket's extents", ErrBadTicket, j, pc.len)
			}
			b, o, run := m.at(u, pc.src+off)
			n := min(pc.len-off, run, ext[k].Length-at)
			out = append(out, seg{mamba: pc.mamba, dst: pc.dst + off, at: rdma.Range{Ext: k, Offset: at, Length: n},
				src: rdma.Extent{Region: regions[b], Offset: o, Length: n}})
			off += n
			if at += n; at >= ext[k].Length {
				k, at = k+1, 0
			}
		}
	}
	if k != len(ext) {
		return nil, fmt.Errorf("%w: %d extents, the pieces fill %d", ErrBadTicket, len(ext), k)
	}
	return out, nil
}

// sources returns the segments' sources, merged.
func sources(segs []seg) []rdma.Extent {
	out := make([]rdma.Extent, len(segs))
	for i, g := range segs {
		out[i] = g.src
	}
	return merge(out)
}

// layerRanges returns the ranges of a send's segments that hold attention
// layer l's K and V, or Mamba layer l, in the destination's layout (rows
// 2l and 2l+1 of each KV unit, row l of the Mamba unit), and their
// sources.
func layerRanges(pl *plans, segs []seg, mamba bool, l int) (dst []rdma.Range, from []rdma.Extent) {
	var lo, hi uint64
	if mamba {
		rb := uint64(pl.mamba.DstBytes) / uint64(pl.mamba.Layout.Rows)
		lo, hi = uint64(l)*rb, uint64(l+1)*rb
	} else {
		rb := uint64(pl.kv.DstBytes) / uint64(pl.kv.Layout.Rows)
		lo, hi = uint64(2*l)*rb, uint64(2*l+2)*rb
	}
	for _, g := range segs {
		if g.mamba != mamba {
			continue
		}
		a, b := max(lo, g.dst), min(hi, g.dst+g.at.Length)
		if a >= b {
			continue
		}
		dst = append(dst, rdma.Range{Ext: g.at.Ext, Offset: g.at.Offset + (a - g.dst), Length: b - a})
		from = append(from, rdma.Extent{Region: g.src.Region, Offset: g.src.Offset + (a - g.dst), Length: b - a})
	}
	return dst, from
}
