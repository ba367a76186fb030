package transfer

import (
	"fmt"
	"sort"
	"sync"

	"github.com/handoff-io/handoff/hybrid"
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
// order (Resharder.source), each destination byte from its one planned
// writer (reshard.Plan.Order). So the control cost stays one NATS
// request-reply, the ticket stays O(runs × D) extents whatever P is, and
// the grant's manifest (bytes and crc32c per destination extent) checks
// every shard's destination: disjoint extents whose sizes add up to D
// shards' blocks and rows tile them, each written exactly once.

// shardSource is one tensor-parallel shard of a writer: the registered
// regions of its KV and Mamba pools and their configs (the shard's own
// shapes, reshard.KVShard and reshard.MambaShard of the model's).
type shardSource struct {
	KV, Mamba   rdma.RegionID
	KVConfig    kvcache.Config
	MambaConfig mambacache.Config
}

// Resharder moves requests from a TP-From writer to a TP-To receiver. It
// is immutable and safe for concurrent use. RankRegions.Resharder returns
// one, or refuses a TP size the model does not split over; the Prefiller
// uses its plans.
type Resharder struct {
	from, to      int
	tpb           int           // tokens per KV block
	kv, mamba     *reshard.Plan // nil for a model without that cache
	kvOrd, mamOrd [][]reshard.Sourced
}

// newResharder computes the plans for a model whose TP-1 cache shapes are
// kv and m (both sides with kv's TokensPerBlock). A shape that does not
// split over either size is refused with an error wrapping
// ErrLayoutMismatch and the reshard sentinel, naming the dimension.
func newResharder(kv kvcache.Config, m mambacache.Config, from, to int) (*Resharder, error) {
	r := &Resharder{from: from, to: to, tpb: kv.TokensPerBlock}
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

// bytes returns what a receiver's ticket holds for a request of blocks KV
// blocks: the KV bytes of its To shards and the bytes of their Mamba rows.
func (r *Resharder) bytes(blocks int) (kv, mamba uint64) {
	if r.kv != nil {
		kv = uint64(r.to) * uint64(blocks) * uint64(r.kv.DstBytes)
	}
	if r.mamba != nil {
		mamba = uint64(r.to) * uint64(r.mamba.DstBytes)
	}
	return kv, mamba
}

// source returns the writer's source extents for one request, in the
// order of the receiver's ticket: first the pieces that fill the KV runs of
// receiver shards 0..To-1, then those that fill their Mamba rows. blocks
// are the request's KV blocks in token order and row its Mamba row, the
// same ids on every one of the From shards. Pieces that continue each
// other in one region are merged, so a 1→1 move is its runs and its row.
func (r *Resharder) source(shards []shardSource, blocks []kvcache.BlockID, row mambacache.Row) (kv, mamba []rdma.Extent, err error) {
	if len(shards) != r.from {
		return nil, nil, fmt.Errorf("%w: %d source shards for a TP-%d writer", ErrInvalidConfig, len(shards), r.from)
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

// Finished names a part of a request's cache that prefill finished, the
// same on every shard of a TP group: attention layer Layer's token
// positions [From, To) — the prompt's last when End, so the block holding
// To-1 is final to its end, slots past the prompt included, as a whole
// write sends them — or, when Mamba, Mamba layer Layer's whole state.
type Finished struct {
	Mamba    bool
	Layer    int // the kvcache layer, or the mambacache layer
	From, To int
	End      bool
}

// pieces appends to dst the pieces of a request's cache that f names,
// numbered as the whole write to the receiver sends them (Source's order:
// the KV of receiver shards 0..To-1, then their Mamba rows), each read from
// the source shard that writes it. blocks and row are the request's, as for
// Source. A receiver's KV layer is, in each of its blocks, two rows of the
// unit (K, then V: each its heads' slots, head by head) and its Mamba layer
// one row, so f's pieces are those of the plan's Order that land in them
// (in a block f ends or starts inside, in the stretch of f's slots of each
// head), cut to them: O(blocks × To × source shards) pieces, times the
// heads for the blocks f cuts, from the same plan as Source, so streamed
// pieces and the write after prefill agree to the byte.
func (r *Resharder) pieces(dst []Piece, shards []shardSource, f Finished, blocks []kvcache.BlockID, row mambacache.Row) ([]Piece, error) {
	if len(shards) != r.from {
		return dst, fmt.Errorf("%w: %d source shards for a TP-%d writer", ErrInvalidConfig, len(shards), r.from)
	}
	nb := uint64(len(blocks))
	var kvBytes uint64 // one receiver shard's KV for the request
	if r.kv != nil {
		kvBytes = nb * uint64(r.kv.DstBytes)
	}
	if f.Mamba {
		if r.mamba == nil || f.Layer < 0 || f.Layer >= r.mamba.Layout.Rows {
			return dst, fmt.Errorf("%w: mamba layer %d of a cache with %d", rdma.ErrOutOfRange, f.Layer, r.mambaLayers())
		}
		rb := r.mamba.Layout.RowBytes(r.to)
		lo := int64(f.Layer) * rb
		for rd := range r.to {
			at := uint64(r.to)*kvBytes + uint64(rd)*uint64(r.mamba.DstBytes)
			dst = cut(dst, r.mamOrd[rd], lo, lo+rb, at, func(s int) (rdma.RegionID, uint64) {
				return shards[s].Mamba, uint64(shards[s].MambaConfig.RowExtent(row).Offset)
			})
		}
		return dst, nil
	}
	t := r.tpb
	if r.kv == nil || f.Layer < 0 || 2*f.Layer >= r.kv.Layout.Rows || f.From < 0 || f.To < f.From {
		return dst, fmt.Errorf("%w: kv layer %d positions [%d, %d)", rdma.ErrOutOfRange, f.Layer, f.From, f.To)
	}
	end := f.To
	if f.End {
		end = (f.To + t - 1) / t * t
	}
	for k := f.From / t; k*t < end && k < len(blocks); k++ {
		s0, s1 := int64(max(f.From, k*t)-k*t), int64(min(end, (k+1)*t)-k*t)
		src := func(s int) (rdma.RegionID, uint64) {
			return shards[s].KV, uint64(shards[s].KVConfig.BlockExtent(blocks[k]).Offset)
		}
		for rd := range r.to {
			at := uint64(rd)*kvBytes + uint64(k)*uint64(r.kv.DstBytes)
			for lo, hi := range reshard.LayerSlots(r.kv, t, f.Layer, s0, s1) {
				dst = cut(dst, r.kvOrd[rd], lo, hi, at, src)
			}
		}
	}
	return dst, nil
}

func (r *Resharder) mambaLayers() int {
	if r.mamba == nil {
		return 0
	}
	return r.mamba.Layout.Rows
}

// cut appends the pieces of ord (one receiver unit's stretches, at byte at
// of the whole write) that land in the unit's bytes [lo, hi), cut to them;
// src gives a source shard's region and the offset of its unit.
func cut(dst []Piece, ord []reshard.Sourced, lo, hi int64, at uint64, src func(shard int) (rdma.RegionID, uint64)) []Piece {
	i := sort.Search(len(ord), func(i int) bool { return ord[i].Dst+ord[i].Len > lo })
	for ; i < len(ord) && ord[i].Dst < hi; i++ {
		o := ord[i]
		a, b := max(o.Dst, lo), min(o.Dst+o.Len, hi)
		reg, base := src(o.Shard)
		p := Piece{At: at + uint64(a), Src: rdma.Extent{Region: reg, Offset: base + uint64(o.Src+a-o.Dst), Length: uint64(b - a)}}
		if n := len(dst) - 1; n >= 0 && dst[n].At+dst[n].Src.Length == p.At && dst[n].Src.Region == reg && dst[n].Src.Offset+dst[n].Src.Length == p.Src.Offset {
			dst[n].Src.Length += p.Src.Length
			continue
		}
		dst = append(dst, p)
	}
	return dst
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

// Shard is one tensor-parallel shard of a rank: its registered KV and
// Mamba regions and its pools' configs (the shard's own shapes).
type Shard struct {
	KV, Mamba   *rdma.Region
	KVConfig    kvcache.Config
	MambaConfig mambacache.Config
}

// tpRegions is a rank's shards and the plans to each receiver TP size met.
type tpRegions struct {
	kv     kvcache.Config    // the model's TP-1 shapes
	mamba  mambacache.Config //
	shards []Shard
	src    []shardSource

	mu    sync.Mutex // guards plans; a leaf
	plans map[int]*Resharder
}

func newTPRegions(kv kvcache.Config, m mambacache.Config, shards []Shard) *tpRegions {
	t := &tpRegions{kv: kv, mamba: m, shards: shards, plans: map[int]*Resharder{}}
	for _, s := range shards {
		t.src = append(t.src, shardSource{KV: s.KV.ID(), Mamba: s.Mamba.ID(), KVConfig: s.KVConfig, MambaConfig: s.MambaConfig})
	}
	return t
}

// NewTPRankRegions is NewRankRegions for a rank of len(shards) tensor-
// parallel shards, whose model has the TP-1 cache shapes kv and mamba
// (TokensPerBlock as the pools'). m allocates for the whole group: its
// pools are shard 0's, and every other shard keeps the request at the same
// block and row ids in its own regions, laid out by its own configs. The
// reserved rows are forbidden on every shard. As an Allocator it grants
// every shard's extents (CacheExtents); as a writer, Source reshards.
func NewTPRankRegions(m *hybrid.Manager, kv kvcache.Config, mamba mambacache.Config, shards []Shard) (*RankRegions, error) {
	if len(shards) == 0 {
		return nil, fmt.Errorf("%w: a rank of no shards", ErrInvalidConfig)
	}
	r, err := NewRankRegions(m, shards[0].KV, shards[0].Mamba)
	if err != nil {
		return nil, err
	}
	kc, mc := m.KV().Config(), m.Mamba().Config()
	if kc != shards[0].KVConfig || mc != shards[0].MambaConfig {
		return nil, fmt.Errorf("%w: shard 0's configs are not the manager's", ErrInvalidConfig)
	}
	for i, s := range shards[1:] {
		sk, sm := s.KVConfig, s.MambaConfig
		if sk.NumBlocks() != kc.NumBlocks() || sm.TotalRows() != mc.TotalRows() || sk.TokensPerBlock != kc.TokensPerBlock {
			return nil, fmt.Errorf("%w: shard %d has %d blocks of %d tokens and %d rows, shard 0 %d of %d and %d",
				ErrInvalidConfig, i+1, sk.NumBlocks(), sk.TokensPerBlock, sm.TotalRows(), kc.NumBlocks(), kc.TokensPerBlock, mc.TotalRows())
		}
		if s.KV.Len() < sk.ArenaBytes() || s.Mamba.Len() < sm.ArenaBytes() {
			return nil, fmt.Errorf("%w: shard %d: regions of %d and %d bytes for arenas of %d and %d",
				ErrInvalidConfig, i+1, s.KV.Len(), s.Mamba.Len(), sk.ArenaBytes(), sm.ArenaBytes())
		}
		for row := range mc.ArenaRows() {
			if neverTransferred(m.Mamba(), mambacache.Row(row)) {
				x := sm.RowExtent(mambacache.Row(row))
				s.Mamba.Forbid(uint64(x.Offset), uint64(x.Length))
			}
		}
	}
	// Every shard must be the plan's shard: the plans address its layout.
	t := newTPRegions(kv, mamba, shards)
	if _, err := t.resharder(len(shards)); err != nil {
		return nil, err
	}
	r.tp = t
	return r, nil
}

// Resharder returns the plans from this rank's shards to a TP-to
// receiver's (computed once per size). A size the model does not split
// over is refused with ErrLayoutMismatch, naming the dimension.
func (r *RankRegions) Resharder(to int) (*Resharder, error) { return r.tp.resharder(to) }

// Source returns the source extents of resources res held on this rank for
// a TP-to receiver, in the order of its ticket (see Resharder.source). For
// a TP-1 rank and receiver it is Resolve. A reserved row is refused with
// ErrDummyRequest.
func (r *RankRegions) Source(res hybrid.Resources, to int) (CacheExtents, error) {
	if to <= 1 && len(r.tp.shards) == 1 {
		return r.resolve(res)
	}
	if err := refuseRow(r.m.Mamba(), res.Row); err != nil {
		return CacheExtents{}, err
	}
	rs, err := r.tp.resharder(max(to, 1))
	if err != nil {
		return CacheExtents{}, err
	}
	var blocks []kvcache.BlockID
	for _, run := range res.Runs {
		for i := range run.Len {
			blocks = append(blocks, run.Start+kvcache.BlockID(i))
		}
	}
	kv, mamba, err := rs.source(r.tp.src, blocks, res.Row)
	if err != nil {
		return CacheExtents{}, err
	}
	d := CacheExtents{KV: kv}
	if len(mamba) > 0 {
		d.Mamba, d.MambaMore = mamba[0], mamba[1:]
	}
	return d, nil
}

// Pieces returns, appended to dst, the pieces that f names of the cache of
// a request held on this rank (blocks, its KV blocks in token order, and
// row), numbered as the rank's whole write to a TP-to receiver sends them
// (Source), for a stream while prefill computes. A reserved row is refused
// with ErrDummyRequest, as by Source.
func (r *RankRegions) Pieces(dst []Piece, f Finished, blocks []kvcache.BlockID, row mambacache.Row, to int) ([]Piece, error) {
	if err := refuseRow(r.m.Mamba(), row); err != nil {
		return dst, err
	}
	rs, err := r.tp.resharder(max(to, 1))
	if err != nil {
		return dst, err
	}
	return rs.pieces(dst, r.tp.src, f, blocks, row)
}

func (t *tpRegions) resharder(to int) (*Resharder, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if p, ok := t.plans[to]; ok {
		return p, nil
	}
	p, err := newResharder(t.kv, t.mamba, len(t.shards), to)
	if err != nil {
		return nil, err
	}
	t.plans[to] = p
	return p, nil
}

// resolveMore appends shards 1..'s extents of res to d (shard 0's).
func (t *tpRegions) resolveMore(d *CacheExtents, res hybrid.Resources) {
	for _, s := range t.shards[1:] {
		for _, run := range res.Runs {
			x := s.KVConfig.RunExtent(run)
			d.KV = append(d.KV, rdma.Extent{Region: s.KV.ID(), Offset: uint64(x.Offset), Length: uint64(x.Length)})
		}
	}
	for _, s := range t.shards[1:] {
		x := s.MambaConfig.RowExtent(res.Row)
		d.MambaMore = append(d.MambaMore, rdma.Extent{Region: s.Mamba.ID(), Offset: uint64(x.Offset), Length: uint64(x.Length)})
	}
}

// wireTP is PrefillRequest.TP for a receiver of tp shards: omitted (0) for
// one, so a TP-1 request's bytes are those of a peer that predates it.
func wireTP(tp int) uint16 {
	if tp <= 1 {
		return 0
	}
	return uint16(tp)
}
