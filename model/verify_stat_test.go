package model

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestVerifySamplingKeepsDistribution tests statistically, on a 5-token
// vocabulary, that verification by sampling (Accepted: keep the draft when
// the token sampled with the request's seed at that step equals it) is the
// rejection-sampling rule for a point-mass drafter: the draft d is kept
// with probability p(d) (min(1, p/q) with q(d) = 1), a rejected step
// yields a token distributed as (p - q)+ normalised, i.e. p restricted to
// the other tokens, and so the token a verification yields is distributed
// as p: a chi-square test at the 0.1 % level, over 20000 seeds, for every
// draft and two temperatures. An Accepted that kept drafts the sample did
// not confirm, or a Sample off its distribution, fails it.
func TestVerifySamplingKeepsDistribution(t *testing.T) {
	logits := []float32{1.5, 0.2, -0.7, 0.9, 0}
	const n = 20000
	for _, temp := range []float64{1, 0.6} {
		p := probs(logits, temp)
		for d := int32(0); d < int32(len(logits)); d++ {
			counts := make([]float64, len(logits))
			rejected := make([]float64, len(logits))
			accepted := 0.0
			for seed := range uint64(n) {
				target := Sample(logits, temp, seed, 3)
				a := Accepted([]int32{d}, []int32{target})
				var out int32
				if a == 1 {
					out = d // the draft, kept
					accepted++
				} else {
					out = target // the model's own token where the draft failed
					rejected[out]++
				}
				counts[out]++
			}
			require.Zero(t, rejected[d], "a rejected draft is never the yielded token")
			require.InDelta(t, p[d], accepted/n, 4*math.Sqrt(p[d]*(1-p[d])/n), "acceptance rate is p(d), temp %v d %d", temp, d)
			require.Less(t, chiSquare(counts, p, n), 18.47, "the yielded token ~ p, temp %v d %d (chi2 df 4, 0.1 %%)", temp, d)
			// The rejected tokens follow (p - q)+ normalised: p without d.
			resid := make([]float64, len(p))
			for i := range p {
				if int32(i) != d {
					resid[i] = p[i] / (1 - p[d])
				}
			}
			var nr float64
			for _, c := range rejected {
				nr += c
			}
			require.Less(t, chiSquare(rejected, resid, nr), 16.27, "rejections ~ (p-q)+, temp %v d %d (chi2 df 3, 0.1 %%)", temp, d)
		}
	}
}

func probs(logits []float32, temp float64) []float64 {
	p := make([]float64, len(logits))
	var sum float64
	for i, l := range logits {
		p[i] = math.Exp(float64(l) / temp)
		sum += p[i]
	}
	for i := range p {
		p[i] /= sum
	}
	return p
}

func chiSquare(counts, p []float64, n float64) float64 {
	var x float64
	for i, c := range counts {
		if p[i] == 0 {
			continue
		}
		e := p[i] * n
		x += (c - e) * (c - e) / e
	}
	return x
}
