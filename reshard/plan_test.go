package reshard

import (
	"fmt"
	"testing"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/stretchr/testify/require"
)

// mamba2 is a Mamba2 (x|B|C) shape with the given heads and groups.
func mamba2(heads, groups int) mambacache.Config {
	return mambacache.Config{Layers: 2, DState: 4, DConv: 4, Heads: heads, HeadDim: 2, NGroups: groups,
		ConvElemSize: 2, SSMElemSize: 4, ConvLayout: mambacache.ConvXBC}
}

// TestWorkedExample is the worked example of hetero-tp.md as a golden
// test: H=128, hd=64, G=8, N=128, K=3, P=2 → D=4, decode rank 1. Source
// rank 0 holds x rows [0,4096) | B [4096,4608) | C [4608,5120); decode
// rank 1 gets x rows [2048,4096) → [0,2048), B rows [4352,4608) →
// [2048,2304), C rows [4864,5120) → [2304,2560), SSM heads [32,64) →
// [0,32). A conv row is K·e_c bytes; the SSM follows the local conv state.
func TestWorkedExample(t *testing.T) {
	const (
		ec, es  = 2, 4
		row     = 3 * ec            // one conv row (channel): K = d_conv-1 elements
		head    = 64 * 128 * es     // one SSM head: [hd][N]
		srcConv = 5120 * row        // conv bytes of a TP-2 shard
		dstConv = 2560 * row        // of a TP-4 shard
		srcRow  = srcConv + 64*head // one layer of a TP-2 row
		dstRow  = dstConv + 32*head
	)
	c := mambacache.Config{Layers: 2, DState: 128, DConv: 4, Heads: 128, HeadDim: 64, NGroups: 8,
		ConvElemSize: ec, SSMElemSize: es, ConvLayout: mambacache.ConvXBC}
	p, err := New(Mamba(c), 2, 4)
	require.NoError(t, err)
	rows := func(src, dst, n int64) Copy {
		return Copy{Src: src, Dst: dst, Len: n, Count: 2, SrcStride: srcRow, DstStride: dstRow}
	}
	require.Equal(t, []Copy{
		rows(2048*row, 0, 2048*row),             // x
		rows(4352*row, 2048*row, 256*row),       // B
		rows(4864*row, 2304*row, 256*row),       // C
		rows(srcConv+32*head, dstConv, 32*head), // SSM heads
	}, p.Copies(0, 1), "source 0 → decode 1\n%v", p)
	require.Nil(t, p.Copies(1, 1), "source 1 holds heads [64,128): nothing for decode 1")
	require.Equal(t, int64(2*srcRow), p.SrcBytes)
	require.Equal(t, int64(2*dstRow), p.DstBytes)
	require.NoError(t, exactlyOnce(p))
}

