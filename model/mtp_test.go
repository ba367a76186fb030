package model_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

// greedy prefills toks and decodes n tokens greedily on c, calling each
// with the token the target is about to process and its position.
func greedy(t *testing.T, e model.Executor, c model.Cache, toks []int32, n int, each func(tok int32, pos int)) []int32 {
	t.Helper()
	logits, err := e.Prefill(c, toks)
	require.NoError(t, err)
	var out []int32
	for pos := len(toks); len(out) < n; pos++ {
		tok := model.Sample(logits, 0, 0, 0)
		out = append(out, tok)
		if each != nil {
			each(tok, pos)
		}
		logits, err = e.Decode(c, tok, pos)
		require.NoError(t, err)
	}
	return out
}

// The draft head changes the layout (one more KV layer, its byte in the
// pattern, another fingerprint) and nothing the target computes: the
// logits, and so the tokens, are bit-identical with and without it.
func TestDraftHeadLeavesTheTarget(t *testing.T) {
	plain, mtp := lookup(t, model.TinyHybrid), lookup(t, model.TinyHybrid+"?mtp=1")
	ps, ms := plain.Spec(), mtp.Spec()
	require.False(t, model.HasDraftHead(plain))
	require.True(t, model.HasDraftHead(mtp))
	require.Equal(t, ps.LayerPattern+"+", ms.LayerPattern)
	require.Equal(t, ps.KV.Layers+1, ms.KV.Layers)
	require.NotEqual(t, ps.Fingerprint(), ms.Fingerprint())
	for _, name := range []string{model.NemotronH8B, model.Qwen3Next80B} {
		a, b := lookup(t, name).Spec(), lookup(t, name+"?mtp=1").Spec()
		require.Equal(t, a.KV.Layers+1, b.KV.Layers, name)
		require.NotEqual(t, a.Fingerprint(), b.Fingerprint(), name)
	}

	toks := prompt(40, 3)
	nb := (40 + 64 + 15) / 16
	pa, ma := newArenas(t, ps, nb, 1), newArenas(t, ms, nb, 1)
	pc, mc := pa.cache(0, blockRange(0, nb)...), ma.cache(0, blockRange(0, nb)...)
	lp, err := plain.Prefill(pc, toks)
	require.NoError(t, err)
	lm, err := mtp.Prefill(mc, toks)
	require.NoError(t, err)
	require.Equal(t, bits(lp), bits(lm))
	for pos := 40; pos < 100; pos++ {
		tok := model.Sample(lp, 0, 0, 0)
		lp, err = plain.Decode(pc, tok, pos)
		require.NoError(t, err)
		lm, err = mtp.Decode(mc, tok, pos)
		require.NoError(t, err)
		require.Equal(t, bits(lp), bits(lm), "position %d", pos)
	}
}

// Draft reads the cache and writes nothing; its drafts are deterministic,
// within the vocabulary, and stop at the model's context.
func TestDraftOnlyReads(t *testing.T) {
	for _, name := range []string{model.TinyHybrid, model.NemotronH8B} {
		t.Run(name, func(t *testing.T) {
			e := lookup(t, name+"?mtp=1")
			spec := e.Spec()
			tpb := spec.KV.TokensPerBlock
			n := tpb + 5
			a := newArenas(t, spec, 2, 1)
			a.fill(0x5a)
			c := a.cache(0, 0, 1)
			_, err := e.Prefill(c, prompt(n, 9))
			require.NoError(t, err)
			kv, row := slices.Clone(a.kvMem), slices.Clone(a.mMem)
			d1, err := model.Draft(context.Background(), e, c, 'a', n, 6, nil)
			require.NoError(t, err)
			require.Len(t, d1, 6)
			require.Equal(t, kv, a.kvMem, "the KV pool")
			require.Equal(t, row, a.mMem, "the state rows")
			d2, err := model.Draft(context.Background(), e, c, 'a', n, 6, []int32{1})
			require.NoError(t, err)
			require.Equal(t, append([]int32{1}, d1...), d2, "deterministic, appended")
			for _, d := range d1 {
				require.True(t, d >= 0 && int(d) < spec.Vocab)
			}
			last, err := model.Draft(context.Background(), e, c, 'a', spec.MaxContext-2, 6, nil)
			if name == model.TinyHybrid {
				require.ErrorIs(t, err, model.ErrInvalidCache, "two blocks do not hold the context")
			} else {
				require.ErrorIs(t, err, model.ErrInvalidCache)
				require.Empty(t, last)
			}
		})
	}
}

