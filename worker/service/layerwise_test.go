package service

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/worker"
)

// The pieces of every part a chunked prefill reports tile the request's
// whole write exactly (each byte once), and carry the bytes the write
// would send: its blocks in token order (scattered in the arena), then
// its Mamba row.
func TestPiecesOfTileTheWrite(t *testing.T) {
	e, err := model.Lookup(model.TinyHybrid)
	require.NoError(t, err)
	for _, tpb := range []int{4, 16, 32} {
		name := fmt.Sprintf("%d tokens per block", tpb)
		for _, c := range []struct{ n, chunk int }{{1, 0}, {37, 0}, {37, 5}, {64, 16}, {50, 7}} {
			spec := e.Spec()
			kv := spec.KV
			kv.Blocks, kv.TokensPerBlock = 40, tpb
			m := spec.Mamba
			m.MaxBatchSize = 3
			arena := map[rdma.RegionID][]byte{1: make([]byte, kv.ArenaBytes()), 2: make([]byte, m.ArenaBytes())}
			nb := kv.BlocksFor(c.n)
			blocks := make([]kvcache.BlockID, nb)
			for i := range blocks {
				blocks[i] = kvcache.BlockID(39 - 2*i) // scattered, descending
			}
			cache := model.Cache{KVArena: arena[1], KV: kv, Blocks: blocks, MambaArena: arena[2], Mamba: m, Row: 1}
			toks := make([]int32, c.n)
			for i := range toks {
				toks[i] = int32(i*7+3) % 200
			}
			whole := uint64(nb)*uint64(kv.BlockBytes()) + uint64(m.RowBytes())
			got := make([]byte, whole)
			seen := make([]int, whole)
			var pieces []transfer.Piece
			chunk := c.chunk
			if chunk == 0 {
				chunk = c.n
			}
			for from := 0; from < c.n; from += chunk {
				to := min(c.n, from+chunk)
				_, err := model.PrefillChunk(context.Background(), e, cache, toks, from, to, func(p model.Part) {
					pieces = piecesOf(pieces[:0], kv, m, 1, 2, worker.Part{Rank: 0, Blocks: blocks, Row: 1, Part: p})
					for _, pc := range pieces {
						copy(got[pc.At:pc.At+pc.Src.Length], arena[pc.Src.Region][pc.Src.Offset:pc.Src.Offset+pc.Src.Length])
						for i := pc.At; i < pc.At+pc.Src.Length; i++ {
							seen[i]++
						}
					}
				})
				require.NoError(t, err)
			}
			var want []byte
			for _, b := range blocks {
				x := kv.BlockExtent(b)
				want = append(want, arena[1][x.Offset:x.End()]...)
			}
			x := m.RowExtent(1)
			want = append(want, arena[2][x.Offset:x.End()]...)
			for i, k := range seen {
				require.Equal(t, 1, k, "%s %+v: byte %d of %d written %d times", name, c, i, whole, k)
			}
			require.Equal(t, want, got, "%s %+v", name, c)
		}
	}
}
