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
	if p.kv.Layers > 0 {
		if pl.kv, err = reshard.New(reshard.KV(p.wholeKV), from, to); err != nil {
			return nil, fmt.Errorf("%w: TP %d → %d: %w", ErrLayoutMismatch, from, to, err)
		}
	}
	if p.mamba.Layers > 0 {
		if pl.mamba, err = reshard.New(reshard.Mamba(p.wholeMamba), from, to); err != nil {
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

// extents places pieces in this registration's regions: the destination
// side (dst) or the source side, for the named blocks and row.
func (s *session) pieceExtents(p *pools, pcs []piece, blocks []int, row int, dst bool) []rdma.Extent {
	out := make([]rdma.Extent, len(pcs))
	for i, pc := range pcs {
		off := pc.src
		if dst {
			off = pc.dst
		}
		if pc.mamba {
			out[i] = rdma.Extent{Region: s.mam.ID(), Offset: p.rowOff(row) + off, Length: pc.len}
		} else {
			out[i] = rdma.Extent{Region: s.kv.ID(), Offset: p.blockOff(blocks[pc.unit]) + off, Length: pc.len}
		}
	}
	return out
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

// place finds each piece's place in a ticket's extents (the pieces'
// destinations, merged by the receiver): extent index and offset in it.
// It refuses extents that do not consist of whole pieces in order.
func place(pcs []piece, ext []rdma.Extent) ([]rdma.Range, error) {
	out := make([]rdma.Range, len(pcs))
	k, at := 0, uint64(0)
	for j, pc := range pcs {
		if k >= len(ext) || at+pc.len > ext[k].Length {
			return nil, fmt.Errorf("%w: piece %d of %d bytes does not fit the ticket's extents", ErrBadTicket, j, pc.len)
		}
		out[j] = rdma.Range{Ext: k, Offset: at, Length: pc.len}
		if at += pc.len; at == ext[k].Length {
			k, at = k+1, 0
		}
	}
	if k != len(ext) {
		return nil, fmt.Errorf("%w: %d extents, the pieces fill %d", ErrBadTicket, len(ext), k)
	}
	return out, nil
}

// layerRanges returns the ranges of a send's pieces (placed in the
// ticket's extents by at, their sources src) that hold attention layer l's
// K and V, or Mamba layer l, in the destination's layout: rows 2l and 2l+1
// of each KV unit, row l of the Mamba unit.
func layerRanges(pl *plans, pcs []piece, at []rdma.Range, src []rdma.Extent, mamba bool, l int) (dst []rdma.Range, from []rdma.Extent) {
	var lo, hi uint64
	if mamba {
		rb := uint64(pl.mamba.DstBytes) / uint64(pl.mamba.Layout.Rows)
		lo, hi = uint64(l)*rb, uint64(l+1)*rb
	} else {
		rb := uint64(pl.kv.DstBytes) / uint64(pl.kv.Layout.Rows)
		lo, hi = uint64(2*l)*rb, uint64(2*l+2)*rb
	}
	for j, pc := range pcs {
		if pc.mamba != mamba {
			continue
		}
		a, b := max(lo, pc.dst), min(hi, pc.dst+pc.len)
		if a >= b {
			continue
		}
		dst = append(dst, rdma.Range{Ext: at[j].Ext, Offset: at[j].Offset + (a - pc.dst), Length: b - a})
		from = append(from, rdma.Extent{Region: src[j].Region, Offset: src[j].Offset + (a - pc.dst), Length: b - a})
	}
	return dst, from
}
