package transfer

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/reshard"
)

// TestResharderSource builds a TP-P sender's shards from random TP-1
// blocks and a row (sharded with the 1→P plans), asks Source for the
// extents that fill a TP-D receiver's ticket, streams them, and compares
// with the TP-1 bytes sharded straight to D: the receiver's extents, in
// ticket order. Shapes include replicated KV heads and groups (TP 4 over 2)
// and a non-integer ratio (4 → 6).
func TestResharderSource(t *testing.T) {
	rng := rand.New(rand.NewPCG(12, 1))
	type shape struct {
		kv    kvcache.Config
		m     mambacache.Config
		pairs [][2]int
	}
	tiny := shape{
		kv: kvcache.Config{Layers: 2, KVHeads: 2, HeadDim: 16, ElemSize: 4, TokensPerBlock: 16},
		m: mambacache.Config{Layers: 3, DState: 16, DConv: 4, Heads: 4, HeadDim: 16, NGroups: 2,
			ConvElemSize: 4, SSMElemSize: 4},
		pairs: [][2]int{{1, 1}, {2, 1}, {1, 2}, {4, 1}, {1, 4}, {2, 4}, {4, 2}, {4, 4}},
	}
	odd := shape{
		kv: kvcache.Config{Layers: 1, KVHeads: 12, HeadDim: 4, ElemSize: 2, TokensPerBlock: 3},
		m: mambacache.Config{Layers: 2, DState: 4, DConv: 3, Heads: 12, HeadDim: 2, NGroups: 12,
			ConvElemSize: 2, SSMElemSize: 4, ConvLayout: mambacache.ConvQKV},
		pairs: [][2]int{{4, 6}, {6, 4}, {3, 2}, {1, 12}},
	}
	for _, sh := range []shape{tiny, odd} {
		for _, pr := range sh.pairs {
			from, to := pr[0], pr[1]
			t.Run(fmt.Sprintf("%d→%d/kvheads%d", from, to, sh.kv.KVHeads), func(t *testing.T) {
				r, err := newResharder(sh.kv, sh.m, from, to)
				require.NoError(t, err)
				const nb, pool = 5, 9
				blocks := []kvcache.BlockID{7, 2, 3, 4, 0} // token order, two runs and strays
				row := mambacache.Row(1)
				kvP, err := reshard.New(reshard.KV(sh.kv), 1, from)
				require.NoError(t, err)
				mP, err := reshard.New(reshard.Mamba(sh.m), 1, from)
				require.NoError(t, err)
				kvD, err := reshard.New(reshard.KV(sh.kv), 1, to)
				require.NoError(t, err)
				mD, err := reshard.New(reshard.Mamba(sh.m), 1, to)
				require.NoError(t, err)
				full := make([][]byte, nb)
				for i := range full {
					full[i] = make([]byte, kvP.SrcBytes)
					for j := range full[i] {
						full[i][j] = byte(rng.Uint32())
					}
				}
				fullRow := make([]byte, mP.SrcBytes)
				for j := range fullRow {
					fullRow[j] = byte(rng.Uint32())
				}
				regions := map[rdma.RegionID][]byte{}
				shards := make([]shardSource, from)
				for s := range from {
					kc, err := reshard.KVShard(sh.kv, from)
					require.NoError(t, err)
					kc.Blocks = pool
					mc, err := reshard.MambaShard(sh.m, from)
					require.NoError(t, err)
					mc.MaxBatchSize = 2
					shards[s] = shardSource{KV: rdma.RegionID(10 + 2*s), Mamba: rdma.RegionID(11 + 2*s), KVConfig: kc, MambaConfig: mc}
					kvMem, mMem := make([]byte, kc.ArenaBytes()), make([]byte, mc.ArenaBytes())
					for i, b := range blocks {
						x := kc.BlockExtent(b)
						reshard.Apply(kvMem[x.Offset:x.Offset+x.Length], full[i], kvP.Copies(0, s))
					}
					x := mc.RowExtent(row)
					reshard.Apply(mMem[x.Offset:x.Offset+x.Length], fullRow, mP.Copies(0, s))
					regions[shards[s].KV], regions[shards[s].Mamba] = kvMem, mMem
				}
				kv, mamba, err := r.source(shards, blocks, row)
				require.NoError(t, err)
				var got []byte
				for _, e := range append(kv, mamba...) {
					got = append(got, regions[e.Region][e.Offset:e.Offset+e.Length]...)
				}
				var want []byte
				for rd := range to {
					for i := range nb {
						u := make([]byte, kvD.DstBytes)
						reshard.Apply(u, full[i], kvD.Copies(0, rd))
						want = append(want, u...)
					}
				}
				for rd := range to {
					u := make([]byte, mD.DstBytes)
					reshard.Apply(u, fullRow, mD.Copies(0, rd))
					want = append(want, u...)
				}
				require.Equal(t, want, got)
				kb, mb := r.bytes(nb)
				require.Equal(t, uint64(len(want)), kb+mb)
				if from == to {
					// Same sizes: each shard's blocks go whole; runs stay merged.
					require.LessOrEqual(t, len(kv), to*4)
					require.Len(t, mamba, to)
				}
			})
		}
	}
}

