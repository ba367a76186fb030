package transfer

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/rdma"
)

// finishedOf is the Finished a model part names (as the worker's sink
// converts it).
func finishedOf(p model.Part) (Finished, bool) {
	switch p.Kind {
	case 'M':
		return Finished{Mamba: true, Layer: p.MambaLayer}, true
	case '*':
		return Finished{Layer: p.KVLayer, From: p.From, To: p.To, End: p.End}, true
	}
	return Finished{}, false
}

// A TP-P group prefills a prompt in chunks, layer by layer; the pieces of
// every part it reports, read at once (as a stream sends them while later
// layers compute), tile the whole resharded write to a TP-D receiver
// exactly, each byte once, and carry the bytes that write sends after
// prefill: streaming and the write agree to the byte for every pair of TP
// sizes, tiny-hybrid's replicated KV heads and groups at TP 4 included
// (a Mamba layer is one row of the unit whatever its sections: package
// reshard's property test covers x|B|C and Q|K|V).
func TestPiecesTileTheWrite(t *testing.T) {
	tiny, err := model.Lookup(model.TinyHybrid)
	require.NoError(t, err)
	for _, e := range []model.Executor{tiny} {
		for _, tpb := range []int{4, 16} {
			for _, c := range []struct{ n, chunk int }{{1, 0}, {37, 0}, {37, 5}, {50, 16}} {
				for _, p := range []int{1, 2, 4} {
					for _, d := range []int{1, 2, 4} {
						name := fmt.Sprintf("%s/tpb%d/n%d/chunk%d/p%dd%d", e.Spec().Name, tpb, c.n, c.chunk, p, d)
						checkPiecesTile(t, name, e, tpb, c.n, c.chunk, p, d)
					}
				}
			}
		}
	}
}

func checkPiecesTile(t *testing.T, name string, e model.Executor, tpb, n, chunk, p, d int) {
	t.Helper()
	spec := e.Spec()
	spec.KV.TokensPerBlock = tpb
	sh, err := model.ShardSpec(spec, p)
	require.NoError(t, err, name)
	kv, mc := sh.KV, sh.Mamba
	kv.Blocks, mc.MaxBatchSize = 40, 3
	arena := map[rdma.RegionID][]byte{}
	var src []shardSource
	var more []model.ShardPools
	for s := range p {
		k, m := rdma.RegionID(10+2*s), rdma.RegionID(11+2*s)
		arena[k], arena[m] = make([]byte, kv.ArenaBytes()), make([]byte, mc.ArenaBytes())
		for i := range arena[k] {
			arena[k][i] = 0x77 // what an earlier request left
		}
		src = append(src, shardSource{KV: k, Mamba: m, KVConfig: kv, MambaConfig: mc})
		if s > 0 {
			more = append(more, model.ShardPools{KVArena: arena[k], KV: kv, MambaArena: arena[m], Mamba: mc})
		}
	}
	ex, err := model.Sharded(e, more)
	require.NoError(t, err, name)
	rs, err := newResharder(spec.KV, spec.Mamba, p, d)
	require.NoError(t, err, name)
	blocks := make([]kvcache.BlockID, kv.BlocksFor(n))
	for i := range blocks {
		blocks[i] = kvcache.BlockID(39 - 2*i) // scattered, descending
	}
	const row = 1
	cache := model.Cache{KVArena: arena[10], KV: kv, Blocks: blocks, MambaArena: arena[11], Mamba: mc, Row: row}
	toks := make([]int32, n)
	for i := range toks {
		toks[i] = int32(i*7+3) % 200
	}
	kvb, mb := rs.bytes(len(blocks))
	whole := kvb + mb
	got, seen := make([]byte, whole), make([]int, whole)
	var pieces []Piece
	if chunk == 0 {
		chunk = n
	}
	for from := 0; from < n; from += chunk {
		to := min(n, from+chunk)
		_, err := model.PrefillChunk(context.Background(), ex, cache, toks, from, to, func(part model.Part) {
			f, ok := finishedOf(part)
			if !ok {
				return
			}
			pieces, err = rs.pieces(pieces[:0], src, f, blocks, row)
			require.NoError(t, err, "%s: %v", name, part)
			for _, pc := range pieces {
				require.LessOrEqual(t, pc.At+pc.Src.Length, whole, "%s: %v", name, part)
				copy(got[pc.At:pc.At+pc.Src.Length], arena[pc.Src.Region][pc.Src.Offset:pc.Src.Offset+pc.Src.Length])
				for i := pc.At; i < pc.At+pc.Src.Length; i++ {
					seen[i]++
				}
			}
		})
		require.NoError(t, err, name)
	}
	kx, mx, err := rs.source(src, blocks, row)
	require.NoError(t, err, name)
	var want []byte
	for _, x := range append(kx, mx...) {
		want = append(want, arena[x.Region][x.Offset:x.Offset+x.Length]...)
	}
	require.Len(t, want, int(whole), name)
	for i, k := range seen {
		require.Equal(t, 1, k, "%s: byte %d of %d written %d times", name, i, whole, k)
	}
	require.Equal(t, want, got, name)
}

// A part outside the cache's shapes is refused, not cut into pieces.
func TestPiecesRefuseOutOfRange(t *testing.T) {
	e, err := model.Lookup(model.TinyHybrid)
	require.NoError(t, err)
	spec := e.Spec()
	rs, err := newResharder(spec.KV, spec.Mamba, 2, 1)
	require.NoError(t, err)
	sh, err := model.ShardSpec(spec, 2)
	require.NoError(t, err)
	kv, mc := sh.KV, sh.Mamba
	kv.Blocks, mc.MaxBatchSize = 4, 2
	src := []shardSource{{KV: 1, Mamba: 2, KVConfig: kv, MambaConfig: mc}, {KV: 3, Mamba: 4, KVConfig: kv, MambaConfig: mc}}
	for _, f := range []Finished{
		{Mamba: true, Layer: spec.Mamba.Layers},
		{Mamba: true, Layer: -1},
		{Layer: spec.KV.Layers, To: 1},
		{Layer: 0, From: 3, To: 2},
	} {
		_, err := rs.pieces(nil, src, f, []kvcache.BlockID{0}, 1)
		require.ErrorIs(t, err, rdma.ErrOutOfRange, "%+v", f)
	}
	_, err = rs.pieces(nil, src[:1], Finished{Mamba: true}, []kvcache.BlockID{0}, 1)
	require.ErrorIs(t, err, ErrInvalidConfig)
}
