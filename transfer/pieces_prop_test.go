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

// Random shapes, TP pairs and chunkings: the pieces of every part tile the
// whole write once and carry Source's bytes.
func TestPiecesProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 9))
	divs := func(n int) []int {
		var out []int
		for tp := 1; tp <= 16; tp++ {
			if n%tp == 0 || tp%n == 0 {
				out = append(out, tp)
			}
		}
		return out
	}
	for iter := 0; iter < 400; iter++ {
		kvh := []int{1, 2, 4, 8, 3, 6}[rng.IntN(6)]
		ng := []int{1, 2, 4}[rng.IntN(3)]
		mh := ng * []int{1, 2, 4}[rng.IntN(3)] * 2
		kv := kvcache.Config{Layers: 1 + rng.IntN(3), KVHeads: kvh, HeadDim: 1 + rng.IntN(4), ElemSize: 1 + rng.IntN(2), TokensPerBlock: 1 + rng.IntN(8)}
		m := mambacache.Config{Layers: 1 + rng.IntN(3), DState: 1 + rng.IntN(3), DConv: 2 + rng.IntN(3), Heads: mh, HeadDim: 1 + rng.IntN(3), NGroups: ng,
			ConvElemSize: 1 + rng.IntN(2), SSMElemSize: 1 + rng.IntN(4), ConvLayout: mambacache.ConvLayout(rng.IntN(2))}
		// TP sizes valid for both caches.
		var tps []int
		for _, tp := range divs(kvh) {
			if reshard.Mamba(m).Check(tp) == nil && reshard.KV(kv).Check(tp) == nil {
				tps = append(tps, tp)
			}
		}
		p, d := tps[rng.IntN(len(tps))], tps[rng.IntN(len(tps))]
		n := 1 + rng.IntN(40)
		chunk := 1 + rng.IntN(n)
		name := fmt.Sprintf("iter%d kv%+v m%+v p%d d%d n%d chunk%d", iter, kv, m, p, d, n, chunk)
		rs, err := newResharder(kv, m, p, d)
		require.NoError(t, err, name)
		kc, err := reshard.KVShard(kv, p)
		require.NoError(t, err)
		mc, err := reshard.MambaShard(m, p)
		require.NoError(t, err)
		nb := kc.BlocksFor(n)
		kc.Blocks = nb + 5
		mc.MaxBatchSize = 2
		arena := map[rdma.RegionID][]byte{}
		var src []shardSource
		for s := range p {
			k, mm := rdma.RegionID(10+2*s), rdma.RegionID(11+2*s)
			arena[k], arena[mm] = make([]byte, kc.ArenaBytes()), make([]byte, mc.ArenaBytes())
			for i := range arena[k] {
				arena[k][i] = byte(rng.Uint32())
			}
			for i := range arena[mm] {
				arena[mm][i] = byte(rng.Uint32())
			}
			src = append(src, shardSource{KV: k, Mamba: mm, KVConfig: kc, MambaConfig: mc})
		}
		blocks := make([]kvcache.BlockID, nb)
		perm := rng.Perm(kc.Blocks)
		for i := range blocks {
			blocks[i] = kvcache.BlockID(perm[i])
		}
		row := mambacache.Row(rng.IntN(2))
		kvb, mb := rs.bytes(nb)
		whole := kvb + mb
		got, seen := make([]byte, whole), make([]int, whole)
		var pieces []Piece
		apply := func(f Finished) {
			pieces, err = rs.pieces(pieces[:0], src, f, blocks, row)
			require.NoError(t, err, name)
			for _, pc := range pieces {
				require.NotZero(t, pc.Src.Length, name)
				require.LessOrEqual(t, pc.At+pc.Src.Length, whole, name)
				copy(got[pc.At:pc.At+pc.Src.Length], arena[pc.Src.Region][pc.Src.Offset:pc.Src.Offset+pc.Src.Length])
				for i := pc.At; i < pc.At+pc.Src.Length; i++ {
					seen[i]++
				}
			}
		}
		for from := 0; from < n; from += chunk {
			to := min(n, from+chunk)
			for l := range kv.Layers {
				apply(Finished{Layer: l, From: from, To: to, End: to == n})
			}
			if to == n {
				for l := range m.Layers {
					apply(Finished{Mamba: true, Layer: l})
				}
			}
		}
		kx, mx, err := rs.source(src, blocks, row)
		require.NoError(t, err, name)
		var want []byte
		for _, x := range append(kx, mx...) {
			want = append(want, arena[x.Region][x.Offset:x.Offset+x.Length]...)
		}
		require.Len(t, want, int(whole), name)
		for i, k := range seen {
			if k != 1 {
				t.Fatalf("%s: byte %d of %d written %d times", name, i, whole, k)
			}
		}
		require.Equal(t, want, got, name)
	}
}
