package serving

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Result is one request as the benchmark saw it.
type Result struct {
	Success bool
	// Cancelled marks a request the benchmark itself stopped (Ctrl-C): it
	// is neither completed nor failed and counts in no metric.
	Cancelled    bool
	PromptLen    int           // usage.prompt_tokens, else the intended length
	OutputTokens int           // usage.completion_tokens, else the token chunks seen
	Start        time.Duration // when the POST was sent, from the start of the run
	QueueTime    time.Duration // waiting for a --max-concurrency slot before the POST
	TTFT         time.Duration // POST to the first token chunk
	Latency      time.Duration // E2EL: POST to the last token chunk
	ITL          []time.Duration
	Text         string
	Error        string
}

// TPOT returns (E2EL − TTFT)/(output tokens − 1), or 0 with ok false when
// the request has at most one output token.
func (r Result) TPOT() (tpot time.Duration, ok bool) {
	if r.OutputTokens <= 1 {
		return 0, false
	}
	return (r.Latency - r.TTFT) / time.Duration(r.OutputTokens-1), true
}

// SLO is a set of per-request latency objectives, the --goodput flag:
// metric name (ttft, tpot, e2el) to milliseconds.
type SLO map[string]float64

// SLOMetrics are the names an SLO may use, in vLLM's order.
var SLOMetrics = []string{"ttft", "tpot", "e2el"}

// ParseSLO parses "ttft:MS tpot:MS e2el:MS" (any subset, space- or
// comma-separated, as vLLM's --goodput KEY:VALUE pairs).
func ParseSLO(s string) (SLO, error) {
	slo := SLO{}
	for _, kv := range strings.FieldsFunc(s, func(r rune) bool { return r == ' ' || r == ',' }) {
		k, v, ok := strings.Cut(kv, ":")
		if !ok {
			return nil, fmt.Errorf("serving: goodput %q: want KEY:MS, KEY one of %v", kv, SLOMetrics)
		}
		if !slices.Contains(SLOMetrics, k) {
			return nil, fmt.Errorf("serving: goodput metric %q: want one of %v", k, SLOMetrics)
		}
		ms, err := strconv.ParseFloat(v, 64)
		if err != nil || ms < 0 || math.IsNaN(ms) || math.IsInf(ms, 0) {
			return nil, fmt.Errorf("serving: goodput %s: %q is not a non-negative number of milliseconds", k, v)
		}
		slo[k] = ms
	}
	return slo, nil
}

// Meets reports whether a completed request meets every objective of s.
// TPOT counts as 0 for a request with at most one output token, as vLLM
// counts it for goodput.
func (s SLO) Meets(r Result) bool {
	if !r.Success {
		return false
	}
	tpot, _ := r.TPOT()
	for k, limit := range s {
		var v time.Duration
		switch k {
		case "ttft":
			v = r.TTFT
		case "tpot":
			v = tpot
		case "e2el":
			v = r.Latency
		}
		if ms(v) > limit {
			return false
		}
	}
	return true
}

// Stats are a metric's summary in milliseconds: numpy's mean, median and
// population standard deviation, and linear-interpolated percentiles (all 0
// when there is no sample, as vLLM reports them).
type Stats struct {
	Mean, Median, Std float64
	Percentiles       []Percentile
}

// Percentile is one requested percentile of a metric.
type Percentile struct {
	P     float64 // 0..100
	Value float64 // milliseconds
}

// Metrics is a run's summary.
type Metrics struct {
	Completed, Failed, Cancelled int
	TotalInput, TotalOutput      int
	Duration                     time.Duration

	RequestThroughput    float64 // completed requests per second
	RequestGoodput       float64 // completed requests meeting the SLO per second
	OutputThroughput     float64 // output tokens per second
	TotalTokenThroughput float64 // input + output tokens per second

	// SLOAttainment is DistServe's: the share of the finished requests
	// (completed + failed) that completed and met every objective of the SLO;
	// NaN without an SLO or without a finished request.
	SLOAttainment float64

	// MaxOutputTokensPerS and MaxConcurrentRequests are vLLM's peaks: token
	// chunks landing in the busiest one-second bucket from the first POST, and
	// the most requests in flight at once (half-open [start, start+E2EL)).
	MaxOutputTokensPerS   float64
	MaxConcurrentRequests int

	TTFT, TPOT, ITL, E2EL Stats

	// ClientQueue is the wait of completed requests for a --max-concurrency
	// slot, and E2ELWithQueue their E2EL with it, as vLLM reports them
	// (client_queue_time, e2el_including_client_queue).
	ClientQueue, E2ELWithQueue Stats

	samples map[string][]float64 // sorted, milliseconds
}

