package model_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/reshard"
)

// shardArenas are the pools of every shard of a TP-tp group.
func shardArenas(t testing.TB, spec model.Spec, tp, blocks, batch int) []*arenas {
	t.Helper()
	sh, err := model.ShardSpec(spec, tp)
	require.NoError(t, err)
	out := make([]*arenas, tp)
	for r := range out {
		out[r] = newArenas(t, sh, blocks, batch)
		out[r].fill(0x77) // garbage left by earlier requests, as in the reference
	}
	return out
}

func shardCaches(as []*arenas, row mambacache.Row, blocks ...kvcache.BlockID) []model.Cache {
	cs := make([]model.Cache, len(as))
	for r, a := range as {
		cs[r] = a.cache(row, blocks...)
	}
	return cs
}

// gather reads the TP-1 bytes of one request back from its shard caches:
// the plans tp→1 applied block by block and to the row.
func gather(t testing.TB, spec model.Spec, cs []model.Cache, nb int) (kv [][]byte, row []byte) {
	t.Helper()
	tp := len(cs)
	kvFull := spec.KV
	kvFull.TokensPerBlock = cs[0].KV.TokensPerBlock
	kp, err := reshard.New(reshard.KV(kvFull), tp, 1)
	require.NoError(t, err)
	mp, err := reshard.New(reshard.Mamba(spec.Mamba), tp, 1)
	require.NoError(t, err)
	for b := range nb {
		dst := make([]byte, kp.DstBytes)
		for r, c := range cs {
			x := c.KV.BlockExtent(c.Blocks[b])
			reshard.Apply(dst, c.KVArena[x.Offset:x.Offset+x.Length], kp.Copies(r, 0))
		}
		kv = append(kv, dst)
	}
	row = make([]byte, mp.DstBytes)
	for r, c := range cs {
		x := c.Mamba.RowExtent(c.Row)
		reshard.Apply(row, c.MambaArena[x.Offset:x.Offset+x.Length], mp.Copies(r, 0))
	}
	return kv, row
}

// TP 1, 2 and 4 of tiny-hybrid give bit-identical logits, step after step,
// and caches whose TP-1 reading is bit-identical to the unsharded run's.
// TP 4 replicates both KV heads and both groups.
func TestTinyShardedIsTPInvariant(t *testing.T) {
	for _, name := range []string{model.TinyHybrid, model.TinyHybrid + "?mtp=1"} {
		t.Run(name, func(t *testing.T) { testTinyShardedIsTPInvariant(t, lookup(t, name)) })
	}
}

func testTinyShardedIsTPInvariant(t *testing.T, e model.Executor) {
	spec := e.Spec()
	tpb := spec.KV.TokensPerBlock
	ctx := context.Background()
	for _, n := range []int{1, tpb, 2*tpb + 3} {
		toks := prompt(n+4, byte(n))
		nb := (n + 4 + tpb - 1) / tpb
		ref := newArenas(t, spec, nb+1, 2)
		ref.fill(0x77)
		rc := ref.cache(1, blockRange(1, nb)...)
		want, err := e.Prefill(rc, toks[:n])
		require.NoError(t, err)
		wantSteps := [][]float32{want}
		for i := n; i < n+4; i++ {
			l, err := e.Decode(rc, toks[i], i)
			require.NoError(t, err)
			wantSteps = append(wantSteps, l)
		}
		var wantKV [][]byte
		for b := range nb {
			x := rc.KV.BlockExtent(rc.Blocks[b])
			wantKV = append(wantKV, ref.kvMem[x.Offset:x.Offset+x.Length])
		}
		x := rc.Mamba.RowExtent(rc.Row)
		wantRow := ref.mMem[x.Offset : x.Offset+x.Length]
		for _, tp := range []int{1, 2, 4} {
			t.Run(fmt.Sprintf("n%d/tp%d", n, tp), func(t *testing.T) {
				as := shardArenas(t, spec, tp, nb+2, 2)
				// Blocks in another order than the reference's: layout must not matter.
				bl := blockRange(2, nb)
				for i, j := 0, len(bl)-1; i < j; i, j = i+1, j-1 {
					bl[i], bl[j] = bl[j], bl[i]
				}
				cs := shardCaches(as, 0, bl...)
				got, err := model.PrefillShards(ctx, e, cs, toks[:n])
				require.NoError(t, err)
				require.Equal(t, bits(wantSteps[0]), bits(got), "prefill logits")
				for i := n; i < n+4; i++ {
					got, err := model.DecodeShards(ctx, e, cs, toks[i], i)
					require.NoError(t, err)
					require.Equal(t, bits(wantSteps[i-n+1]), bits(got), "decode logits at %d", i)
				}
				kv, row := gather(t, spec, cs, nb)
				require.Equal(t, wantRow, row, "mamba row")
				for b := range nb {
					require.Equal(t, wantKV[b], kv[b], "kv block %d", b)
				}
			})
		}
	}
}

