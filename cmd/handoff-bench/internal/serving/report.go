package serving

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"time"
)

// Header describes a run: vLLM's header fields and handoff-bench's own.
type Header struct {
	Date           time.Time
	Label          string
	ModelID        string
	Unit           Unit // how prompts were made (tokenizer_id in the report)
	NumPrompts     int
	RequestRate    float64 // +Inf: all at once
	Burstiness     float64
	MaxConcurrency int // 0: no limit
	SLO            SLO
	// Partial marks a run stopped before every request finished (Ctrl-C):
	// its metrics cover the requests that finished before the stop.
	Partial bool
	NotSent int // requests never sent because the run stopped
}

// Field is one member of an ordered JSON object.
type Field struct {
	Key   string
	Value any
}

// Fields is a JSON object that keeps its members in order, so reports read
// as vLLM's do: the header first, then the totals, then each metric.
type Fields []Field

// MarshalJSON writes the members in order.
func (f Fields) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, kv := range f {
		if i > 0 {
			b.WriteByte(',')
		}
		k, err := json.Marshal(kv.Key)
		if err != nil {
			return nil, err
		}
		v, err := json.Marshal(kv.Value)
		if err != nil {
			return nil, fmt.Errorf("serving: report field %s: %w", kv.Key, err)
		}
		b.Write(k)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// Get returns the value of key, and whether it is there.
func (f Fields) Get(key string) (any, bool) {
	for _, kv := range f {
		if kv.Key == key {
			return kv.Value, true
		}
	}
	return nil, false
}

// PercentileKey is vLLM's key for percentile p of metric name: p99_ttft_ms,
// p99.9_itl_ms.
func PercentileKey(p float64, name string) string {
	return "p" + strconv.FormatFloat(p, 'f', -1, 64) + "_" + name + "_ms"
}

// Report returns the run's JSON report with vLLM's keys: the header, the
// totals and throughputs, then mean_, median_, std_ and pNN_ of each selected
// metric (ttft, tpot, itl, e2el). With detailed results it adds vLLM's
// per-request arrays (seconds, in the order sent).
func Report(h Header, m Metrics, selected []string, detailed []Result) Fields {
	rate := any(h.RequestRate)
	if math.IsInf(h.RequestRate, 1) {
		rate = "inf"
	}
	burst := any(h.Burstiness)
	if math.IsInf(h.Burstiness, 1) {
		burst = "inf"
	}
	var maxConc any
	if h.MaxConcurrency > 0 {
		maxConc = h.MaxConcurrency
	}
	var goodput any
	if len(h.SLO) > 0 {
		goodput = m.RequestGoodput
	}
	f := Fields{
		{"date", h.Date.Format("20060102-150405")},
		{"endpoint_type", "openai"},
		{"backend", "openai"},
		{"label", h.Label},
		{"model_id", h.ModelID},
		{"tokenizer_id", "handoff-bench:" + string(h.Unit)},
		{"num_prompts", h.NumPrompts},
		{"request_rate", rate},
		{"burstiness", burst},
		{"max_concurrency", maxConc},
		{"partial", h.Partial},
		{"duration", m.Duration.Seconds()},
		{"completed", m.Completed},
		{"failed", m.Failed},
		{"cancelled", m.Cancelled},
		{"not_sent", h.NotSent},
		{"total_input_tokens", m.TotalInput},
		{"total_output_tokens", m.TotalOutput},
		{"request_throughput", m.RequestThroughput},
		{"request_goodput", goodput},
		{"output_throughput", m.OutputThroughput},
		{"total_token_throughput", m.TotalTokenThroughput},
		{"max_output_tokens_per_s", m.MaxOutputTokensPerS},
		{"max_concurrent_requests", m.MaxConcurrentRequests},
	}
	if len(h.SLO) > 0 {
		slo := Fields{}
		for _, k := range SLOMetrics {
			if v, ok := h.SLO[k]; ok {
				slo = append(slo, Field{k, v})
			}
		}
		f = append(f, Field{"goodput_slo_ms", slo})
		if !math.IsNaN(m.SLOAttainment) {
			f = append(f, Field{"slo_attainment", m.SLOAttainment})
		}
	}
	for _, name := range withQueue(h, selected) {
		s := m.Stat(name)
		f = append(f,
			Field{"mean_" + name + "_ms", s.Mean},
			Field{"median_" + name + "_ms", s.Median},
			Field{"std_" + name + "_ms", s.Std})
		for _, p := range s.Percentiles {
			f = append(f, Field{PercentileKey(p.P, name), p.Value})
		}
	}
	if detailed != nil {
		f = append(f, detail(detailed)...)
	}
	return f
}

func detail(rs []Result) Fields {
	n := len(rs)
	in, out := make([]int, n), make([]int, n)
	ttfts, lat, start, queue := make([]float64, n), make([]float64, n), make([]float64, n), make([]float64, n)
	itls := make([][]float64, n)
	texts, errs := make([]string, n), make([]string, n)
	for i, r := range rs {
		in[i] = r.PromptLen
		if r.Success {
			out[i] = r.OutputTokens
		}
		ttfts[i], lat[i] = r.TTFT.Seconds(), r.Latency.Seconds()
		start[i], queue[i] = r.Start.Seconds(), r.QueueTime.Seconds()
		itls[i] = make([]float64, len(r.ITL))
		for j, d := range r.ITL {
			itls[i][j] = d.Seconds()
		}
		texts[i], errs[i] = r.Text, r.Error
	}
	return Fields{
		{"input_lens", in}, {"output_lens", out}, {"ttfts", ttfts}, {"itls", itls},
		{"latencies", lat}, {"start_times", start}, {"queue_times", queue},
		{"generated_texts", texts}, {"errors", errs},
	}
}

// withQueue adds to the selected metrics the two vLLM reports of the wait
// for a --max-concurrency slot: client_queue_time when there is a limit,
// and e2el_including_client_queue when the rate is finite too.
func withQueue(h Header, selected []string) []string {
	if h.MaxConcurrency <= 0 {
		return selected
	}
	out := append(selected[:len(selected):len(selected)], "client_queue_time")
	if !math.IsInf(h.RequestRate, 1) {
		out = append(out, "e2el_including_client_queue")
	}
	return out
}

// metricTitles are vLLM's table headings.
var metricTitles = map[string][2]string{
	"ttft":                        {"TTFT", "Time to First Token"},
	"tpot":                        {"TPOT", "Time per Output Token (excl. 1st token)"},
	"itl":                         {"ITL", "Inter-token Latency"},
	"e2el":                        {"E2EL", "End-to-end Latency"},
	"client_queue_time":           {"Client Queue Time", "Client-side Queueing"},
	"e2el_including_client_queue": {"E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"},
}

// WriteTable prints the report as vLLM prints its result table.
func WriteTable(w io.Writer, h Header, m Metrics, selected []string) error {
	var b strings.Builder
	center := func(s string, c byte) {
		pad := 50 - len(s)
		if pad < 0 {
			pad = 0
		}
		b.WriteString(strings.Repeat(string(c), pad/2) + s + strings.Repeat(string(c), pad-pad/2) + "\n")
	}
	line := func(k string, v any) {
		if f, ok := v.(float64); ok {
			v = strconv.FormatFloat(f, 'f', 2, 64)
		}
		fmt.Fprintf(&b, "%-40s %-10v\n", k, v)
	}
	center(" Serving Benchmark Result ", '=')
	if h.Partial {
		line("PARTIAL (interrupted):", fmt.Sprintf("%d cancelled, %d not sent", m.Cancelled, h.NotSent))
	}
	line("Successful requests:", m.Completed)
	line("Failed requests:", m.Failed)
	if h.MaxConcurrency > 0 {
		line("Maximum request concurrency:", h.MaxConcurrency)
	}
	if !math.IsInf(h.RequestRate, 1) {
		line("Request rate configured (RPS):", h.RequestRate)
	}
	line("Benchmark duration (s):", m.Duration.Seconds())
	line("Total input tokens:", m.TotalInput)
	line("Total generated tokens:", m.TotalOutput)
	line("Request throughput (req/s):", m.RequestThroughput)
	if len(h.SLO) > 0 {
		line("Request goodput (req/s):", m.RequestGoodput)
		if !math.IsNaN(m.SLOAttainment) {
			line("SLO attainment (%):", 100*m.SLOAttainment)
		}
	}
	line("Output token throughput (tok/s):", m.OutputThroughput)
	line("Peak output token throughput (tok/s):", m.MaxOutputTokensPerS)
	line("Peak concurrent requests:", float64(m.MaxConcurrentRequests))
	line("Total token throughput (tok/s):", m.TotalTokenThroughput)
	for _, name := range withQueue(h, selected) {
		t := metricTitles[name]
		s := m.Stat(name)
		center(t[1], '-')
		line("Mean "+t[0]+" (ms):", s.Mean)
		line("Median "+t[0]+" (ms):", s.Median)
		for _, p := range s.Percentiles {
			line("P"+strconv.FormatFloat(p.P, 'f', -1, 64)+" "+t[0]+" (ms):", p.Value)
		}
	}
	b.WriteString(strings.Repeat("=", 50) + "\n")
	_, err := io.WriteString(w, b.String())
	return err
}
