package model_test

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
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

// CopyState refuses rows and blocks outside the pools; over device memory
// it copies there (the host copies are the model's, loaded per call), and
// refuses rows outside the pools there too.
func TestCopyStateRefuses(t *testing.T) {
	e := lookup(t, model.TinyHybrid)
	a := newArenas(t, e.Spec(), 4, 1)
	c := a.cache(0, 0)
	require.ErrorIs(t, model.CopyState(e, c, model.StateCopy{FromRow: 0, ToRow: 99}), model.ErrInvalidCache)
	require.ErrorIs(t, model.CopyState(e, c, model.StateCopy{FromRow: 0, ToRow: 1, Block: true, FromBlock: 0, ToBlock: 4}), model.ErrInvalidCache)
	require.NoError(t, model.CopyState(e, c, model.StateCopy{FromRow: 0, ToRow: 1}))
	kvDev, mDev := &memory{b: make([]byte, len(a.kvMem))}, &memory{b: make([]byte, len(a.mMem))}
	for i := range mDev.b {
		mDev.b[i] = byte(i * 7)
	}
	for i := range kvDev.b {
		kvDev.b[i] = byte(i * 13)
	}
	hostKV, hostM := slices.Clone(a.kvMem), slices.Clone(a.mMem)
	d := model.OnDevice(e, kvDev, mDev)
	require.NoError(t, model.CopyState(d, c, model.StateCopy{FromRow: 0, ToRow: 1, Block: true, FromBlock: 2, ToBlock: 3}))
	r0, r1 := c.Mamba.RowExtent(0), c.Mamba.RowExtent(1)
	require.Equal(t, mDev.b[r0.Offset:r0.End()], mDev.b[r1.Offset:r1.End()], "the row, in device memory")
	b2, b3 := c.KV.BlockExtent(2), c.KV.BlockExtent(3)
	require.Equal(t, kvDev.b[b2.Offset:b2.End()], kvDev.b[b3.Offset:b3.End()], "the block, in device memory")
	require.Equal(t, hostKV, a.kvMem, "the host copies are untouched")
	require.Equal(t, hostM, a.mMem)
	require.ErrorIs(t, model.CopyState(d, c, model.StateCopy{FromRow: 0, ToRow: 99}), model.ErrInvalidCache)
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

// With a decode touch (touch=head), CopyState copies the head of each
// state section only: what the copy's decode reads is the source's, so
// a decode from the copy equals one from the source, and nothing beyond
// the heads is written (a simulated GPU's copy costs the CPU no row).
func TestCopyStateHeadsWithDecodeTouch(t *testing.T) {
	spec := touchSpec
	const touch = touchBytes
	e, err := model.NewSyntheticTouch("synthetic-touch", spec, touch)
	require.NoError(t, err)
	n := 11
	a := newArenas(t, e.Spec(), 4, 2)
	a.mamba.CheckpointRows = 1
	a.mMem = make([]byte, a.mamba.ArenaBytes())
	_, err = e.Prefill(a.cache(0, 0, 1), prompt(n, 5))
	require.NoError(t, err)
	// Through a checkpoint row (beyond the real and reserved rows) and back.
	ck := mambacache.Row(a.mamba.TotalRows())
	require.True(t, a.mamba.IsCheckpointRow(ck))
	require.NoError(t, model.CopyState(e, a.cache(1, 0, 1), model.StateCopy{FromRow: 0, ToRow: ck}))
	require.NoError(t, model.CopyState(e, a.cache(1, 0, 1), model.StateCopy{FromRow: ck, ToRow: 1}))
	to := a.mamba.RowExtent(1)
	ssm := a.mamba.SSMExtent(1, 0)
	require.True(t, all(a.mMem[ssm.Offset+touch:ssm.End()], 0), "nothing beyond the head is copied")
	require.False(t, all(a.mMem[to.Offset:to.Offset+touch], 0), "the heads are")

	// Decodes from the source and from the copy, each on blocks of its own
	// holding the same KV.
	copy(a.kvMem[a.kv.BlockExtent(2).Offset:a.kv.BlockExtent(3).End()], a.kvMem[a.kv.BlockExtent(0).Offset:a.kv.BlockExtent(1).End()])
	fromSrc, err := e.Decode(a.cache(0, 0, 1), 'q', n)
	require.NoError(t, err)
	fromCopy, err := e.Decode(a.cache(1, 2, 3), 'q', n)
	require.NoError(t, err)
	require.Equal(t, bits(fromSrc), bits(fromCopy))
}

// A TP group in device memory: CopyState copies in every shard's device
// memory, and refuses a shard with device memory for one pool of two.
func TestCopyStateShardsOnDevice(t *testing.T) {
	e := lookup(t, model.TinyHybrid)
	as := shardArenas(t, e.Spec(), 2, 4, 2)
	cs := shardCaches(as, 0, 0)
	dev := func(a *arenas) (*memory, *memory) {
		kv, m := &memory{b: make([]byte, len(a.kvMem))}, &memory{b: make([]byte, len(a.mMem))}
		for i := range m.b {
			m.b[i] = byte(i*5 + 1)
		}
		return kv, m
	}
	kv0, m0 := dev(as[0])
	kv1, m1 := dev(as[1])
	g, err := model.Sharded(e, []model.ShardPools{{KVArena: as[1].kvMem, KV: as[1].kv, MambaArena: as[1].mMem, Mamba: as[1].mamba, KVMem: kv1, MambaMem: m1}})
	require.NoError(t, err)
	d := model.OnDevice(g, kv0, m0)
	require.NoError(t, model.CopyState(d, cs[0], model.StateCopy{FromRow: 0, ToRow: 1}))
	for i, m := range []*memory{m0, m1} {
		r0, r1 := cs[i].Mamba.RowExtent(0), cs[i].Mamba.RowExtent(1)
		require.Equal(t, m.b[r0.Offset:r0.End()], m.b[r1.Offset:r1.End()], "shard %d's row, in its device memory", i)
	}
	half, err := model.Sharded(e, []model.ShardPools{{KVArena: as[1].kvMem, KV: as[1].kv, MambaArena: as[1].mMem, Mamba: as[1].mamba, MambaMem: m1}})
	require.NoError(t, err)
	require.ErrorIs(t, model.CopyState(model.OnDevice(half, kv0, m0), cs[0], model.StateCopy{FromRow: 0, ToRow: 1}), model.ErrInvalidCache)
}
