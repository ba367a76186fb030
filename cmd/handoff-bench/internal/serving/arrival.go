package serving

import (
	"math"
	"math/rand/v2"
	"time"
)

// Arrivals returns the send times of n requests, as offsets from the start of
// the run, the way vLLM's get_request computes them:
//
//   - rate = +Inf: every request at offset 0 (all sent at once);
//   - burstiness = +Inf: a constant gap of 1/rate;
//   - otherwise each gap is drawn from a Gamma distribution with shape
//     burstiness and scale 1/(rate·burstiness), so its mean is 1/rate and its
//     coefficient of variation 1/sqrt(burstiness): 1 is a Poisson process,
//     below 1 burstier, above 1 more regular.
//
// The first request, too, waits one gap. The cumulative offsets are then
// rescaled so that the last one lands exactly at n/rate, which removes the
// 1-2 % run-to-run spread of the total and keeps the shape of the gaps.
// Arrivals panics when rate or burstiness is not positive or n is negative:
// the flags are validated before.
func Arrivals(n int, rate, burstiness float64, rng *rand.Rand) []time.Duration {
	if n < 0 || !(rate > 0) || !(burstiness > 0) {
		panic("serving: Arrivals needs n >= 0, rate > 0 and burstiness > 0")
	}
	out := make([]time.Duration, n)
	if n == 0 || math.IsInf(rate, 1) {
		return out
	}
	at := make([]float64, n) // seconds
	sum := 0.0
	for i := range at {
		gap := 1 / rate
		if !math.IsInf(burstiness, 1) {
			gap = Gamma(rng, burstiness, 1/(rate*burstiness))
		}
		sum += gap
		at[i] = sum
	}
	scale := 1.0
	if sum > 0 {
		scale = float64(n) / rate / sum
	}
	for i, s := range at {
		out[i] = time.Duration(s * scale * float64(time.Second))
	}
	return out
}

// Gamma draws from the Gamma distribution with the given shape k > 0 and
// scale θ > 0 (mean kθ, variance kθ²), by Marsaglia and Tsang's method ("A
// simple method for generating gamma variables", ACM TOMS 26(3), 2000); a
// shape below 1 is drawn as Gamma(k+1)·U^(1/k).
func Gamma(rng *rand.Rand, shape, scale float64) float64 {
	if shape < 1 {
		u := rng.Float64()
		for u == 0 {
			u = rng.Float64()
		}
		return Gamma(rng, shape+1, scale) * math.Pow(u, 1/shape)
	}
	d := shape - 1.0/3
	c := 1 / math.Sqrt(9*d)
	for {
		x := rng.NormFloat64()
		v := 1 + c*x
		if v <= 0 {
			continue
		}
		v = v * v * v
		u := rng.Float64()
		if u < 1-0.0331*x*x*x*x {
			return d * v * scale
		}
		if u > 0 && math.Log(u) < 0.5*x*x+d*(1-v+math.Log(v)) {
			return d * v * scale
		}
	}
}