// A TP size the model does not split over is refused by name.
func TestShardedRefusesIndivisibleTP(t *testing.T) {
	e := lookup(t, model.TinyHybrid)
	for tp, dim := range map[int]string{3: "2 kv heads over TP 3", 8: "4 mamba heads over TP 8"} {
		err := model.CheckTP(e, tp)
		require.ErrorIs(t, err, model.ErrInvalidCache, "tp %d", tp)
		require.ErrorIs(t, err, reshard.ErrIndivisible, "tp %d", tp)
		require.Contains(t, err.Error(), dim)
	}
	require.NoError(t, model.CheckTP(e, 4))
	// Shard caches of the wrong shape are refused before any write.
	spec := e.Spec()
	as := shardArenas(t, spec, 2, 2, 1)
	cs := shardCaches(as, 0, 0)
	cs = append(cs, cs[0]) // three caches with TP-2 shapes
	_, err := model.PrefillShards(context.Background(), e, cs, prompt(3, 1))
	require.ErrorIs(t, err, model.ErrInvalidCache)
}

// The synthetic executors run sharded through a TP-1 view: same logits and
// same TP-1 bytes as unsharded.
func TestSyntheticShardedMatchesTP1(t *testing.T) {
	ctx := context.Background()
	for _, e := range smallExecutors(t)[1:] {
		spec := e.Spec()
		tpb := spec.KV.TokensPerBlock
		n := 2*tpb + 1
		toks := prompt(n+1, 9)
		nb := (n + 1 + tpb - 1) / tpb
		ref := newArenas(t, spec, nb, 1)
		rc := ref.cache(0, blockRange(0, nb)...)
		want, err := e.Prefill(rc, toks[:n])
		require.NoError(t, err)
		want2, err := e.Decode(rc, toks[n], n)
		require.NoError(t, err)
		for _, tp := range []int{2, 4} {
			as := shardArenas(t, spec, tp, nb, 1)
			cs := shardCaches(as, 0, blockRange(0, nb)...)
			got, err := model.PrefillShards(ctx, e, cs, toks[:n])
			require.NoError(t, err)
			require.Equal(t, bits(want), bits(got), "%s tp %d", spec.Name, tp)
			got2, err := model.DecodeShards(ctx, e, cs, toks[n], n)
			require.NoError(t, err)
			require.Equal(t, bits(want2), bits(got2), "%s tp %d", spec.Name, tp)
			_, row := gather(t, spec, cs, nb)
			x := rc.Mamba.RowExtent(rc.Row)
			require.Equal(t, ref.mMem[x.Offset:x.Offset+x.Length], row)
		}
	}
}

