package serving

import (
	"bytes"
	"encoding/json"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func keys(t *testing.T, f Fields) []string {
	t.Helper()
	b, err := json.Marshal(f)
	require.NoError(t, err)
	dec := json.NewDecoder(bytes.NewReader(b))
	var out []string
	tok, err := dec.Token()
	require.NoError(t, err)
	require.Equal(t, json.Delim('{'), tok)
	for dec.More() {
		k, err := dec.Token()
		require.NoError(t, err)
		out = append(out, k.(string))
		var skip json.RawMessage
		require.NoError(t, dec.Decode(&skip))
	}
	return out
}

// The report carries vLLM's keys, in vLLM's order, for the selected
// metrics and percentiles.
func TestReportKeys(t *testing.T) {
	rs := []Result{ok(0, 100*ms1, 3, 10, 5*ms1, 5*ms1)}
	h := Header{Date: time.Date(2026, 12, 1, 14, 0, 0, 0, time.UTC), ModelID: "m", Unit: UnitBytes,
		NumPrompts: 1, RequestRate: math.Inf(1), Burstiness: 1, SLO: SLO{"ttft": 1, "tpot": 2}}
	m := Compute(rs, time.Second, []float64{50, 99.9}, h.SLO)
	got := keys(t, Report(h, m, []string{"ttft", "tpot", "itl", "e2el"}, nil))
	want := []string{"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
		"request_rate", "burstiness", "max_concurrency", "partial",
		"duration", "completed", "failed", "cancelled", "not_sent", "total_input_tokens", "total_output_tokens",
		"request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
		"max_output_tokens_per_s", "max_concurrent_requests", "goodput_slo_ms", "slo_attainment"}
	for _, name := range []string{"ttft", "tpot", "itl", "e2el"} {
		want = append(want, "mean_"+name+"_ms", "median_"+name+"_ms", "std_"+name+"_ms",
			"p50_"+name+"_ms", "p99.9_"+name+"_ms")
	}
	require.Equal(t, want, got)

	detailed := keys(t, Report(h, m, []string{"ttft"}, rs))
	require.Equal(t, []string{"input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
		"queue_times", "generated_texts", "errors"}, detailed[len(detailed)-9:])
}

func TestReportValues(t *testing.T) {
	rs := []Result{ok(0, 100*ms1, 3, 10, 5*ms1, 5*ms1), {Error: "HTTP 500"}}
	h := Header{Date: time.Date(2026, 12, 1, 14, 0, 0, 0, time.UTC), ModelID: "m", NumPrompts: 3,
		RequestRate: math.Inf(1), Burstiness: math.Inf(1), Partial: true, NotSent: 1, MaxConcurrency: 0}
	m := Compute(rs, 2*time.Second, []float64{99}, nil)
	b, err := json.Marshal(Report(h, m, []string{"ttft"}, rs))
	require.NoError(t, err)
	var v map[string]any
	require.NoError(t, json.Unmarshal(b, &v))
	require.Equal(t, "20261201-140000", v["date"])
	require.Equal(t, "inf", v["request_rate"])
	require.Equal(t, "inf", v["burstiness"])
	require.Nil(t, v["max_concurrency"])
	require.Nil(t, v["request_goodput"], "null without --goodput, as vLLM")
	require.NotContains(t, v, "slo_attainment")
	require.Equal(t, true, v["partial"])
	require.EqualValues(t, 1, v["not_sent"])
	require.EqualValues(t, 1, v["completed"])
	require.EqualValues(t, 1, v["failed"])
	require.EqualValues(t, 2, v["duration"])
	require.EqualValues(t, 100, v["p99_ttft_ms"])
	require.Equal(t, []any{0.1, 0.0}, v["ttfts"], "seconds, as vLLM")
	require.Equal(t, []any{10.0, 0.0}, v["input_lens"])
	require.Equal(t, []any{3.0, 0.0}, v["output_lens"])
	require.Equal(t, []any{"", "HTTP 500"}, v["errors"])
	require.Equal(t, []any{[]any{0.005, 0.005}, []any{}}, v["itls"])
}

// With --max-concurrency, vLLM adds the client-side wait; at a finite
// rate also the E2EL including it.
func TestReportClientQueue(t *testing.T) {
	r := ok(0, 100*ms1, 1, 1)
	r.QueueTime = 40 * ms1
	m := Compute([]Result{r}, time.Second, []float64{99}, nil)
	h := Header{RequestRate: 2, Burstiness: 1, MaxConcurrency: 1}
	got := keys(t, Report(h, m, []string{"ttft"}, nil))
	require.Equal(t, []string{"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
		"mean_client_queue_time_ms", "median_client_queue_time_ms", "std_client_queue_time_ms", "p99_client_queue_time_ms",
		"mean_e2el_including_client_queue_ms", "median_e2el_including_client_queue_ms",
		"std_e2el_including_client_queue_ms", "p99_e2el_including_client_queue_ms"}, got[len(got)-12:])
	require.InDelta(t, 40, m.ClientQueue.Mean, 1e-9)
	require.InDelta(t, 140, m.E2ELWithQueue.Mean, 1e-9)
	var b strings.Builder
	require.NoError(t, WriteTable(&b, h, m, []string{"ttft"}))
	require.Contains(t, b.String(), "---------------Client-side Queueing---------------\n")
	require.Contains(t, b.String(), "Mean E2EL incl. Client Queue (ms):       140.00")

	h.MaxConcurrency = 0
	require.NotContains(t, keys(t, Report(h, m, []string{"ttft"}, nil)), "mean_client_queue_time_ms")
}

func TestWriteTable(t *testing.T) {
	rs := []Result{ok(0, 100*ms1, 3, 10, 5*ms1, 5*ms1)}
	h := Header{RequestRate: 4, MaxConcurrency: 8, SLO: SLO{"ttft": 200}, Partial: true, NotSent: 2}
	m := Compute(rs, time.Second, []float64{90}, h.SLO)
	var b strings.Builder
	require.NoError(t, WriteTable(&b, h, m, []string{"ttft", "e2el"}))
	out := b.String()
	for _, line := range []string{
		"============ Serving Benchmark Result ============\n",
		"PARTIAL (interrupted):                   0 cancelled, 2 not sent\n",
		"Successful requests:                     1         \n",
		"Maximum request concurrency:             8         \n",
		"Request rate configured (RPS):           4.00      \n",
		"Request goodput (req/s):                 1.00      \n",
		"---------------Time to First Token----------------\n",
		"P90 TTFT (ms):                           100.00    \n",
		"----------------End-to-end Latency----------------\n",
		"Mean E2EL (ms):                          110.00    \n",
	} {
		require.Contains(t, out, line)
	}
	require.NotContains(t, out, "TPOT")
}