// Sizes that do not split the model are refused by name before any byte
// moves.
func TestResharderRefusesIndivisible(t *testing.T) {
	kv := kvcache.Config{Layers: 2, KVHeads: 2, HeadDim: 16, ElemSize: 4, TokensPerBlock: 16}
	m := mambacache.Config{Layers: 3, DState: 16, DConv: 4, Heads: 4, HeadDim: 16, NGroups: 2, ConvElemSize: 4, SSMElemSize: 4}
	_, err := newResharder(kv, m, 3, 1)
	require.ErrorIs(t, err, ErrLayoutMismatch)
	require.ErrorIs(t, err, reshard.ErrIndivisible)
	require.ErrorContains(t, err, "source: ")
	_, err = newResharder(kv, m, 1, 8)
	require.ErrorIs(t, err, reshard.ErrIndivisible)
	require.ErrorContains(t, err, "4 mamba heads over TP 8")
}

// tpSide is one worker rank of TP tp over its own engine: a manager over
// shard 0's pools and a region pair per shard.
type tpSide struct {
	eng    *rdma.Engine
	m      *hybrid.Manager
	rank   *RankRegions
	shards []Shard
}

func newTPSide(t testing.TB, agent string, kv kvcache.Config, mc mambacache.Config, tp int, tr rdma.Transport, blocks int) *tpSide {
	t.Helper()
	eng, err := rdma.New(rdma.Config{Agent: rdma.AgentID(agent), Transports: []rdma.Transport{tr}, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = eng.Close() })
	s := &tpSide{eng: eng}
	for r := range tp {
		k, err := reshard.KVShard(kv, tp)
		require.NoError(t, err)
		k.Blocks = blocks
		m, err := reshard.MambaShard(mc, tp)
		require.NoError(t, err)
		m.MaxBatchSize = 2
		kr, err := eng.Register(fmt.Sprintf("kv%d", r), k.ArenaBytes())
		require.NoError(t, err)
		mr, err := eng.Register(fmt.Sprintf("mamba%d", r), m.ArenaBytes())
		require.NoError(t, err)
		s.shards = append(s.shards, Shard{KV: kr, Mamba: mr, KVConfig: k, MambaConfig: m})
	}
	s.m, err = hybrid.New(hybrid.Config{KV: s.shards[0].KVConfig, Mamba: s.shards[0].MambaConfig})
	require.NoError(t, err)
	s.rank, err = NewTPRankRegions(s.m, kv, mc, s.shards)
	require.NoError(t, err)
	return s
}