// Sharded binds shards 1.. to an executor whose calls name shard 0's
// cache: the worker's ranks keep one Cache per request and get TP for free.
func TestShardedExecutorBindsTheOtherShards(t *testing.T) {
	e := lookup(t, model.TinyHybrid)
	spec := e.Spec()
	toks := prompt(20, 3)
	ref := newArenas(t, spec, 2, 1)
	want, err := e.Prefill(ref.cache(0, 0, 1), toks)
	require.NoError(t, err)
	as := shardArenas(t, spec, 4, 2, 1)
	var more []model.ShardPools
	for _, a := range as[1:] {
		more = append(more, model.ShardPools{KVArena: a.kvMem, KV: a.kv, MambaArena: a.mMem, Mamba: a.mamba})
	}
	se, err := model.Sharded(e, more)
	require.NoError(t, err)
	got, err := model.PrefillContext(context.Background(), se, as[0].cache(0, 0, 1), toks)
	require.NoError(t, err)
	require.Equal(t, bits(want), bits(got))
	_, err = model.Sharded(e, more[:2])
	require.ErrorIs(t, err, reshard.ErrIndivisible, "TP 3")
}

// A TP group prefills in chunks, layer by layer, as one shard does: the
// caches and logits equal a whole-prompt PrefillShards, and every part is
// final on every shard when it is reported (no byte of it changes later),
// so a sender that ships it at once ships the bytes decode needs.
func TestShardedChunkedPrefill(t *testing.T) {
	ctx := context.Background()
	for _, e := range smallExecutors(t) {
		spec := e.Spec()
		tpb := spec.KV.TokensPerBlock
		n := 2*tpb + 3
		toks := prompt(n, 5)
		nb := (n + tpb - 1) / tpb
		for _, tp := range []int{2, 4} {
			ref := shardArenas(t, spec, tp, nb, 1)
			want, err := model.PrefillShards(ctx, e, shardCaches(ref, 0, blockRange(0, nb)...), toks)
			require.NoError(t, err)
			wantKV, wantRow := gather(t, spec, shardCaches(ref, 0, blockRange(0, nb)...), nb)
			for _, chunk := range []int{n, 5, tpb} {
				name := fmt.Sprintf("%s/tp%d/chunk%d", spec.Name, tp, chunk)
				as := shardArenas(t, spec, tp, nb, 1)
				var more []model.ShardPools
				for _, a := range as[1:] {
					more = append(more, model.ShardPools{KVArena: a.kvMem, KV: a.kv, MambaArena: a.mMem, Mamba: a.mamba})
				}
				se, err := model.Sharded(e, more)
				require.NoError(t, err)
				require.True(t, model.Chunked(se), name)
				c0 := as[0].cache(0, blockRange(0, nb)...)
				type snap struct {
					mem []byte
					off int64
					b   []byte
				}
				var snaps []snap
				keep := func(mem []byte, off, n int64) {
					snaps = append(snaps, snap{mem, off, append([]byte(nil), mem[off:off+n]...)})
				}
				var got []float32
				for from := 0; from < n; from += chunk {
					to := min(n, from+chunk)
					got, err = model.PrefillChunk(ctx, se, c0, toks, from, to, func(p model.Part) {
						for _, a := range as {
							if p.Kind == 'M' {
								x := a.mamba.LayerExtent(0, p.MambaLayer)
								keep(a.mMem, x.Offset, x.Length)
								continue
							}
							slot := int64(a.kv.HeadDim * a.kv.ElemSize)
							for pos := p.From; pos < p.To; pos++ {
								for _, k := range []kvcache.KV{kvcache.K, kvcache.V} {
									for h := range a.kv.KVHeads {
										keep(a.kvMem, a.kv.TokenOffset(kvcache.BlockID(pos/tpb), p.KVLayer, k, pos%tpb, h), slot)
									}
								}
							}
						}
					})
					require.NoError(t, err, name)
				}
				require.Equal(t, bits(want), bits(got), name)
				kv, row := gather(t, spec, shardCaches(as, 0, blockRange(0, nb)...), nb)
				require.Equal(t, wantRow, row, name)
				require.Equal(t, wantKV, kv, name)
				require.NotEmpty(t, snaps)
				for i, s := range snaps {
					require.Equal(t, s.b, s.mem[s.off:s.off+int64(len(s.b))], "%s: part %d changed after it was reported", name, i)
				}
			}
		}
	}
}