// TestReplicatedGroups covers n_groups < TP: every shard holds one group,
// and exactly one replica writes it into each destination shard.
func TestReplicatedGroups(t *testing.T) {
	for _, tc := range []struct{ groups, from, to int }{
		{1, 1, 4}, {1, 4, 1}, {1, 2, 1}, {1, 4, 4}, {1, 2, 4}, {1, 4, 2},
		{2, 1, 4}, {2, 4, 1}, {2, 4, 2}, {2, 2, 4}, {2, 4, 4}, {2, 4, 8},
	} {
		t.Run(fmt.Sprintf("groups=%d/%d→%d", tc.groups, tc.from, tc.to), func(t *testing.T) {
			c := mamba2(8, tc.groups)
			l := Mamba(c)
			p, err := New(l, tc.from, tc.to)
			require.NoError(t, err)
			require.NoError(t, exactlyOnce(p))

			// Who writes B and C into each destination shard: one writer
			// per group it holds, a shard holding that group.
			dstCfg, err := MambaShard(c, tc.to)
			require.NoError(t, err)
			b := dstCfg.ConvExtent(0, 0, mambacache.SectionB)
			cc := dstCfg.ConvExtent(0, 0, mambacache.SectionC)
			for rd := range tc.to {
				glo, ghi := Holds(l.Sections[1], tc.to, rd)
				writers := map[int]int{} // group → source shard
				for rs := range tc.from {
					for _, cp := range p.Copies(rs, rd) {
						for pc := range cp.Pieces() {
							// pieces of layer 0 landing in B or C (pieces
							// may span sections when they merged)
							for _, sec := range []mambacache.Extent{b, cc} {
								lo, hi := max(pc.Dst, sec.Offset), min(pc.Dst+pc.Len, sec.End())
								if lo >= hi {
									continue
								}
								g := glo + int((lo-sec.Offset)/l.Sections[1].ItemBytes)
								slo, shi := Holds(l.Sections[1], tc.from, rs)
								require.True(t, slo <= g && g < shi, "source %d does not hold group %d", rs, g)
								if w, ok := writers[g]; ok && w != rs {
									require.Failf(t, "two writers", "group %d into decode %d from sources %d and %d", g, rd, w, rs)
								}
								writers[g] = rs
							}
						}
					}
				}
				require.Len(t, writers, ghi-glo, "decode %d holds groups [%d,%d)", rd, glo, ghi)
			}
		})
	}
}

// TestVLLM55208 is the trap of vLLM #55208: with n_groups=1 and prefill
// TP 2 (each prefill shard holds the one group), the naive
// b_local·tp_ratio puts decode's C section 2N channels after x, where
// N is right, and both replicas write B. The plan puts C where
// mambacache puts it for the decode shard and takes B and C from one
// replica.
func TestVLLM55208(t *testing.T) {
	c := mamba2(8, 1)
	p, err := New(Mamba(c), 2, 1)
	require.NoError(t, err)
	require.NoError(t, exactlyOnce(p))
	col := int64(c.DConv-1) * int64(c.ConvElemSize)
	x := int64(c.Heads*c.HeadDim) * col
	cAt := c.ConvExtent(0, 0, mambacache.SectionC).Offset
	require.Equal(t, x+int64(c.DState)*col, cAt, "C starts N channels after x")
	naive := x + 2*int64(c.DState)*col // b_local(N)·tp_ratio(2)
	var intoC []int                    // sources whose copies cover decode's C of layer 0
	for rs := range 2 {
		for _, cp := range p.Copies(rs, 0) {
			if cp.Dst <= cAt && cAt < cp.Dst+cp.Len {
				intoC = append(intoC, rs)
			}
			require.NotEqual(t, naive, cp.Dst, "a copy lands at the naive C offset")
		}
	}
	require.Equal(t, []int{0}, intoC, "one writer of C:\n%v", p)
	require.Equal(t, c.RowBytes(), p.DstBytes)
}

// TestReplicatedKVHeads covers 2 KV heads at TP 4: shards 0,1 hold head 0
// and shards 2,3 head 1.
func TestReplicatedKVHeads(t *testing.T) {
	c := kvcache.Config{Layers: 2, KVHeads: 2, HeadDim: 4, ElemSize: 2, TokensPerBlock: 4}
	l := KV(c)
	for _, tc := range []struct {
		from, to int
		pairs    [][2]int // (source, destination) pairs that copy anything
	}{
		{1, 4, [][2]int{{0, 0}, {0, 1}, {0, 2}, {0, 3}}},
		{4, 1, [][2]int{{0, 0}, {2, 0}}},                 // replica 0 of each head
		{4, 2, [][2]int{{0, 0}, {3, 1}}},                 // replica rd mod 2
		{4, 4, [][2]int{{0, 0}, {1, 1}, {2, 2}, {3, 3}}}, // each shard its mirror
		{2, 4, [][2]int{{0, 0}, {0, 1}, {1, 2}, {1, 3}}},
		{4, 8, [][2]int{{0, 0}, {1, 1}, {0, 2}, {1, 3}, {2, 4}, {3, 5}, {2, 6}, {3, 7}}},
	} {
		t.Run(fmt.Sprintf("%d→%d", tc.from, tc.to), func(t *testing.T) {
			p, err := New(l, tc.from, tc.to)
			require.NoError(t, err)
			require.NoError(t, exactlyOnce(p))
			var pairs [][2]int
			for rs := range tc.from {
				for rd := range tc.to {
					if len(p.Copies(rs, rd)) > 0 {
						pairs = append(pairs, [2]int{rs, rd})
					}
				}
			}
			require.ElementsMatch(t, tc.pairs, pairs, "%v", p)
			if tc.from == tc.to {
				for r := range tc.from {
					require.Equal(t, []Copy{{Len: p.SrcBytes, Count: 1, SrcStride: p.SrcBytes, DstStride: p.DstBytes}},
						p.Copies(r, r), "equal sizes: one copy of the whole block")
				}
			}
		})
	}
}