// Drafts deep in the context: the attention over the draft layer's
// entries spans the whole context (a query head group's scores for 2,000+
// positions), and drafts stop where their verification would pass the
// model's context.
func TestDraftDeepInTheContext(t *testing.T) {
	e := lookup(t, model.TinyHybrid+"?mtp=1")
	spec := e.Spec()
	tpb := spec.KV.TokensPerBlock
	nb := spec.MaxContext / tpb
	a := newArenas(t, spec, nb, 1)
	c := a.cache(0, blockRange(0, nb)...)
	toks := prompt(2101, 4)
	_, err := e.Prefill(c, toks[:2100])
	require.NoError(t, err)
	d, err := model.Draft(context.Background(), e, c, toks[2100], 2100, 4, nil)
	require.NoError(t, err)
	require.Len(t, d, 4, "drafts past position 2048")
	// Position MaxContext-2 holds the next token: one draft fits (the
	// verification runs MaxContext-2 and MaxContext-1), then none. (The
	// entries past the prompt are zeros here: Draft reads them all the
	// same.)
	last := spec.MaxContext - 2
	d, err = model.Draft(context.Background(), e, c, 'a', last, 4, nil)
	require.NoError(t, err)
	require.Len(t, d, 1)
	d, err = model.Draft(context.Background(), e, c, 'a', last+1, 4, nil)
	require.NoError(t, err)
	require.Empty(t, d)
}

// Draft refuses what it cannot run, by name.
func TestDraftRefuses(t *testing.T) {
	ctx := context.Background()
	plain := lookup(t, model.TinyHybrid)
	a := newArenas(t, plain.Spec(), 2, 1)
	_, err := model.Draft(ctx, plain, a.cache(0, 0, 1), 'a', 4, 2, nil)
	require.ErrorIs(t, err, model.ErrNoDraftHead)
	require.ErrorContains(t, err, "mtp=1")

	e := lookup(t, model.TinyHybrid+"?mtp=1")
	b := newArenas(t, e.Spec(), 2, 1)
	c := b.cache(0, 0, 1)
	for _, tc := range []struct {
		name     string
		tok      int32
		pos, k   int
		sentinel error
	}{
		{"token outside the vocabulary", 300, 4, 2, model.ErrInvalidToken},
		{"position 0", 'a', 0, 2, model.ErrInvalidCache},
		{"negative count", 'a', 4, -1, model.ErrInvalidCache},
		{"past the context", 'a', e.Spec().MaxContext, 2, model.ErrContextTooLong},
		{"more positions than the blocks hold", 'a', 40, 2, model.ErrInvalidCache},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := model.Draft(ctx, e, c, tc.tok, tc.pos, tc.k, nil)
			require.ErrorIs(t, err, tc.sentinel)
		})
	}
	dev := model.OnDevice(e, &memory{b: make([]byte, len(b.kvMem))}, &memory{b: make([]byte, len(b.mMem))})
	_, err = model.Draft(ctx, dev, c, 'a', 4, 2, nil)
	require.ErrorIs(t, err, model.ErrInvalidOption, "a draft head over device memory")
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, err = model.Draft(cctx, e, c, 'a', 4, 2, nil)
	require.ErrorIs(t, err, context.Canceled)
	_, err = model.Lookup(model.TinyHybrid + "?mtp=yes")
	require.ErrorIs(t, err, model.ErrInvalidOption)
}

