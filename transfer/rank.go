package transfer

import (
	"errors"
	"fmt"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/rdma"
)

// CacheExtents is where one request's cache lives in registered memory: its
// prompt's KV runs (token order) in the KV region and its Mamba row in the
// Mamba region. The same shape describes a sender's source extents.
//
// On a tensor-parallel rank (NewTPRankRegions) KV holds the runs of every
// shard, shard after shard, Mamba the row of shard 0 and MambaMore the rows
// of shards 1..; a resharded source lists, in the same order, the pieces of
// its own shards that fill them (Resharder.Source).
type CacheExtents struct {
	KV        []rdma.Extent
	Mamba     rdma.Extent
	MambaMore []rdma.Extent
}

// Extents returns the KV extents followed by the Mamba extents: the order
// in which a handoff's bytes are granted and written.
func (d CacheExtents) Extents() []rdma.Extent {
	out := make([]rdma.Extent, 0, len(d.KV)+1+len(d.MambaMore))
	out = append(out, d.KV...)
	out = append(out, d.Mamba)
	return append(out, d.MambaMore...)
}

// Bytes returns the KV and Mamba byte counts.
func (d CacheExtents) Bytes() (kv, mamba uint64) {
	for _, e := range d.KV {
		kv += e.Length
	}
	mamba = d.Mamba.Length
	for _, e := range d.MambaMore {
		mamba += e.Length
	}
	return kv, mamba
}

// Allocator is what a Decoder needs from one ADP rank's cache pools: reserve
// a request's KV blocks and one real Mamba row, resolved to registered
// extents, and free them again. RankRegions implements it over a hybrid.Manager.
type Allocator interface {
	// Prepare reserves room for tokens prompt tokens of request id, all or
	// nothing, and returns the destination. It must never return a reserved
	// (dummy) row.
	Prepare(id uint64, tokens int) (CacheExtents, error)
	// Free releases everything id holds.
	Free(id uint64) error
}

// RankRegions adapts one ADP rank's hybrid.Manager and the rdma regions that back its
// KV arena and Mamba arena. Safe for concurrent use (so is the manager).
type RankRegions struct {
	m     *hybrid.Manager
	kv    *rdma.Region
	mamba *rdma.Region
	tp    *tpRegions // every shard, shard 0 (kv, mamba) first
}

var _ Allocator = (*RankRegions)(nil)

// NewRankRegions checks that the regions hold the manager's arenas and forbids every
// reserved Mamba row at the data plane, so no grant can ever name one.
func NewRankRegions(m *hybrid.Manager, kv, mamba *rdma.Region) (*RankRegions, error) {
	kcfg, mcfg := m.KV().Config(), m.Mamba().Config()
	if kv.Len() < kcfg.ArenaBytes() || mamba.Len() < mcfg.ArenaBytes() {
		return nil, fmt.Errorf("%w: regions of %d and %d bytes for arenas of %d and %d",
			ErrInvalidConfig, kv.Len(), mamba.Len(), kcfg.ArenaBytes(), mcfg.ArenaBytes())
	}
	mp := m.Mamba()
	for r := 0; r < mcfg.TotalRows(); r++ {
		row := mambacache.Row(r)
		if mp.IsReserved(row) {
			x := mcfg.RowExtent(row)
			mamba.Forbid(uint64(x.Offset), uint64(x.Length))
		}
	}
	return &RankRegions{m: m, kv: kv, mamba: mamba, tp: newTPRegions(kcfg, mcfg, []Shard{{kv, mamba, kcfg, mcfg}})}, nil
}

// Manager returns the rank's manager.
func (r *RankRegions) Manager() *hybrid.Manager { return r.m }

// Prepare implements Allocator.
func (r *RankRegions) Prepare(id uint64, tokens int) (CacheExtents, error) {
	res, err := r.m.Prepare(id, tokens)
	if errors.Is(err, mambacache.ErrDummyID) {
		return CacheExtents{}, fmt.Errorf("%w: %w", ErrDummyRequest, err)
	}
	if err != nil {
		return CacheExtents{}, err
	}
	d, err := r.resolve(res)
	if err != nil {
		_ = r.m.Free(id)
		return CacheExtents{}, err
	}
	return d, nil
}

// Free implements Allocator.
func (r *RankRegions) Free(id uint64) error {
	return r.m.Free(id)
}

// Resolve maps resources id already holds to extents of the rank's regions
// (a sender's source). A reserved row is refused with ErrDummyRequest.
func (r *RankRegions) Resolve(res hybrid.Resources) (CacheExtents, error) {
	return r.resolve(res)
}

func (r *RankRegions) resolve(res hybrid.Resources) (CacheExtents, error) {
	if r.m.Mamba().IsReserved(res.Row) {
		return CacheExtents{}, fmt.Errorf("%w: row %d is reserved", ErrDummyRequest, res.Row)
	}
	kcfg, mcfg := r.m.KV().Config(), r.m.Mamba().Config()
	d := CacheExtents{KV: make([]rdma.Extent, len(res.Runs))}
	for i, run := range res.Runs {
		x := kcfg.RunExtent(run)
		d.KV[i] = rdma.Extent{Region: r.kv.ID(), Offset: uint64(x.Offset), Length: uint64(x.Length)}
	}
	x := mcfg.RowExtent(res.Row)
	d.Mamba = rdma.Extent{Region: r.mamba.ID(), Offset: uint64(x.Offset), Length: uint64(x.Length)}
	r.tp.resolveMore(&d, res)
	return d, nil
}

// Prepared returns an Allocator for a destination the caller already holds
// (for a worker whose scheduler allocates before it hands off): Prepare
// returns d for any id, Free does nothing. The caller frees d itself after
// Handoff returned, whatever the outcome.
func Prepared(d CacheExtents) Allocator { return prepared{d} }

type prepared struct{ d CacheExtents }

func (p prepared) Prepare(uint64, int) (CacheExtents, error) { return p.d, nil }
func (prepared) Free(uint64) error                           { return nil }