// TestNonIntegerRatio reshards P=4 → D=6 and back, where every dimension
// divides both (12 KV heads; 24 heads, 12 groups), with the oracle.
func TestNonIntegerRatio(t *testing.T) {
	for _, m := range []oracle{
		kvModel(kvcache.Config{Layers: 1, KVHeads: 12, HeadDim: 2, ElemSize: 2, TokensPerBlock: 2}),
		mambaModel(mambacache.Config{Layers: 2, DState: 2, DConv: 3, Heads: 24, HeadDim: 1, NGroups: 12,
			ConvElemSize: 2, SSMElemSize: 2, ConvLayout: mambacache.ConvXBC}),
		mambaModel(mambacache.Config{Layers: 1, DState: 3, DConv: 4, Heads: 12, HeadDim: 2, NGroups: 12,
			ConvElemSize: 1, SSMElemSize: 4, ConvLayout: mambacache.ConvQKV}),
	} {
		t.Run(m.name, func(t *testing.T) {
			full := fill(newRand(), m.unit(1))
			p, err := New(m.layout, 4, 6)
			require.NoError(t, err)
			require.NoError(t, exactlyOnce(p))
			got := reshard(t, p, m.shards(full, 4))
			require.NoError(t, sameShards(got, m.shards(full, 6)))
			back, err := New(m.layout, 6, 4)
			require.NoError(t, err)
			require.NoError(t, sameShards(reshard(t, back, got), m.shards(full, 4)))
			// Shard 1 at 4 holds 1/4 of the items, [1/4, 1/2): it spans
			// decode shards 1 and 2 (of sixths).
			require.NotEmpty(t, p.Copies(1, 1))
			require.NotEmpty(t, p.Copies(1, 2))
			require.Empty(t, p.Copies(1, 3))
		})
	}
}