// TestTPRankRegionsWrite moves one request from a TP-P rank to a TP-D rank
// through a real data plane (inproc and tcp): the receiver grants
// Resolve's extents (every shard's), the writer writes Source's, the commit
// verifies the manifest, and every receiver shard then holds exactly the
// model's TP-1 bytes sharded to D. Garbage around the request must stay.
func TestTPRankRegionsWrite(t *testing.T) {
	kv := kvcache.Config{Layers: 2, KVHeads: 2, HeadDim: 16, ElemSize: 4, TokensPerBlock: 16}
	mc := mambacache.Config{Layers: 3, DState: 16, DConv: 4, Heads: 4, HeadDim: 16, NGroups: 2, ConvElemSize: 4, SSMElemSize: 4}
	rng := rand.New(rand.NewPCG(12, 2))
	for _, tr := range []rdma.Transport{rdma.TransportInproc, rdma.TransportTCP} {
		for _, pr := range [][2]int{{2, 1}, {1, 4}, {4, 2}, {2, 2}, {1, 1}} {
			from, to := pr[0], pr[1]
			t.Run(fmt.Sprintf("%s/%d→%d", tr, from, to), func(t *testing.T) {
				src := newTPSide(t, "src", kv, mc, from, tr, 12)
				dst := newTPSide(t, "dst", kv, mc, to, tr, 12)
				const tokens = 40              // 3 blocks
				_, err := dst.m.Prepare(1, 16) // a neighbour, so the request's blocks are not at 0
				require.NoError(t, err)
				for _, s := range dst.shards {
					for _, r := range []*rdma.Region{s.KV, s.Mamba} {
						for i := range r.Bytes() {
							r.Bytes()[i] = 0xee
						}
					}
				}
				res, err := src.m.Prepare(7, tokens)
				require.NoError(t, err)
				// The TP-1 cache, sharded into the writer's shards.
				full := KVorRow{}
				full.fill(rng, kv, mc, 3)
				full.shard(t, kv, mc, src.shards, res)
				dres, err := dst.m.Prepare(9, tokens)
				require.NoError(t, err)
				dest, err := dst.rank.Resolve(dres)
				require.NoError(t, err)
				g, err := dst.eng.OpenGrant(rdma.GrantSpec{RequestID: 9, Extents: dest.extents()})
				require.NoError(t, err)
				source, err := src.rank.Source(res, to)
				require.NoError(t, err)
				kb, mb := source.bytes()
				dkb, dmb := dest.bytes()
				require.Equal(t, [2]uint64{dkb, dmb}, [2]uint64{kb, mb})
				_, err = src.eng.Connect(context.Background(), dst.eng.Descriptor())
				require.NoError(t, err)
				_, err = src.eng.Write(context.Background(), dst.eng.Descriptor(), g.Ticket(), source.extents())
				require.NoError(t, err)
				_, err = g.Wait(context.Background())
				require.NoError(t, err)
				want := KVorRow{}
				want.fromShards(t, kv, mc, dst.shards, dres)
				require.Equal(t, full, want, "receiver shards read back as TP 1")
				// The neighbour's blocks were not touched.
				nres, err := dst.m.KV().Blocks(1, nil)
				require.NoError(t, err)
				for _, s := range dst.shards {
					x := s.KVConfig.BlockExtent(nres[0])
					require.Equal(t, bytes.Repeat([]byte{0xee}, int(x.Length)), s.KV.Bytes()[x.Offset:x.Offset+x.Length])
				}
			})
		}
	}
}

// KVorRow is one request's TP-1 cache: its KV blocks and its Mamba row.
type KVorRow struct {
	Blocks [][]byte
	Row    []byte
}

func (c *KVorRow) fill(rng *rand.Rand, kv kvcache.Config, mc mambacache.Config, blocks int) {
	b := kv
	b.Blocks = 1
	for range blocks {
		u := make([]byte, b.BlockBytes())
		for i := range u {
			u[i] = byte(rng.Uint32())
		}
		c.Blocks = append(c.Blocks, u)
	}
	c.Row = make([]byte, mc.RowBytes())
	for i := range c.Row {
		c.Row[i] = byte(rng.Uint32())
	}
}

func blockList(res hybrid.Resources) []kvcache.BlockID {
	var out []kvcache.BlockID
	for _, r := range res.Runs {
		for i := range r.Len {
			out = append(out, r.Start+kvcache.BlockID(i))
		}
	}
	return out
}

// shard writes c into the shards' pools at res, with the plans 1→TP.
func (c *KVorRow) shard(t *testing.T, kv kvcache.Config, mc mambacache.Config, shards []Shard, res hybrid.Resources) {
	kp, err := reshard.New(reshard.KV(kv), 1, len(shards))
	require.NoError(t, err)
	mp, err := reshard.New(reshard.Mamba(mc), 1, len(shards))
	require.NoError(t, err)
	for r, s := range shards {
		for i, b := range blockList(res) {
			x := s.KVConfig.BlockExtent(b)
			reshard.Apply(s.KV.Bytes()[x.Offset:x.Offset+x.Length], c.Blocks[i], kp.Copies(0, r))
		}
		x := s.MambaConfig.RowExtent(res.Row)
		reshard.Apply(s.Mamba.Bytes()[x.Offset:x.Offset+x.Length], c.Row, mp.Copies(0, r))
	}
}

// fromShards reads res back from the shards' pools as TP 1 (plans TP→1).
func (c *KVorRow) fromShards(t *testing.T, kv kvcache.Config, mc mambacache.Config, shards []Shard, res hybrid.Resources) {
	kp, err := reshard.New(reshard.KV(kv), len(shards), 1)
	require.NoError(t, err)
	mp, err := reshard.New(reshard.Mamba(mc), len(shards), 1)
	require.NoError(t, err)
	c.Row = make([]byte, mp.DstBytes)
	for _, b := range blockList(res) {
		u := make([]byte, kp.DstBytes)
		for r, s := range shards {
			x := s.KVConfig.BlockExtent(b)
			reshard.Apply(u, s.KV.Bytes()[x.Offset:x.Offset+x.Length], kp.Copies(r, 0))
		}
		c.Blocks = append(c.Blocks, u)
	}
	for r, s := range shards {
		x := s.MambaConfig.RowExtent(res.Row)
		reshard.Apply(c.Row, s.Mamba.Bytes()[x.Offset:x.Offset+x.Length], mp.Copies(r, 0))
	}
}
