package serving

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func gaps(at []time.Duration) []float64 {
	out := make([]float64, len(at))
	prev := time.Duration(0)
	for i, a := range at {
		out[i] = (a - prev).Seconds()
		prev = a
	}
	return out
}

func meanVar(xs []float64) (mean, variance float64) {
	for _, x := range xs {
		mean += x
	}
	mean /= float64(len(xs))
	for _, x := range xs {
		variance += (x - mean) * (x - mean)
	}
	return mean, variance / float64(len(xs))
}

// The gaps have mean 1/rate and the Gamma shape burstiness: estimated by
// the method of moments (shape = mean²/variance), it is within a few percent
// of the flag; burstiness 1 is a Poisson process (P(gap > mean) = 1/e).
func TestArrivalsGapDistribution(t *testing.T) {
	const n = 40000
	for _, tc := range []struct {
		rate, burstiness float64
	}{
		{rate: 10, burstiness: 1},
		{rate: 3.5, burstiness: 0.25},
		{rate: 100, burstiness: 0.5},
		{rate: 1, burstiness: 2},
		{rate: 50, burstiness: 8},
	} {
		at := Arrivals(n, tc.rate, tc.burstiness, rand.New(rand.NewPCG(7, uint64(tc.burstiness*100))))
		require.Len(t, at, n)
		g := gaps(at)
		for i, x := range g {
			require.GreaterOrEqual(t, x, 0.0, "gap %d", i)
		}
		mean, variance := meanVar(g)
		require.InEpsilon(t, 1/tc.rate, mean, 1e-6, "mean gap, rate %v", tc.rate)
		shape := mean * mean / variance
		require.InEpsilon(t, tc.burstiness, shape, 0.06, "Gamma shape, burstiness %v", tc.burstiness)
		if tc.burstiness == 1 {
			over := 0
			for _, x := range g {
				if x > mean {
					over++
				}
			}
			require.InDelta(t, 1/math.E, float64(over)/n, 0.01, "exponential tail")
		}
	}
}

// The last arrival lands at n/rate (vLLM's rescaling), and the offsets grow.
func TestArrivalsLastAtNOverRate(t *testing.T) {
	for _, tc := range []struct {
		n                int
		rate, burstiness float64
	}{
		{1, 2, 1}, {10, 4, 1}, {1000, 20, 0.3}, {7, 0.5, 5},
	} {
		at := Arrivals(tc.n, tc.rate, tc.burstiness, rand.New(rand.NewPCG(1, 2)))
		want := time.Duration(float64(tc.n) / tc.rate * float64(time.Second))
		require.InDelta(t, float64(want), float64(at[len(at)-1]), float64(time.Microsecond))
		for i := 1; i < len(at); i++ {
			require.GreaterOrEqual(t, at[i], at[i-1])
		}
	}
}

func TestArrivalsSpecialRates(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	require.Equal(t, make([]time.Duration, 5), Arrivals(5, math.Inf(1), 1, rng), "inf rate: all at once")
	require.Empty(t, Arrivals(0, 3, 1, rng))
	at := Arrivals(4, 4, math.Inf(1), rng) // constant gaps
	require.Equal(t, []time.Duration{250 * time.Millisecond, 500 * time.Millisecond, 750 * time.Millisecond, time.Second}, at)
	require.Panics(t, func() { Arrivals(1, 0, 1, rng) })
	require.Panics(t, func() { Arrivals(1, 1, 0, rng) })
	require.Panics(t, func() { Arrivals(1, math.NaN(), 1, rng) })
}

func TestArrivalsDeterministic(t *testing.T) {
	a := Arrivals(100, 5, 0.7, rand.New(rand.NewPCG(42, 2)))
	b := Arrivals(100, 5, 0.7, rand.New(rand.NewPCG(42, 2)))
	c := Arrivals(100, 5, 0.7, rand.New(rand.NewPCG(43, 2)))
	require.Equal(t, a, b)
	require.NotEqual(t, a, c)
}

// Gamma has mean kθ and variance kθ², below and above shape 1.
func TestGammaMoments(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	const n = 100000
	for _, tc := range []struct{ shape, scale float64 }{{0.2, 1}, {0.5, 3}, {1, 0.1}, {2.5, 2}, {30, 0.5}} {
		xs := make([]float64, n)
		for i := range xs {
			xs[i] = Gamma(rng, tc.shape, tc.scale)
			require.GreaterOrEqual(t, xs[i], 0.0)
		}
		mean, variance := meanVar(xs)
		require.InEpsilon(t, tc.shape*tc.scale, mean, 0.03, "mean, shape %v", tc.shape)
		require.InEpsilon(t, tc.shape*tc.scale*tc.scale, variance, 0.08, "variance, shape %v", tc.shape)
	}
}
