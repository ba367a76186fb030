package serving

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const ms1 = time.Millisecond

// numpy.percentile(a, p) with the default linear method.
func TestPercentileSorted(t *testing.T) {
	for _, tc := range []struct {
		xs   []float64
		p    float64
		want float64
	}{
		{[]float64{1, 2, 3, 4}, 50, 2.5},
		{[]float64{1, 2, 3, 4}, 25, 1.75},
		{[]float64{1, 2, 3, 4}, 99, 3.97},
		{[]float64{1, 2, 3, 4}, 100, 4},
		{[]float64{10, 20, 30, 40, 50}, 90, 46},
		{[]float64{10, 20, 30, 40, 50}, 99.9, 49.96},
		{[]float64{7}, 99, 7},
		{nil, 99, 0},
	} {
		require.InDelta(t, tc.want, PercentileSorted(tc.xs, tc.p), 1e-9, "%v p%v", tc.xs, tc.p)
	}
}

func TestParseSLO(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want SLO
		err  bool
	}{
		{"ttft:500 tpot:50", SLO{"ttft": 500, "tpot": 50}, false},
		{"ttft:500,tpot:50,e2el:2000", SLO{"ttft": 500, "tpot": 50, "e2el": 2000}, false},
		{"tpot:12.5", SLO{"tpot": 12.5}, false},
		{"", SLO{}, false},
		{"itl:5", nil, true},
		{"ttft", nil, true},
		{"ttft:-1", nil, true},
		{"ttft:abc", nil, true},
		{"ttft:inf", nil, true},
	} {
		got, err := ParseSLO(tc.in)
		if tc.err {
			require.Error(t, err, tc.in)
			continue
		}
		require.NoError(t, err, tc.in)
		require.Equal(t, tc.want, got)
	}
}

// ok builds a completed request: TTFT, then one chunk per gap, n output tokens.
func ok(start, ttft time.Duration, n, prompt int, gaps ...time.Duration) Result {
	lat := ttft
	for _, g := range gaps {
		lat += g
	}
	return Result{Success: true, Start: start, TTFT: ttft, Latency: lat, ITL: gaps, OutputTokens: n, PromptLen: prompt}
}

// Compute follows vLLM's calculate_metrics: successful requests only;
// TPOT over requests with more than one token, but counted as 0 for
// goodput; ITL pooled; throughputs over the duration; cancelled requests
// nowhere.
func TestComputeDefinitions(t *testing.T) {
	rs := []Result{
		ok(0, 100*ms1, 4, 10, 10*ms1, 20*ms1, 30*ms1), // E2EL 160, TPOT 60/3 = 20
		ok(50*ms1, 200*ms1, 3, 20, 40*ms1, 40*ms1),    // E2EL 280, TPOT 80/2 = 40
		ok(100*ms1, 300*ms1, 1, 30),                   // one token: no TPOT sample, TPOT 0 for goodput
		{Success: false, Error: "HTTP 503", PromptLen: 40},
		{Cancelled: true, PromptLen: 50},
	}
	slo := SLO{"ttft": 250, "tpot": 30}
	m := Compute(rs, 2*time.Second, []float64{50, 99}, slo)
	require.Equal(t, 3, m.Completed)
	require.Equal(t, 1, m.Failed)
	require.Equal(t, 1, m.Cancelled)
	require.Equal(t, 60, m.TotalInput, "completed requests' prompts only")
	require.Equal(t, 8, m.TotalOutput)
	require.InDelta(t, 1.5, m.RequestThroughput, 1e-12)
	require.InDelta(t, 4, m.OutputThroughput, 1e-12)
	require.InDelta(t, 34, m.TotalTokenThroughput, 1e-12)
	// good: the first (100 ms, 20 ms); not the second (TPOT 40) nor the
	// third (TTFT 300); the failed one counts in attainment's denominator.
	require.InDelta(t, 0.5, m.RequestGoodput, 1e-12)
	require.InDelta(t, 0.25, m.SLOAttainment, 1e-12)

	require.InDelta(t, 200, m.TTFT.Mean, 1e-9)
	require.InDelta(t, 200, m.TTFT.Median, 1e-9)
	require.InDelta(t, math.Sqrt(20000.0/3), m.TTFT.Std, 1e-9)
	require.Equal(t, []Percentile{{50, 200}, {99, 298}}, m.TTFT.Percentiles)
	require.InDelta(t, 30, m.TPOT.Mean, 1e-9, "two TPOT samples: 20 and 40")
	require.InDelta(t, 10, m.TPOT.Std, 1e-9)
	require.InDelta(t, 28, m.ITL.Mean, 1e-9, "ITL pooled: 10 20 30 40 40")
	require.InDelta(t, 30, m.ITL.Median, 1e-9)
	require.InDelta(t, (160+280+300)/3.0, m.E2EL.Mean, 1e-9)
	require.InDelta(t, 40, m.PercentileOf("tpot", 100), 1e-9)
	// every request overlaps the others at 100..160 ms.
	require.Equal(t, 3, m.MaxConcurrentRequests)
	// token chunks at 100 110 130 160 | 250 290 330 | 400 ms: all in second 0.
	require.InDelta(t, 8, m.MaxOutputTokensPerS, 1e-12)
}

func TestComputeEmptyAndNoSLO(t *testing.T) {
	m := Compute(nil, 0, []float64{99}, nil)
	require.Zero(t, m.Completed)
	require.Zero(t, m.RequestThroughput)
	require.True(t, math.IsNaN(m.SLOAttainment))
	require.Equal(t, Stats{Percentiles: []Percentile{{99, 0}}}, m.TTFT)

	m = Compute([]Result{{Success: false}}, time.Second, nil, SLO{"ttft": 1})
	require.Zero(t, m.SLOAttainment, "a failed request misses the SLO")
	require.Zero(t, m.RequestGoodput)
}

// A request is in flight on [start, start+E2EL): one ending as another
// starts does not overlap it; token chunks fall in one-second buckets from
// the first POST.
func TestComputePeaks(t *testing.T) {
	rs := []Result{
		ok(0, 500*ms1, 2, 1, 500*ms1),            // [0, 1000): chunks at 500, 1000
		ok(time.Second, 100*ms1, 3, 1, ms1, ms1), // [1000, 1102): chunks at 1100, 1101, 1102
		ok(1050*ms1, 10*ms1, 1, 1),               // [1050, 1060)
	}
	m := Compute(rs, 2*time.Second, nil, nil)
	require.Equal(t, 2, m.MaxConcurrentRequests)
	require.InDelta(t, 5, m.MaxOutputTokensPerS, 1e-12, "1000, 1060, 1100, 1101, 1102 in second 1")
}

func TestSLOMeets(t *testing.T) {
	r := ok(0, 100*ms1, 3, 1, 50*ms1, 50*ms1) // TPOT 50, E2EL 200
	for _, tc := range []struct {
		slo  SLO
		want bool
	}{
		{SLO{"ttft": 100}, true},
		{SLO{"ttft": 99.9}, false},
		{SLO{"tpot": 50, "e2el": 200}, true},
		{SLO{"e2el": 199}, false},
		{SLO{}, true},
	} {
		require.Equal(t, tc.want, tc.slo.Meets(r), "%v", tc.slo)
	}
	require.False(t, SLO{}.Meets(Result{}), "a failed request meets nothing")
}
