package model_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

func TestSampleTopP(t *testing.T) {
	// Probabilities at temperature 1: about 0.64, 0.24, 0.09, 0.03.
	logits := []float32{3, 2, 1, 0}
	seen := map[int32]int{}
	for step := range 2000 {
		seen[model.SampleTopP(logits, 1, 0.7, 42, step)]++
	}
	require.Len(t, seen, 2, "top_p 0.7 keeps the two most likely tokens: %v", seen)
	require.Greater(t, seen[0], seen[1])
	for step := range 200 {
		require.Equal(t, int32(0), model.SampleTopP(logits, 1, 0.5, 7, step), "top_p 0.5 keeps only the argmax")
		require.Equal(t, model.Sample(logits, 0.8, 9, step), model.SampleTopP(logits, 0.8, 1, 9, step), "top_p 1 is Sample")
		require.Equal(t, model.Sample(logits, 0.8, 9, step), model.SampleTopP(logits, 0.8, 0, 9, step), "unset is Sample")
		require.Equal(t, model.SampleTopP(logits, 0.8, 0.9, 9, step), model.SampleTopP(logits, 0.8, 0.9, 9, step))
	}
	require.Equal(t, int32(2), model.SampleTopP([]float32{1, 2, 9}, 0, 0.1, 1, 0), "greedy ignores top_p")
	require.Equal(t, int32(-1), model.SampleTopP(nil, 1, 0.5, 1, 0))
}

func TestComputeLogprobs(t *testing.T) {
	logits := []float32{1, 3, 3, float32(math.NaN()), 0}
	lp := model.ComputeLogprobs(logits, 4, 3)
	var sum float64
	for _, l := range []float32{1, 3, 3, 0} {
		sum += math.Exp(float64(l))
	}
	require.InDelta(t, 0-math.Log(sum), float64(lp.Chosen.Logprob), 1e-5)
	require.Equal(t, int32(4), lp.Chosen.Token)
	require.Len(t, lp.Top, 3)
	require.Equal(t, []int32{1, 2, 0}, []int32{lp.Top[0].Token, lp.Top[1].Token, lp.Top[2].Token}, "most likely first, ties by index")
	require.True(t, math.IsInf(float64(model.ComputeLogprobs(logits, 3, 0).Chosen.Logprob), -1), "a NaN logit has probability 0")
	require.Empty(t, model.ComputeLogprobs(logits, 1, 0).Top)
	require.Len(t, model.ComputeLogprobs(logits, 1, 99).Top, len(logits), "clamped to the vocabulary")

	b, err := lp.MarshalBinary()
	require.NoError(t, err)
	var back model.Logprobs
	require.NoError(t, back.UnmarshalBinary(b))
	require.Equal(t, lp, back)
	require.ErrorIs(t, back.UnmarshalBinary(b[:5]), model.ErrInvalidLogprobs)
	require.ErrorIs(t, back.UnmarshalBinary(nil), model.ErrInvalidLogprobs)
}

func TestTokenLabel(t *testing.T) {
	require.Equal(t, "a", model.TokenLabel('a'))
	require.Equal(t, `bytes:\xe2`, model.TokenLabel(0xe2))
	require.Equal(t, "<|endoftext|>", model.TokenLabel(model.EOS))
	require.Equal(t, "", model.TokenText(model.EOS))
}
