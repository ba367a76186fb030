package transfer

import (
	"fmt"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/rdma"
)

// CacheExtents is where one request's cache lives in registered memory: its
// prompt's KV runs (token order) in the KV region and its Mamba row in the
// Mamba region: a receiver's destination or a writer's source.
//
// On a tensor-parallel rank (NewTPRankRegions) KV holds the runs of every
// shard, shard after shard, Mamba the row of shard 0 and MambaMore the rows
// of shards 1..; a resharded source lists, in the same order, the pieces of
// its own shards that fill them (Resharder.source).
type CacheExtents struct {
	KV        []rdma.Extent
	Mamba     rdma.Extent
	MambaMore []rdma.Extent
}

// extents returns the KV extents followed by the Mamba extents: the order
// in which a handoff's bytes are granted and written.
func (d CacheExtents) extents() []rdma.Extent {
	out := make([]rdma.Extent, 0, len(d.KV)+1+len(d.MambaMore))
	out = append(out, d.KV...)
	out = append(out, d.Mamba)
	return append(out, d.MambaMore...)
}

// bytes returns the KV and Mamba byte counts.
func (d CacheExtents) bytes() (kv, mamba uint64) {
	for _, e := range d.KV {
		kv += e.Length
	}
	mamba = d.Mamba.Length
	for _, e := range d.MambaMore {
		mamba += e.Length
	}
	return kv, mamba
}

// RankRegions are the rdma regions that back one ADP rank's KV arena and
// Mamba arena, with the rank's hybrid.Manager: Resolve maps the resources a
// request holds in the manager to extents of the regions, the form a grant
// (decode) or a write (prefill) takes. Safe for concurrent use (so is the
// manager).
type RankRegions struct {
	m     *hybrid.Manager
	kv    *rdma.Region
	mamba *rdma.Region
	tp    *tpRegions // every shard, shard 0 (kv, mamba) first
}

// neverTransferred reports whether row r of pool p may never be named by
// a grant: any row whose role is not real (mambacache.Config.RoleOf). The
// reserved rows (the ADP dummy's, a padding dummy's of each draft length),
// the prefix cache's state checkpoint rows, which only the rank's own
// requests copy from, and the scratch rows of speculative decoding, which
// hold a verifying request's state from before its verification step and
// never leave the worker.
func neverTransferred(p *mambacache.Pool, r mambacache.Row) bool { return !p.Transferable(r) }

// refuseRow returns nil for a row a grant may name, else an error wrapping
// ErrDummyRequest that names the row's role.
func refuseRow(p *mambacache.Pool, r mambacache.Row) error {
	role, ok := p.Config().RoleOf(r)
	switch {
	case !ok:
		return fmt.Errorf("%w: row %d outside the arena", ErrDummyRequest, r)
	case !role.Transferable():
		return fmt.Errorf("%w: row %d is a %s row, never a request's state", ErrDummyRequest, r, role)
	}
	return nil
}

// NewRankRegions checks that the regions hold the manager's arenas and forbids every
// Mamba row that is not real (reserved, state checkpoint and scratch rows) at the
// data plane, so no grant can ever name one.
func NewRankRegions(m *hybrid.Manager, kv, mamba *rdma.Region) (*RankRegions, error) {
	kcfg, mcfg := m.KV().Config(), m.Mamba().Config()
	if kv.Len() < kcfg.ArenaBytes() || mamba.Len() < mcfg.ArenaBytes() {
		return nil, fmt.Errorf("%w: regions of %d and %d bytes for arenas of %d and %d",
			ErrInvalidConfig, kv.Len(), mamba.Len(), kcfg.ArenaBytes(), mcfg.ArenaBytes())
	}
	mp := m.Mamba()
	for r := 0; r < mcfg.ArenaRows(); r++ {
		row := mambacache.Row(r)
		if neverTransferred(mp, row) {
			x := mcfg.RowExtent(row)
			mamba.Forbid(uint64(x.Offset), uint64(x.Length))
		}
	}
	return &RankRegions{m: m, kv: kv, mamba: mamba, tp: newTPRegions(kcfg, mcfg, []Shard{{kv, mamba, kcfg, mcfg}})}, nil
}

// Resolve maps resources a request holds to extents of the rank's regions: a
// receiver's destination or a writer's source. A reserved row is refused
// with ErrDummyRequest.
func (r *RankRegions) Resolve(res hybrid.Resources) (CacheExtents, error) {
	return r.resolve(res)
}

func (r *RankRegions) resolve(res hybrid.Resources) (CacheExtents, error) {
	if err := refuseRow(r.m.Mamba(), res.Row); err != nil {
		return CacheExtents{}, err
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
