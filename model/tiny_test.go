package model_test

import (
	"fmt"
	"math"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
)

func TestTinySpec(t *testing.T) {
	spec := lookup(t, model.TinyHybrid).Spec()
	require.Equal(t, model.TinyHybrid, spec.Name)
	require.Equal(t, model.ByteVocab, spec.Vocab)
	require.Equal(t, 2, spec.KV.Layers)
	require.Equal(t, 3, spec.Mamba.Layers)
	require.Equal(t, 4, spec.KV.ElemSize)
	require.Equal(t, 4, spec.Mamba.ConvElemSize)
	require.Equal(t, 4, spec.Mamba.SSMElemSize)
	require.Zero(t, spec.KV.Blocks, "pool sizing is the caller's")
	require.Zero(t, spec.Mamba.MaxBatchSize, "pool sizing is the caller's")
}

// Prefill of n tokens, then Decode of the next, must be bit-identical to a
// Prefill of n+1 tokens, and to Decode run from position 0, in logits and in
// the cache bytes; whatever the rows and blocks held before.
func TestTinyPrefillEqualsDecode(t *testing.T) {
	e := lookup(t, model.TinyHybrid)
	tpb := e.Spec().KV.TokensPerBlock
	for _, n := range []int{1, 2, tpb - 1, tpb, tpb + 1, 3*tpb + 5} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			toks := prompt(n+1, byte(n))
			need := (n + 1 + tpb - 1) / tpb
			a := newArenas(t, e.Spec(), 3*need, 3)
			a.fill(0x5c) // garbage left by earlier requests

			// A: prefill n+1 tokens in blocks [0, need), row 0.
			ca := a.cache(0, blockRange(0, need)...)
			la, err := e.Prefill(ca, toks)
			require.NoError(t, err)

			// B: prefill n tokens then decode one, blocks in reverse order, row 1.
			bb := blockRange(need, need)
			for i, j := 0, len(bb)-1; i < j; i, j = i+1, j-1 {
				bb[i], bb[j] = bb[j], bb[i]
			}
			cb := a.cache(1, bb...)
			_, err = e.Prefill(cb, toks[:n])
			require.NoError(t, err)
			lb, err := e.Decode(cb, toks[n], n)
			require.NoError(t, err)

			// C: decode only, from position 0, interleaved blocks, row 2.
			cc := a.cache(2, blockRange(2*need, need)...)
			var lc []float32
			for p, tok := range toks {
				lc, err = e.Decode(cc, tok, p)
				require.NoError(t, err)
			}

			require.Equal(t, bits(la), bits(lb))
			require.Equal(t, bits(la), bits(lc))
			sa := state(ca, n+1)
			require.Equal(t, sa, state(cb, n+1))
			require.Equal(t, sa, state(cc, n+1))
		})
	}
}

func TestTinyDeterministic(t *testing.T) {
	run := func(garbage byte) ([]int32, []byte) {
		e := lookup(t, model.TinyHybrid) // a fresh executor each time
		a := newArenas(t, e.Spec(), 8, 1)
		a.fill(garbage)
		c := a.cache(0, blockRange(0, 8)...)
		toks := model.Encode("The quick brown fox jumps over the lazy dog.")
		logits, err := e.Prefill(c, toks)
		require.NoError(t, err)
		var out []int32
		for step := range 40 {
			tok := model.Sample(logits, 0, 0, step)
			out = append(out, tok)
			logits, err = e.Decode(c, tok, len(toks)+step)
			require.NoError(t, err)
		}
		return out, state(c, len(toks)+40)
	}
	out1, st1 := run(0)
	out2, st2 := run(0xff)
	require.Equal(t, out1, out2)
	require.Equal(t, st1, st2)
	// Random weights still give a non-degenerate continuation.
	distinct := map[int32]bool{}
	for _, tok := range out1 {
		distinct[tok] = true
	}
	require.Greater(t, len(distinct), 1, "greedy output %v", out1)
}

func TestTinyPromptSensitivity(t *testing.T) {
	e := lookup(t, model.TinyHybrid)
	a := newArenas(t, e.Spec(), 4, 2)
	l1, err := e.Prefill(a.cache(0, 0, 1), model.Encode("hello world"))
	require.NoError(t, err)
	l2, err := e.Prefill(a.cache(1, 2, 3), model.Encode("hello worle"))
	require.NoError(t, err)
	require.NotEqual(t, bits(l1), bits(l2))
	for tok, v := range l1 {
		// -Inf exactly on the tokens the text prior excludes.
		text := tok == '\n' || tok >= 0x20 && tok < 0x7f || int32(tok) == model.EOS
		require.False(t, math.IsNaN(float64(v)) || math.IsInf(float64(v), 1), "token %d", tok)
		require.Equal(t, !text, math.IsInf(float64(v), -1), "token %d", tok)
	}
}

