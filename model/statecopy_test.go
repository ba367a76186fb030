package model_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/model"
)

// TestCopyStateResumesAPrefill is a prefix-cache hit at the model's level:
// an earlier request prefilled the first L tokens (L inside a block); a new
// request shares its full blocks, gets a copy of its state row and of the
// block holding tokens past the last full one (CopyState, on every shard
// of a TP group), and prefills only [L, n). Its logits and cache equal a
// prefill of the whole prompt from nothing.
func TestCopyStateResumesAPrefill(t *testing.T) {
	ctx := context.Background()
	for _, e := range smallExecutors(t) {
		spec := e.Spec()
		tpb := spec.KV.TokensPerBlock
		n, l := 3*tpb+2, tpb+3
		toks := prompt(n, 9)
		nb := (n + tpb - 1) / tpb
		for _, tp := range []int{1, 2} {
			t.Run(fmt.Sprintf("%s/tp%d", spec.Name, tp), func(t *testing.T) {
				ref := shardArenas(t, spec, tp, nb, 1)
				want, err := model.PrefillShards(ctx, e, shardCaches(ref, 0, blockRange(0, nb)...), toks)
				require.NoError(t, err)
				wantKV, wantRow := gather(t, spec, shardCaches(ref, 0, blockRange(0, nb)...), nb)

				// Blocks 0..nb-1 and row 0 are the earlier request's; the
				// new one has row 1 and blocks nb.. of its own.
				as := shardArenas(t, spec, tp, 2*nb, 2)
				var more []model.ShardPools
				for _, a := range as[1:] {
					more = append(more, model.ShardPools{KVArena: a.kvMem, KV: a.kv, MambaArena: a.mMem, Mamba: a.mamba})
				}
				ex, err := model.Sharded(e, more)
				require.NoError(t, err)
				_, err = model.PrefillChunk(ctx, ex, as[0].cache(0, blockRange(0, nb)...), toks[:l], 0, l, nil)
				require.NoError(t, err)
				full := l / tpb
				blocks := append(blockRange(0, full), blockRange(nb, nb-full)...)
				c := as[0].cache(1, blocks...)
				require.NoError(t, model.CopyState(ex, c, model.StateCopy{FromRow: 0, ToRow: 1, Block: true, FromBlock: kvcache.BlockID(full), ToBlock: blocks[full]}))
				got, err := model.PrefillChunk(ctx, ex, c, toks, l, n, nil)
				require.NoError(t, err)
				require.Equal(t, bits(want), bits(got), "the resumed prefill's logits")
				gotKV, gotRow := gather(t, spec, shardCaches(as, 1, blocks...), nb)
				require.Equal(t, wantRow, gotRow, "the resumed prefill's state row")
				require.Equal(t, wantKV, gotKV, "the resumed prefill's KV")
			})
		}
	}
}

// CopyState refuses rows and blocks outside the pools, and caches in
// device memory (the CPU model cannot resume a prefill there).
func TestCopyStateRefuses(t *testing.T) {
	e := lookup(t, model.TinyHybrid)
	a := newArenas(t, e.Spec(), 4, 1)
	c := a.cache(0, 0)
	require.ErrorIs(t, model.CopyState(e, c, model.StateCopy{FromRow: 0, ToRow: 99}), model.ErrInvalidCache)
	require.ErrorIs(t, model.CopyState(e, c, model.StateCopy{FromRow: 0, ToRow: 1, Block: true, FromBlock: 0, ToBlock: 4}), model.ErrInvalidCache)
	require.NoError(t, model.CopyState(e, c, model.StateCopy{FromRow: 0, ToRow: 1}))
	d := model.OnDevice(e, &memory{b: make([]byte, len(a.kvMem))}, &memory{b: make([]byte, len(a.mMem))})
	require.ErrorIs(t, model.CopyState(d, c, model.StateCopy{FromRow: 0, ToRow: 1}), model.ErrInvalidOption)
}

// BenchmarkCopyStateRow is what taking or using a checkpoint costs: one
// nemotron-h-8b state row (49 MiB) copied within the arena.
func BenchmarkCopyStateRow(b *testing.B) {
	e := lookup(b, model.NemotronH8B)
	spec := e.Spec()
	spec.KV.TokensPerBlock = 16
	a := newArenas(b, spec, 1, 2)
	c := a.cache(0, 0)
	b.SetBytes(a.mamba.RowBytes())
	for b.Loop() {
		if err := model.CopyState(e, c, model.StateCopy{FromRow: 0, ToRow: 1}); err != nil {
			b.Fatal(err)
		}
	}
}
