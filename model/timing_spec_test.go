package model

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestVerifyStepTime: at low batch a verification of K+1 positions costs
// about one decode step (memory-bound: the weights are read once), with K
// per-position state rows written on top; at a large batch the positions'
// compute overtakes the weights' read, so drafting there costs more than
// the step it saves; one position each is exactly a decode step.
func TestVerifyStepTime(t *testing.T) {
	n := h200(t, NemotronH8B)
	row := float64(n.rowBytes)
	one := n.DecodeStepTime([]int{512})
	v := n.VerifyStepTime([]int{512}, []int{5})
	require.InDelta(t, (16e9+(512+5)*16384+6*row)/(0.7*4.8e12), v.Seconds(), 1e-9, "memory-bound")
	require.Less(t, v.Seconds(), 1.1*one.Seconds(), "K=4 costs about one step at batch 1")
	require.Equal(t, one, n.VerifyStepTime([]int{512}, []int{1}), "no drafts: a decode step")
	require.Equal(t, n.DecodeStepTime([]int{1, 2}), n.VerifyStepTime([]int{1, 2}, []int{1, 1}))

	ctx, toks, ones := make([]int, 256), make([]int, 256), make([]int, 256)
	for i := range ctx {
		ctx[i], toks[i], ones[i] = 1024, 5, 1
	}
	big := n.VerifyStepTime(ctx, toks)
	flops := 256 * (2*8e9*5 + 4*n.attn*5*(1024+5))
	require.InDelta(t, flops/(0.5*989e12), big.Seconds(), 1e-9, "compute-bound at batch 256")
	require.Greater(t, big.Seconds(), 2*n.VerifyStepTime(ctx, ones).Seconds())

	q := h200(t, Qwen3Next80B)
	require.Greater(t, q.VerifyStepTime([]int{0}, []int{5}), q.DecodeStepTime([]int{0}), "an MoE's drafts route to more experts")
}

func TestTimingAs(t *testing.T) {
	e, err := Lookup(TinyHybrid + "?gpu=h200&as=" + NemotronH8B)
	require.NoError(t, err)
	require.Equal(t, TinyHybrid, e.Spec().Name, "the math and the caches stay tiny-hybrid's")
	st, ok := e.(StepTimer)
	require.True(t, ok)
	require.Equal(t, h200(t, NemotronH8B).DecodeStepTime([]int{100}), st.StepTime(nil, []int{100}), "priced as nemotron-h-8b")
	_, ok = e.(VerifyTimer)
	require.True(t, ok)
	for _, bad := range []string{"?as=" + NemotronH8B, "?gpu=h200&as=" + TinyHybrid, "?gpu=h200&as=nope"} {
		_, err := Lookup(TinyHybrid + bad)
		require.ErrorIs(t, err, ErrInvalidOption, bad)
	}
	_, err = Lookup(NemotronH8B + "?gpu=h200&as=" + NemotronH8B)
	require.ErrorIs(t, err, ErrInvalidOption)
}

// TestDraftHeadTiming: a model with a draft head pays, per verification,
// one pass of the head per draft (memory-bound: its weights and the
// head's KV of each request's context) on top of the verification, whose
// own KV read is the target's layers only; a step without drafts is a
// decode step, the same as without the head. nemotron-h-8b's head is one
// attention and one MLP layer's share: 2/52 of 8B parameters, 0.62 GB of
// bf16 per pass.
func TestDraftHeadTiming(t *testing.T) {
	e, err := Lookup(TinyHybrid + "?gpu=h200&as=" + NemotronH8B + "&mtp=1")
	require.NoError(t, err)
	mt := e.(timed).Timing
	plain := h200(t, NemotronH8B)
	require.InDelta(t, 8e9*2/52, mt.draftParams, 1)
	require.Equal(t, plain.kvToken, mt.kvToken, "the target reads its four attention layers only")
	require.Equal(t, plain.kvToken/4, mt.draftKVToken, "the head reads its own layer")
	pass := (8e9*2/52*2 + 512*mt.draftKVToken) / (0.7 * 4.8e12)
	noHead := plain.VerifyStepTime([]int{512}, []int{5}).Seconds()
	withHead := mt.VerifyStepTime([]int{512}, []int{5}).Seconds()
	require.InDelta(t, noHead+4*pass, withHead, 1e-9)
	require.Less(t, withHead, 1.25*mt.DecodeStepTime([]int{512}).Seconds(), "four drafts still cost about one step")
	require.Equal(t, plain.DecodeStepTime([]int{512}), mt.DecodeStepTime([]int{512}))
	require.Equal(t, mt.DecodeStepTime([]int{512}), mt.VerifyStepTime([]int{512}, []int{1}))
	require.Equal(t, plain.SpanTime(Span{0, 300}), mt.SpanTime(Span{0, 300}), "a prefill writes the head's entries unpriced")
}