// A byte flipped anywhere in the state the next Decode reads changes its
// logits. For tiny-hybrid the byte is the sign/exponent byte of a float32
// element: a flip in the low mantissa bits of one element deep in the state
// may be absorbed by float32 rounding.
func TestStateSensitivity(t *testing.T) {
	for _, e := range smallExecutors(t) {
		t.Run(e.Spec().Name, func(t *testing.T) { checkStateSensitivity(t, e) })
	}
}

func checkStateSensitivity(t *testing.T, e model.Executor) {
	name := e.Spec().Name
	spec := e.Spec()
	tpb := spec.KV.TokensPerBlock
	n := tpb + tpb/2 // last block half full
	a := newArenas(t, spec, 2, 1)
	c := a.cache(0, 0, 1)
	toks := prompt(n, 7)
	_, err := e.Prefill(c, toks)
	require.NoError(t, err)
	kvSnap := append([]byte(nil), a.kvMem...)
	mSnap := append([]byte(nil), a.mMem...)
	restore := func() {
		copy(a.kvMem, kvSnap)
		copy(a.mMem, mSnap)
	}
	want, err := e.Decode(c, 'x', n)
	require.NoError(t, err)
	restore()

	type loc struct {
		name  string
		arena []byte
		off   int64
	}
	m, kv := c.Mamba, c.KV
	lastL := m.Layers - 1
	lastKV := kv.Layers - 1 // the target's last attention layer
	if model.HasDraftHead(e) {
		lastKV-- // the draft layer's KV is Draft's alone (mtp_test.go)
	}
	var locs []loc
	for s, sec := range []string{"x", "B", "C"} {
		e := m.ConvExtent(0, lastL, mambacache.Section(s))
		locs = append(locs,
			loc{"conv " + sec + " first", a.mMem, e.Offset + 3},
			loc{"conv " + sec + " last", a.mMem, e.Offset + e.Length - 1})
	}
	ssm0, ssmL := m.SSMExtent(0, 0), m.SSMExtent(0, lastL)
	locs = append(locs,
		loc{"ssm layer 0 first", a.mMem, ssm0.Offset + 3},
		loc{"ssm last layer mid", a.mMem, ssmL.Offset + ssmL.Length/2 + 3},
		loc{"ssm last layer end", a.mMem, ssmL.Offset + ssmL.Length - 1},
		loc{"k last token", a.kvMem, kv.TokenOffset(1, lastKV, kvcache.K, n-1-tpb, kv.KVHeads-1) + 3},
		loc{"v first slot of last block", a.kvMem, kv.TokenOffset(1, 0, kvcache.V, 0, 0) + 3})
	if name == model.TinyHybrid { // real attention reads every position
		locs = append(locs,
			loc{"k token 0", a.kvMem, kv.TokenOffset(0, 0, kvcache.K, 0, 0) + 3},
			loc{"v token 5", a.kvMem, kv.TokenOffset(0, lastKV, kvcache.V, 5, kv.KVHeads-1) + 3})
	}
	if name != model.TinyHybrid { // a checksum covers every byte
		locs = append(locs,
			loc{"ssm low byte", a.mMem, ssmL.Offset + 4},
			loc{"conv low byte", a.mMem, m.ConvExtent(0, 0, mambacache.SectionC).Offset},
			loc{"v low byte", a.kvMem, kv.TokenOffset(1, 0, kvcache.V, 0, 0) + 4})
	}
	for _, l := range locs {
		l.arena[l.off] ^= 0x40
		got, err := e.Decode(c, 'x', n)
		require.NoError(t, err)
		require.NotEqual(t, bits(want), bits(got), l.name)
		restore()
	}
	got, err := e.Decode(c, 'x', n)
	require.NoError(t, err)
	require.Equal(t, bits(want), bits(got), "restored state")
}

func TestTinyConcurrent(t *testing.T) {
	e := lookup(t, model.TinyHybrid)
	const reqs = 4
	a := newArenas(t, e.Spec(), 4*reqs, reqs)
	want := make([][]float32, reqs)
	for i := range reqs {
		l, err := e.Prefill(a.cache(mambacache.Row(i), blockRange(4*i, 4)...), prompt(50, byte(i)))
		require.NoError(t, err)
		want[i] = l
	}
	got := make([][]float32, reqs)
	errs := make([]error, reqs)
	var wg sync.WaitGroup
	for i := range reqs {
		wg.Go(func() {
			got[i], errs[i] = e.Prefill(a.cache(mambacache.Row(i), blockRange(4*i, 4)...), prompt(50, byte(i)))
		})
	}
	wg.Wait()
	for i := range reqs {
		require.NoError(t, errs[i])
		require.Equal(t, bits(want[i]), bits(got[i]))
	}
}