// The drafts of a TP group are those of one GPU, whatever the group's size
// (the draft layer's heads are read from the shards that hold them, and
// each target step writes its entry to every shard holding the head).
func TestDraftIsTPInvariant(t *testing.T) {
	e := lookup(t, model.TinyHybrid+"?mtp=1")
	spec := e.Spec()
	ctx := context.Background()
	n, steps := 37, 8
	toks := prompt(n+steps, 5)
	nb := (n + steps + 16) / 16
	ref := newArenas(t, spec, nb, 1)
	rc := ref.cache(0, blockRange(0, nb)...)
	_, err := e.Prefill(rc, toks[:n])
	require.NoError(t, err)
	var want [][]int32
	for pos := n; pos < n+steps; pos++ {
		d, err := model.Draft(ctx, e, rc, toks[pos], pos, 4, nil)
		require.NoError(t, err)
		want = append(want, d)
		_, err = e.Decode(rc, toks[pos], pos)
		require.NoError(t, err)
	}
	for _, tp := range []int{2, 4} {
		t.Run(fmt.Sprintf("tp%d", tp), func(t *testing.T) {
			as := shardArenas(t, spec, tp, nb+1, 1)
			cs := shardCaches(as, 0, blockRange(1, nb)...)
			more := make([]model.ShardPools, tp-1)
			for i := range more {
				more[i] = model.ShardPools{KVArena: cs[i+1].KVArena, KV: cs[i+1].KV, MambaArena: cs[i+1].MambaArena, Mamba: cs[i+1].Mamba}
			}
			group, err := model.Sharded(e, more)
			require.NoError(t, err)
			_, err = model.PrefillShards(ctx, e, cs, toks[:n])
			require.NoError(t, err)
			for pos := n; pos < n+steps; pos++ {
				d, err := model.Draft(ctx, group, cs[0], toks[pos], pos, 4, nil)
				require.NoError(t, err)
				require.Equal(t, want[pos-n], d, "position %d", pos)
				_, err = model.DecodeShards(ctx, e, cs, toks[pos], pos)
				require.NoError(t, err)
			}
		})
	}
}

// The draft head predicts tiny-hybrid's greedy text often enough to be
// worth its step: of every 4 drafts proposed at each position, count the
// leading ones the target's tokens confirm (what a verification accepts).
// The rate is logged; the test asserts the head is right sometimes and
// wrong sometimes, and that its drafts are not one repeated token.
func TestDraftHeadAcceptance(t *testing.T) {
	e := lookup(t, model.TinyHybrid+"?mtp=1")
	spec := e.Spec()
	ctx := context.Background()
	proposed, accepted := 0, 0
	seen := map[int32]bool{}
	for i, p := range []string{"Hello, handoff", "The quick brown fox", "disaggregated prefill and decode", "0123456789"} {
		toks := model.Encode(p)
		gen := 64
		nb := (len(toks) + gen + spec.KV.TokensPerBlock) / spec.KV.TokensPerBlock
		a := newArenas(t, spec, nb, 1)
		c := a.cache(0, blockRange(0, nb)...)
		var drafts [][]int32
		out := greedy(t, e, c, toks, gen, func(tok int32, pos int) {
			d, err := model.Draft(ctx, e, c, tok, pos, 4, nil)
			require.NoError(t, err)
			drafts = append(drafts, d)
		})
		for j, d := range drafts {
			proposed += len(d)
			target := out[j+1:]
			accepted += model.Accepted(d, target[:min(len(target), len(d)+1)])
			for _, x := range d {
				seen[x] = true
			}
		}
		t.Logf("prompt %d %q: %q", i, p, strings.TrimSpace(model.Decode(out)))
	}
	t.Logf("draft head: %d of %d drafts accepted (%.0f%%), %d distinct draft tokens", accepted, proposed, 100*float64(accepted)/float64(proposed), len(seen))
	require.Positive(t, accepted)
	require.Less(t, accepted, proposed)
	require.Greater(t, len(seen), 4)
}
