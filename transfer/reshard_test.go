package transfer

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

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
				r, err := NewResharder(sh.kv, sh.m, from, to)
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
				shards := make([]ShardSource, from)
				for s := range from {
					kc, err := reshard.KVShard(sh.kv, from)
					require.NoError(t, err)
					kc.Blocks = pool
					mc, err := reshard.MambaShard(sh.m, from)
					require.NoError(t, err)
					mc.MaxBatchSize = 2
					shards[s] = ShardSource{KV: rdma.RegionID(10 + 2*s), Mamba: rdma.RegionID(11 + 2*s), KVConfig: kc, MambaConfig: mc}
					kvMem, mMem := make([]byte, kc.ArenaBytes()), make([]byte, mc.ArenaBytes())
					for i, b := range blocks {
						x := kc.BlockExtent(b)
						reshard.Apply(kvMem[x.Offset:x.Offset+x.Length], full[i], kvP.Copies(0, s))
					}
					x := mc.RowExtent(row)
					reshard.Apply(mMem[x.Offset:x.Offset+x.Length], fullRow, mP.Copies(0, s))
					regions[shards[s].KV], regions[shards[s].Mamba] = kvMem, mMem
				}
				kv, mamba, err := r.Source(shards, blocks, row)
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
				kb, mb := r.Bytes(nb)
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
	_, err := NewResharder(kv, m, 3, 1)
	require.ErrorIs(t, err, ErrLayoutMismatch)
	require.ErrorIs(t, err, reshard.ErrIndivisible)
	require.ErrorContains(t, err, "source: ")
	_, err = NewResharder(kv, m, 1, 8)
	require.ErrorIs(t, err, reshard.ErrIndivisible)
	require.ErrorContains(t, err, "4 mamba heads over TP 8")
}
