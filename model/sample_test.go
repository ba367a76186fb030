package model_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

func TestSampleGreedy(t *testing.T) {
	nan := float32(math.NaN())
	inf := float32(math.Inf(1))
	cases := []struct {
		name   string
		logits []float32
		want   int32
	}{
		{"empty", nil, -1},
		{"single", []float32{-3}, 0},
		{"max", []float32{1, 5, 2}, 1},
		{"tie lowest", []float32{1, 5, 5, 2}, 1},
		{"negative", []float32{-9, -2, -4}, 1},
		{"nan skipped", []float32{nan, 1, nan, 3}, 3},
		{"all nan", []float32{nan, nan}, -1},
		{"inf", []float32{1, inf, 3}, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, temp := range []float64{0, -1, math.NaN()} {
				require.Equal(t, tc.want, model.Sample(tc.logits, temp, 42, 3))
			}
		})
	}
	// +Inf wins and NaN is never chosen at any temperature; all -Inf is greedy.
	ninf := float32(math.Inf(-1))
	for step := range 100 {
		require.Equal(t, int32(0), model.Sample([]float32{ninf, ninf}, 1, 7, step))
		tok := model.Sample([]float32{ninf, 2, nan, 1}, math.Inf(1), 7, step)
		require.True(t, tok == 1 || tok == 3, "infinite temperature draws among finite logits: %d", tok)
		require.Equal(t, int32(1), model.Sample([]float32{1, inf, 3}, 1, 7, step))
		require.Equal(t, int32(1), model.Sample([]float32{nan, 0, nan}, 1, 7, step))
	}
}

func TestSampleDeterministic(t *testing.T) {
	logits := make([]float32, model.ByteVocab)
	for i := range logits {
		logits[i] = float32(math.Sin(float64(i))) * 3
	}
	var draws []int32
	for step := range 200 {
		tok := model.Sample(logits, 0.8, 1234, step)
		require.Equal(t, tok, model.Sample(logits, 0.8, 1234, step))
		require.True(t, tok >= 0 && int(tok) < len(logits))
		draws = append(draws, tok)
	}
	var other []int32
	for step := range 200 {
		other = append(other, model.Sample(logits, 0.8, 1235, step))
	}
	require.NotEqual(t, draws, other, "seed changes the draws")
	distinct := map[int32]bool{}
	for _, d := range draws {
		distinct[d] = true
	}
	require.Greater(t, len(distinct), 10, "steps change the draws")
}

// Frequencies over many steps follow softmax(logits/T).
func TestSampleDistribution(t *testing.T) {
	logits := []float32{0, 1, 2, -1, float32(math.Inf(-1))}
	for _, temp := range []float64{0.5, 1, 2} {
		var z float64
		p := make([]float64, len(logits))
		for i, l := range logits {
			p[i] = math.Exp(float64(l) / temp)
			z += p[i]
		}
		const n = 40000
		counts := make([]int, len(logits))
		for step := range n {
			counts[model.Sample(logits, temp, 99, step)]++
		}
		for i := range logits {
			require.InDelta(t, p[i]/z, float64(counts[i])/n, 0.01, "temp %v token %d", temp, i)
		}
		require.Zero(t, counts[4], "-Inf is never drawn")
	}
	// A tiny temperature is greedy.
	for step := range 50 {
		require.Equal(t, int32(2), model.Sample(logits, 1e-6, 5, step))
	}
}
