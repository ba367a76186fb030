package reshard

import (
	"fmt"
	"testing"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/stretchr/testify/require"
)

// side is one TP group's pools for the test: per shard a KV pool and a
// Mamba pool, each over its own arena, as a worker would hold them.
type side struct {
	kv      []*kvcache.Pool
	kvArena [][]byte
	mamba   []*mambacache.Pool
	mArena  [][]byte
}

func newSide(t *testing.T, kv kvcache.Config, m mambacache.Config, tp int) side {
	var s side
	for range tp {
		kc, err := KVShard(kv, tp)
		require.NoError(t, err)
		kc.Blocks = 24
		kp, err := kvcache.New(kc)
		require.NoError(t, err)
		mc, err := MambaShard(m, tp)
		require.NoError(t, err)
		mc.MaxBatchSize = 2
		mp, err := mambacache.New(mc)
		require.NoError(t, err)
		s.kv, s.kvArena = append(s.kv, kp), append(s.kvArena, make([]byte, kc.ArenaBytes()))
		s.mamba, s.mArena = append(s.mamba, mp), append(s.mArena, make([]byte, mc.ArenaBytes()))
	}
	return s
}

// place allocates request id for tokens on every shard, after fragmenting
// the KV pool with fillers of the given sizes (in blocks) that it frees
// every other one of, so that the request's blocks come in several runs
// that differ from side to side. Every shard of a worker allocates alike.
func (s side) place(t *testing.T, id uint64, tokens int, fillers []int) {
	for r := range s.kv {
		tpb := s.kv[r].Config().TokensPerBlock
		for i, n := range fillers {
			require.NoError(t, s.kv[r].Allocate(1000+uint64(i), n*tpb))
		}
		for i := range fillers {
			if i%2 == 0 {
				require.NoError(t, s.kv[r].Free(1000+uint64(i)))
			}
		}
		require.NoError(t, s.kv[r].Allocate(id, tokens))
		_, err := s.mamba[r].Allocate(id)
		require.NoError(t, err)
	}
}

// kvByte is the content of byte i of head h of token tok in layer l, half
// kv: what a TP-1 model would hold there.
func kvByte(l int, kv kvcache.KV, tok, h, i int) byte {
	x := uint32(l)*0x9e3779b1 ^ uint32(kv)*0x85ebca6b ^ uint32(tok)*0xc2b2ae35 ^ uint32(h)*0x27d4eb2f ^ uint32(i)*0x165667b1
	return byte(x ^ x>>15 ^ x>>24)
}

