package transfer

import (
	"fmt"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/reshard"
)

// Tensor-parallel handoffs (issue 12). A TP-D receiver grants, in one grant,
// the KV runs of its shards 0..D-1 (each shard's runs in token order, in
// that shard's KV region) followed by the Mamba rows of its shards 0..D-1,
// each in that shard's own layout, and says D in PrefillRequest.TP. A TP-P
// sender holds the request on P shards of its own and writes the whole
// grant with one rdma write: its source extents are the pieces of its
// shards' blocks and rows that fill the receiver's extents in their byte
// order (Resharder.Source), each destination byte from its one planned
// writer (reshard.Plan.Order). So the control cost stays one NATS
// request-reply, the ticket stays O(runs × D) extents whatever P is, and
// the grant's manifest (bytes and crc32c per destination extent) checks
// every shard's destination: disjoint extents whose sizes add up to D
// shards' blocks and rows tile them, each written exactly once.

// ShardSource is one tensor-parallel shard of a sender: the registered
// regions of its KV and Mamba pools and their configs (the shard's own
// shapes, reshard.KVShard and reshard.MambaShard of the model's).
type ShardSource struct {
	KV, Mamba   rdma.RegionID
	KVConfig    kvcache.Config
	MambaConfig mambacache.Config
}

// Resharder moves requests from a TP-From sender to a TP-To receiver. It
// is immutable and safe for concurrent use.
type Resharder struct {
	from, to      int
	kv, mamba     *reshard.Plan // nil for a model without that cache
	kvOrd, mamOrd [][]reshard.Sourced
}

// NewResharder computes the plans for a model whose TP-1 cache shapes are
// kv and m (both sides with kv's TokensPerBlock). A shape that does not
// split over either size is refused with an error wrapping
// ErrLayoutMismatch and the reshard sentinel, naming the dimension.
func NewResharder(kv kvcache.Config, m mambacache.Config, from, to int) (*Resharder, error) {
	r := &Resharder{from: from, to: to}
	var err error
	if kv.Layers > 0 {
		if r.kv, err = reshard.New(reshard.KV(kv), from, to); err != nil {
			return nil, fmt.Errorf("%w: TP %d → %d: %w", ErrLayoutMismatch, from, to, err)
		}
		for rd := range to {
			r.kvOrd = append(r.kvOrd, r.kv.Order(rd))
		}
	}
	if m.Layers > 0 {
		if r.mamba, err = reshard.New(reshard.Mamba(m), from, to); err != nil {
			return nil, fmt.Errorf("%w: TP %d → %d: %w", ErrLayoutMismatch, from, to, err)
		}
		for rd := range to {
			r.mamOrd = append(r.mamOrd, r.mamba.Order(rd))
		}
	}
	return r, nil
}

// From and To are the two TP sizes.
func (r *Resharder) From() int { return r.from }

// To is the receiver's TP size.
func (r *Resharder) To() int { return r.to }

// Bytes returns what a receiver's ticket holds for a request of blocks KV
// blocks: the KV bytes of its To shards and the bytes of their Mamba rows.
func (r *Resharder) Bytes(blocks int) (kv, mamba uint64) {
	if r.kv != nil {
		kv = uint64(r.to) * uint64(blocks) * uint64(r.kv.DstBytes)
	}
	if r.mamba != nil {
		mamba = uint64(r.to) * uint64(r.mamba.DstBytes)
	}
	return kv, mamba
}

// Source returns the sender's source extents for one request, in the
// order of the receiver's ticket: first the pieces that fill the KV runs of
// receiver shards 0..To-1, then those that fill their Mamba rows. blocks
// are the request's KV blocks in token order and row its Mamba row, the
// same ids on every one of the From shards. Pieces that continue each
// other in one region are merged, so a 1→1 move is its runs and its row.
func (r *Resharder) Source(shards []ShardSource, blocks []kvcache.BlockID, row mambacache.Row) (kv, mamba []rdma.Extent, err error) {
	if len(shards) != r.from {
		return nil, nil, fmt.Errorf("%w: %d source shards for a TP-%d sender", ErrInvalidConfig, len(shards), r.from)
	}
	for i, s := range shards {
		if r.kv != nil && s.KVConfig.BlockBytes() != r.kv.SrcBytes {
			return nil, nil, fmt.Errorf("%w: shard %d's KV blocks are %d bytes, the plan's %d", ErrLayoutMismatch, i, s.KVConfig.BlockBytes(), r.kv.SrcBytes)
		}
		if r.mamba != nil && s.MambaConfig.RowBytes() != r.mamba.SrcBytes {
			return nil, nil, fmt.Errorf("%w: shard %d's Mamba rows are %d bytes, the plan's %d", ErrLayoutMismatch, i, s.MambaConfig.RowBytes(), r.mamba.SrcBytes)
		}
	}
	if r.kv != nil {
		for rd := range r.to {
			for _, b := range blocks {
				for _, p := range r.kvOrd[rd] {
					s := shards[p.Shard]
					base := s.KVConfig.BlockExtent(b).Offset
					kv = appendExtent(kv, rdma.Extent{Region: s.KV, Offset: uint64(base + p.Src), Length: uint64(p.Len)})
				}
			}
		}
	}
	if r.mamba != nil {
		for rd := range r.to {
			for _, p := range r.mamOrd[rd] {
				s := shards[p.Shard]
				base := s.MambaConfig.RowExtent(row).Offset
				mamba = appendExtent(mamba, rdma.Extent{Region: s.Mamba, Offset: uint64(base + p.Src), Length: uint64(p.Len)})
			}
		}
	}
	return kv, mamba, nil
}

// appendExtent appends e to xs, merged into the last extent when it
// continues it in the same region.
func appendExtent(xs []rdma.Extent, e rdma.Extent) []rdma.Extent {
	if n := len(xs); n > 0 && xs[n-1].Region == e.Region && xs[n-1].Offset+xs[n-1].Length == e.Offset {
		xs[n-1].Length += e.Length
		return xs
	}
	return append(xs, e)
}