// TestRefused checks that shapes that do not split are refused by name.
func TestRefused(t *testing.T) {
	kv := kvcache.Config{Layers: 2, KVHeads: 4, HeadDim: 4, ElemSize: 2, TokensPerBlock: 4}
	for _, tc := range []struct {
		name     string
		l        Layout
		from, to int
		err      error
		msg      string
	}{
		{"kv heads over 3", KV(kv), 1, 3, ErrIndivisible, "destination: reshard: dimension does not divide the tensor-parallel size: kv section kv: 4 kv heads over TP 3"},
		{"kv heads over 6 (not a multiple)", KV(kv), 6, 1, ErrIndivisible, "source: reshard: dimension does not divide the tensor-parallel size: kv section kv: 4 kv heads over TP 6"},
		{"mamba heads never replicate", Mamba(mamba2(2, 2)), 1, 4, ErrIndivisible, "mamba section x: 2 mamba heads over TP 4 (TP must divide them)"},
		{"groups over 3", Mamba(mamba2(6, 2)), 3, 1, ErrIndivisible, "mamba section B: 2 groups over TP 3"},
		{"gdn groups", Mamba(func() mambacache.Config { c := mamba2(8, 3); c.ConvLayout = mambacache.ConvQKV; return c }()), 2, 1, ErrIndivisible, "mamba section Q: 3 groups over TP 2"},
		{"TP 0", KV(kv), 0, 1, ErrInvalidTP, "TP 0"},
		{"TP too large", KV(kv), 1, MaxTP + 1, ErrInvalidTP, "TP 1025"},
		{"no heads", KV(kvcache.Config{Layers: 1, HeadDim: 1, ElemSize: 1, TokensPerBlock: 2}), 1, 1, ErrInvalidShape, "section kv of 0 kv heads"},
		{"no layers", KV(kvcache.Config{KVHeads: 1, HeadDim: 1, ElemSize: 1, TokensPerBlock: 2}), 1, 1, ErrInvalidShape, "0 rows"},
		{"no sections", Layout{Name: "x", Rows: 1}, 1, 1, ErrInvalidShape, "no sections"},
		{"overflow", Layout{Name: "x", Rows: maxDim, Sections: []Section{{Name: "s", Items: maxDim, ItemBytes: maxDim}}}, 1, 1, ErrInvalidShape, "overflows"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := New(tc.l, tc.from, tc.to)
			require.ErrorIs(t, err, tc.err)
			require.ErrorContains(t, err, tc.msg)
			require.Nil(t, p)
		})
	}
	_, err := KVShard(kv, 3)
	require.ErrorIs(t, err, ErrIndivisible)
	_, err = MambaShard(mamba2(2, 2), 4)
	require.ErrorIs(t, err, ErrIndivisible)
}

// TestShardConfigs checks that the shard layouts are the pools' own: a
// shard's unit size and Mamba section offsets equal those of
// KVShard/MambaShard's Config.
func TestShardConfigs(t *testing.T) {
	kv := kvcache.Config{Layers: 3, KVHeads: 4, HeadDim: 8, ElemSize: 2, TokensPerBlock: 16}
	for _, tp := range []int{1, 2, 4, 8, 16} {
		s, err := KVShard(kv, tp)
		require.NoError(t, err)
		require.Equal(t, max(4/tp, 1), s.KVHeads)
		require.Equal(t, s.BlockBytes(), KV(kv).UnitBytes(tp))
	}
	for _, layout := range []mambacache.ConvLayout{mambacache.ConvXBC, mambacache.ConvQKV} {
		m := mamba2(16, 4)
		m.ConvLayout = layout
		l := Mamba(m)
		for _, tp := range []int{1, 2, 4, 8, 16} {
			s, err := MambaShard(m, tp)
			require.NoError(t, err)
			s.MaxBatchSize = 1
			require.Equal(t, s.RowBytes(), l.UnitBytes(tp))
			var off int64
			for i, sec := range l.Sections[:3] {
				e := s.ConvExtent(0, 1, mambacache.Section(i))
				require.Equal(t, s.LayerExtent(0, 1).Offset+off, e.Offset, "%v section %s at TP %d", layout, sec.Name, tp)
				off += e.Length
			}
			require.Equal(t, s.SSMExtent(0, 1).Offset, s.LayerExtent(0, 1).Offset+off)
		}
	}
}

// TestCompact checks that a plan's size depends on the sections and TP
// sizes, not on the unit's size: a thousand times more layers and tokens
// give the same number of copies, and equal TP sizes one copy per shard.
func TestCompact(t *testing.T) {
	small := kvcache.Config{Layers: 1, KVHeads: 8, HeadDim: 2, ElemSize: 2, TokensPerBlock: 2}
	big := small
	big.Layers, big.TokensPerBlock = 100, 64
	for _, sizes := range [][2]int{{1, 1}, {2, 1}, {1, 2}, {4, 2}, {2, 4}, {8, 2}, {16, 1}} {
		ps, err := New(KV(small), sizes[0], sizes[1])
		require.NoError(t, err)
		pb, err := New(KV(big), sizes[0], sizes[1])
		require.NoError(t, err)
		require.Equal(t, ps.Len(), pb.Len(), "%v", sizes)
		require.LessOrEqual(t, pb.Len(), sizes[0]+sizes[1]-1)
	}
	m := mamba2(8, 2)
	for tp := 1; tp <= 8; tp *= 2 {
		p, err := New(Mamba(m), tp, tp)
		require.NoError(t, err)
		require.Equal(t, tp, p.Len(), "TP %d → %d: one copy per shard\n%v", tp, tp, p)
	}
	p, err := New(Mamba(m), 1, 1)
	require.NoError(t, err)
	require.Equal(t, []Copy{{Len: m.RowBytes(), Count: 1, SrcStride: m.RowBytes(), DstStride: m.RowBytes()}}, p.Copies(0, 0))
}