// TestRequestThroughPools moves one request between real pools: the KV
// blocks of a prompt, fragmented differently on each side, and its Mamba
// row. The source shards are written as a TP-P model would write them;
// the plans are applied run by run (Align, Repeat) at the pools' offsets;
// every destination shard must then hold what a TP-D model would.
func TestRequestThroughPools(t *testing.T) {
	// 2 KV heads and 2 groups: replicated at TP 4, 6 and 12.
	kv := kvcache.Config{Layers: 2, KVHeads: 2, HeadDim: 2, ElemSize: 2, TokensPerBlock: 4}
	m := mambacache.Config{Layers: 3, DState: 2, DConv: 4, Heads: 12, HeadDim: 2, NGroups: 2,
		ConvElemSize: 2, SSMElemSize: 4, ConvLayout: mambacache.ConvXBC}
	mo := mambaModel(m)
	full := fill(newRand(), mo.unit(1))
	const id, tokens = 7, 37
	for _, c := range [][2]int{{1, 1}, {2, 1}, {1, 4}, {4, 2}, {2, 4}, {4, 6}, {6, 4}, {1, 12}, {12, 2}} {
		from, to := c[0], c[1]
		t.Run(fmt.Sprintf("%d→%d", from, to), func(t *testing.T) {
			kvPlan, err := New(KV(kv), from, to)
			require.NoError(t, err)
			mPlan, err := New(Mamba(m), from, to)
			require.NoError(t, err)
			src, dst := newSide(t, kv, m, from), newSide(t, kv, m, to)
			src.place(t, id, tokens, []int{2, 1, 3, 1})
			dst.place(t, id, tokens, []int{1, 3, 1, 2, 2})

			// The prefill shards' caches, as a TP-from model writes them.
			for r := range from {
				writeKV(t, src.kv[r], src.kvArena[r], id, tokens, kv.KVHeads, from, r)
				row, _ := src.mamba[r].Row(id)
				e := src.mamba[r].Config().RowExtent(row)
				copy(src.mArena[r][e.Offset:e.End()], mo.shard(full, from, r))
			}

			// The transfer: every prefill shard writes its slices into
			// every decode shard.
			for rs := range from {
				srcRuns, err := src.kv[rs].Runs(id, nil)
				require.NoError(t, err)
				srow, _ := src.mamba[rs].Row(id)
				se := src.mamba[rs].Config().RowExtent(srow)
				for rd := range to {
					dstRuns, err := dst.kv[rd].Runs(id, nil)
					require.NoError(t, err)
					for _, st := range Align(nil, srcRuns, dstRuns) {
						for _, cp := range kvPlan.Copies(rs, rd) {
							Apply(dst.kvArena[rd][int64(st.Dst)*kvPlan.DstBytes:], src.kvArena[rs][int64(st.Src)*kvPlan.SrcBytes:],
								[]Copy{cp.Repeat(st.Len)})
						}
					}
					drow, _ := dst.mamba[rd].Row(id)
					de := dst.mamba[rd].Config().RowExtent(drow)
					Apply(dst.mArena[rd][de.Offset:de.End()], src.mArena[rs][se.Offset:se.End()], mPlan.Copies(rs, rd))
				}
			}

			// Every decode shard holds what a TP-to model would.
			for r := range to {
				checkKV(t, dst.kv[r], dst.kvArena[r], id, tokens, kv.KVHeads, to, r)
				row, _ := dst.mamba[r].Row(id)
				e := dst.mamba[r].Config().RowExtent(row)
				require.Equal(t, mo.shard(full, to, r), dst.mArena[r][e.Offset:e.End()], "decode shard %d's Mamba row", r)
			}
		})
	}
}

// eachHead calls f with the arena offset of every (layer, half, token,
// local head) of request id on shard r of a TP-tp group, and the head's
// global index.
func eachHead(t *testing.T, p *kvcache.Pool, id uint64, tokens, heads, tp, r int, f func(l int, kv kvcache.KV, tok, h int, off int64)) {
	c := p.Config()
	blocks, err := p.Blocks(id, nil)
	require.NoError(t, err)
	lo, hi := refHolds(heads, tp, r)
	for tok := range tokens {
		b, slot := blocks[tok/c.TokensPerBlock], tok%c.TokensPerBlock
		for l := range c.Layers {
			for kv := range kvcache.KV(2) {
				for h := lo; h < hi; h++ {
					f(l, kv, tok, h, c.TokenOffset(b, l, kv, slot, h-lo))
				}
			}
		}
	}
}

func writeKV(t *testing.T, p *kvcache.Pool, arena []byte, id uint64, tokens, heads, tp, r int) {
	n := p.Config().HeadDim * p.Config().ElemSize
	eachHead(t, p, id, tokens, heads, tp, r, func(l int, kv kvcache.KV, tok, h int, off int64) {
		for i := range n {
			arena[off+int64(i)] = kvByte(l, kv, tok, h, i)
		}
	})
}

func checkKV(t *testing.T, p *kvcache.Pool, arena []byte, id uint64, tokens, heads, tp, r int) {
	n := p.Config().HeadDim * p.Config().ElemSize
	eachHead(t, p, id, tokens, heads, tp, r, func(l int, kv kvcache.KV, tok, h int, off int64) {
		for i := range n {
			if arena[off+int64(i)] != kvByte(l, kv, tok, h, i) {
				require.FailNowf(t, "wrong KV byte", "decode shard %d: layer %d %v token %d head %d byte %d", r, l, kv, tok, h, i)
			}
		}
	})
}