// Compute summarizes results (in the order they were sent) over a run of
// length dur, with the given percentiles (0..100) for every metric and the
// SLO for goodput and attainment (nil for none).
func Compute(results []Result, dur time.Duration, percentiles []float64, slo SLO) Metrics {
	m := Metrics{Duration: dur, SLOAttainment: math.NaN(), samples: map[string][]float64{}}
	var ttft, tpot, itl, e2el, queue, e2elQueue []float64
	good := 0
	for _, r := range results {
		switch {
		case r.Cancelled:
			m.Cancelled++
			continue
		case !r.Success:
			m.Failed++
			continue
		}
		m.Completed++
		m.TotalInput += r.PromptLen
		m.TotalOutput += r.OutputTokens
		ttft = append(ttft, ms(r.TTFT))
		e2el = append(e2el, ms(r.Latency))
		queue = append(queue, ms(r.QueueTime))
		e2elQueue = append(e2elQueue, ms(r.Latency+r.QueueTime))
		if t, ok := r.TPOT(); ok {
			tpot = append(tpot, ms(t))
		}
		for _, d := range r.ITL {
			itl = append(itl, ms(d))
		}
		if len(slo) > 0 && slo.Meets(r) {
			good++
		}
	}
	if s := dur.Seconds(); s > 0 {
		m.RequestThroughput = float64(m.Completed) / s
		m.RequestGoodput = float64(good) / s
		m.OutputThroughput = float64(m.TotalOutput) / s
		m.TotalTokenThroughput = float64(m.TotalInput+m.TotalOutput) / s
	}
	if finished := m.Completed + m.Failed; len(slo) > 0 && finished > 0 {
		m.SLOAttainment = float64(good) / float64(finished)
	}
	for name, xs := range map[string][]float64{"ttft": ttft, "tpot": tpot, "itl": itl, "e2el": e2el,
		"client_queue_time": queue, "e2el_including_client_queue": e2elQueue} {
		slices.Sort(xs)
		m.samples[name] = xs
	}
	m.TTFT = summarize(m.samples["ttft"], percentiles)
	m.TPOT = summarize(m.samples["tpot"], percentiles)
	m.ITL = summarize(m.samples["itl"], percentiles)
	m.E2EL = summarize(m.samples["e2el"], percentiles)
	m.ClientQueue = summarize(m.samples["client_queue_time"], percentiles)
	m.E2ELWithQueue = summarize(m.samples["e2el_including_client_queue"], percentiles)
	m.MaxOutputTokensPerS, m.MaxConcurrentRequests = peaks(results)
	return m
}

// Stat returns the stats of metric name (ttft, tpot, itl, e2el,
// client_queue_time, e2el_including_client_queue).
func (m Metrics) Stat(name string) Stats {
	switch name {
	case "ttft":
		return m.TTFT
	case "tpot":
		return m.TPOT
	case "itl":
		return m.ITL
	case "client_queue_time":
		return m.ClientQueue
	case "e2el_including_client_queue":
		return m.E2ELWithQueue
	default:
		return m.E2EL
	}
}

// PercentileOf returns percentile p of metric name in milliseconds, 0 when
// it has no sample.
func (m Metrics) PercentileOf(name string, p float64) float64 {
	return PercentileSorted(m.samples[name], p)
}

func summarize(sorted []float64, percentiles []float64) Stats {
	s := Stats{Median: PercentileSorted(sorted, 50)}
	if n := len(sorted); n > 0 {
		sum := 0.0
		for _, x := range sorted {
			sum += x
		}
		s.Mean = sum / float64(n)
		v := 0.0
		for _, x := range sorted {
			v += (x - s.Mean) * (x - s.Mean)
		}
		s.Std = math.Sqrt(v / float64(n))
	}
	for _, p := range percentiles {
		s.Percentiles = append(s.Percentiles, Percentile{P: p, Value: PercentileSorted(sorted, p)})
	}
	return s
}

// PercentileSorted is numpy.percentile's default (linear) method over a
// sorted sample: the value at rank p/100·(n−1), interpolated between the
// neighbouring samples; 0 for an empty sample.
func PercentileSorted(sorted []float64, p float64) float64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	rank := p / 100 * float64(n-1)
	lo := int(math.Floor(rank))
	if lo >= n-1 {
		return sorted[n-1]
	}
	if lo < 0 {
		return sorted[0]
	}
	frac := rank - float64(lo)
	return sorted[lo] + frac*(sorted[lo+1]-sorted[lo])
}

// peaks computes vLLM's max_output_tokens_per_s and max_concurrent_requests
// over the completed requests.
func peaks(results []Result) (tokensPerS float64, concurrent int) {
	var done []Result
	for _, r := range results {
		if r.Success {
			done = append(done, r)
		}
	}
	if len(done) == 0 {
		return 0, 0
	}
	first, last := done[0].Start, done[0].Start+done[0].Latency
	for _, r := range done {
		first = min(first, r.Start)
		last = max(last, r.Start+r.Latency)
	}
	buckets := make([]float64, int(math.Ceil((last-first).Seconds()))+1)
	type event struct {
		at    time.Duration
		delta int
	}
	events := make([]event, 0, 2*len(done))
	for _, r := range done {
		t := r.Start + r.TTFT
		add := func(t time.Duration) {
			if b := int((t - first).Seconds()); b >= 0 && b < len(buckets) {
				buckets[b]++
			}
		}
		add(t)
		for _, d := range r.ITL {
			t += d
			add(t)
		}
		events = append(events, event{r.Start, +1}, event{r.Start + r.Latency, -1})
	}
	slices.SortFunc(events, func(a, b event) int {
		if c := cmp.Compare(a.at, b.at); c != 0 {
			return c
		}
		return cmp.Compare(a.delta, b.delta) // a departure before an arrival at the same instant
	})
	cur := 0
	for _, e := range events {
		cur += e.delta
		concurrent = max(concurrent, cur)
	}
	return slices.Max(buckets), concurrent
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