// TestRepeat checks the run form of the copies: a whole-unit copy becomes
// one longer copy, a strided one more rows.
func TestRepeat(t *testing.T) {
	whole := Copy{Len: 10, Count: 1, SrcStride: 10, DstStride: 10}
	require.Equal(t, Copy{Len: 30, Count: 1, SrcStride: 30, DstStride: 30}, whole.Repeat(3))
	strided := Copy{Src: 2, Dst: 0, Len: 2, Count: 4, SrcStride: 6, DstStride: 3}
	require.Equal(t, Copy{Src: 2, Dst: 0, Len: 2, Count: 12, SrcStride: 6, DstStride: 3}, strided.Repeat(3))
	require.Equal(t, int64(24), strided.Repeat(3).Bytes())
	require.Panics(t, func() { strided.Repeat(0) })
	p, err := New(Mamba(mamba2(8, 2)), 2, 1)
	require.NoError(t, err)
	require.Panics(t, func() { p.Copies(2, 0) })
	require.Panics(t, func() { p.Copies(0, 1) })
}

// TestPieces checks that Pieces yields every piece and stops early.
func TestPieces(t *testing.T) {
	c := Copy{Src: 1, Dst: 2, Len: 3, Count: 3, SrcStride: 10, DstStride: 5}
	var got []Piece
	for pc := range c.Pieces() {
		got = append(got, pc)
	}
	require.Equal(t, []Piece{{1, 2, 3}, {11, 7, 3}, {21, 12, 3}}, got)
	n := 0
	for range c.Pieces() {
		n++
		break
	}
	require.Equal(t, 1, n)
}

// LayerSlots covers exactly the bytes the destination shard's kvcache
// layout gives slots [s0, s1) of the layer, K and V, every head.
func TestLayerSlots(t *testing.T) {
	c := kvcache.Config{Layers: 3, KVHeads: 4, HeadDim: 2, ElemSize: 2, TokensPerBlock: 4, Blocks: 1}
	for _, to := range []int{1, 2, 4, 8} {
		p, err := New(KV(c), 1, to)
		require.NoError(t, err)
		sc, err := KVShard(c, to)
		require.NoError(t, err)
		for layer := range c.Layers {
			for s0 := range c.TokensPerBlock {
				for s1 := s0 + 1; s1 <= c.TokensPerBlock; s1++ {
					want := make([]bool, sc.BlockBytes())
					for _, kv := range []kvcache.KV{kvcache.K, kvcache.V} {
						for h := range sc.KVHeads {
							for s := s0; s < s1; s++ {
								off := sc.TokenOffset(0, layer, kv, s, h)
								for i := off; i < off+int64(c.HeadDim*c.ElemSize); i++ {
									want[i] = true
								}
							}
						}
					}
					got := make([]bool, sc.BlockBytes())
					for lo, hi := range LayerSlots(p, c.TokensPerBlock, layer, int64(s0), int64(s1)) {
						for i := lo; i < hi; i++ {
							require.False(t, got[i], "TP %d layer %d [%d, %d): byte %d twice", to, layer, s0, s1, i)
							got[i] = true
						}
					}
					require.Equal(t, want, got, "TP %d layer %d slots [%d, %d)", to, layer, s0, s1)
				}
			}
		}
	}
}
