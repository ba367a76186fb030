package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/cmd/handoff-bench/internal/serving"
	"github.com/handoff-io/handoff/internal/leakcheck"
)

// pipeNet is an in-memory network over net.Pipe: a listener for an
// http.Server and a dialer for the client, so that a test can run the whole
// benchmark inside a synctest bubble, where time is virtual and the
// scripted timings are measured exactly.
type pipeNet struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func newPipeNet() *pipeNet { return &pipeNet{conns: make(chan net.Conn), done: make(chan struct{})} }

func (p *pipeNet) Accept() (net.Conn, error) {
	select {
	case c := <-p.conns:
		return c, nil
	case <-p.done:
		return nil, net.ErrClosed
	}
}

func (p *pipeNet) Close() error { p.once.Do(func() { close(p.done) }); return nil }

func (p *pipeNet) Addr() net.Addr { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 8000} }

func (p *pipeNet) dial(ctx context.Context, _, _ string) (net.Conn, error) {
	client, server := net.Pipe()
	select {
	case p.conns <- server:
		return client, nil
	case <-p.done:
		return nil, net.ErrClosed
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// reply scripts one streamed completion.
type reply struct {
	status      int             // not 0 or 200: an OpenAI error body with this status
	ttft        time.Duration   // before the first chunk
	gaps        []time.Duration // before each further chunk
	tokens      int             // usage.completion_tokens (default: one per chunk)
	streamError bool            // an error event instead of the last chunk
	noTokens    bool            // only the end marker, after ttft, with 0 completion tokens
}

// fakeServer is a scripted OpenAI completions server.
type fakeServer struct {
	script func(idx int, body map[string]any) reply // idx: the bench request's index, -1 for others

	mu     sync.Mutex
	bodies []map[string]any
	ids    []string
}

// benchIndex returns the index of a measured request from its X-Request-Id
// ("bench-<run>-<i>"), or -1.
func benchIndex(id string) int {
	if !strings.HasPrefix(id, "bench-") {
		return -1
	}
	i, err := strconv.Atoi(id[strings.LastIndexByte(id, '-')+1:])
	if err != nil {
		return -1
	}
	return i
}

func (f *fakeServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/v1/models" {
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"fake-model","object":"model"}]}`)
		return
	}
	var body map[string]any
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	id := r.Header.Get("X-Request-Id")
	f.mu.Lock()
	f.bodies = append(f.bodies, body)
	f.ids = append(f.ids, id)
	f.mu.Unlock()
	prompt, _ := body["prompt"].(string)
	if stream, _ := body["stream"].(bool); !stream { // the token-unit probe
		_ = json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"text": "x"}},
			"usage": map[string]any{"prompt_tokens": len(prompt), "completion_tokens": 1}})
		return
	}
	rep := f.script(benchIndex(id), body)
	if rep.status != 0 && rep.status != http.StatusOK {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(rep.status)
		_, _ = io.WriteString(w, `{"error":{"message":"The server is at capacity; retry later.","type":"rate_limit_error","code":"queue_full"}}`)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	_ = rc.Flush()
	send := func(v any) {
		b, _ := json.Marshal(v)
		fmt.Fprintf(w, "data: %s\n\n", b)
		_ = rc.Flush()
	}
	chunk := func(text string, finish any) map[string]any {
		return map[string]any{"object": "text_completion", "choices": []any{map[string]any{"text": text, "index": 0, "finish_reason": finish}}}
	}
	sleep := func(d time.Duration) bool {
		select {
		case <-time.After(d):
			return true
		case <-r.Context().Done():
			return false
		}
	}
	if !sleep(rep.ttft) {
		return
	}
	if rep.noTokens {
		final := chunk("", "stop")
		final["usage"] = map[string]any{"prompt_tokens": len(prompt), "completion_tokens": 0}
		send(final)
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
		return
	}
	send(chunk("t", nil))
	for i, g := range rep.gaps {
		if !sleep(g) {
			return
		}
		if rep.streamError && i == len(rep.gaps)-1 {
			send(map[string]any{"error": map[string]any{"message": "prefill worker lost", "code": "internal_error"}})
			_, _ = io.WriteString(w, "data: [DONE]\n\n")
			return
		}
		send(chunk("t", nil))
	}
	n := rep.tokens
	if n == 0 {
		n = 1 + len(rep.gaps)
	}
	final := chunk("", "length")
	final["usage"] = map[string]any{"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
	send(final)
	_, _ = io.WriteString(w, "data: [DONE]\n\n")
}

// serveFake runs serve with args against f over a pipeNet. Call it inside a
// synctest bubble; it stops the server and the client's connections before
// it returns.
func serveFake(t *testing.T, ctx context.Context, f *fakeServer, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	o, err := parseServeFlags(append([]string{"--progress", "none"}, args...), io.Discard)
	require.NoError(t, err)
	pn := newPipeNet()
	srv := &http.Server{Handler: f}
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(pn)
	}()
	c := newServeClient(o, &http.Transport{DialContext: pn.dial, MaxIdleConnsPerHost: 1 << 10})
	var out, errOut bytes.Buffer
	err = serve(ctx, o, c, &out, &errOut, false)
	c.http.CloseIdleConnections()
	require.NoError(t, srv.Close())
	<-served
	return out.String(), errOut.String(), err
}

type jsonReport map[string]any

func decodeReport(t *testing.T, s string) jsonReport {
	t.Helper()
	var r jsonReport
	require.NoError(t, json.Unmarshal([]byte(s), &r), s)
	return r
}

func (r jsonReport) f(t *testing.T, key string) float64 {
	t.Helper()
	v, ok := r[key].(float64)
	require.True(t, ok, "%s is %v (%T)", key, r[key], r[key])
	return v
}

func (r jsonReport) floats(t *testing.T, key string) []float64 {
	t.Helper()
	raw, ok := r[key].([]any)
	require.True(t, ok, "%s is %T", key, r[key])
	out := make([]float64, len(raw))
	for i, x := range raw {
		out[i] = x.(float64)
	}
	return out
}

// Against a server with scripted timings, every metric is what vLLM's
// definitions give, to the nanosecond (time is virtual): request i starts at
// (i+1)·100 ms (rate 10, constant gaps), its first token comes after
// (i+1)·10 ms, three more after 5, 10 and 15 ms.
func TestServeMetricsScripted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &fakeServer{script: func(i int, _ map[string]any) reply {
			if i < 0 {
				return reply{ttft: time.Millisecond}
			}
			return reply{ttft: time.Duration(i+1) * 10 * time.Millisecond,
				gaps: []time.Duration{5 * time.Millisecond, 10 * time.Millisecond, 15 * time.Millisecond}}
		}}
		out, _, err := serveFake(t, t.Context(), f, "--num-prompts", "5", "--request-rate", "10", "--burstiness", "inf",
			"--random-input-len", "32", "--random-output-len", "4", "--token-unit", "bytes", "--output", "json",
			"--save-detailed", "--goodput", "ttft:30", "tpot:10", "--percentile-metrics", "ttft,tpot,itl,e2el",
			"--metric-percentiles", "50,99", "--num-warmups", "2")
		require.NoError(t, err)
		r := decodeReport(t, out)
		const eps = 1e-6
		require.Equal(t, "fake-model", r["model_id"], "the first model /v1/models lists")
		require.Equal(t, false, r["partial"])
		require.EqualValues(t, 5, r.f(t, "completed"))
		require.EqualValues(t, 0, r.f(t, "failed"))
		require.EqualValues(t, 160, r.f(t, "total_input_tokens"), "the server's prompt_tokens")
		require.EqualValues(t, 20, r.f(t, "total_output_tokens"))
		dur := 0.5 + 0.050 + 0.030 // the last request starts at 500 ms and lasts 80 ms
		require.InDelta(t, dur, r.f(t, "duration"), eps)
		require.InDelta(t, 5/dur, r.f(t, "request_throughput"), eps)
		require.InDelta(t, 3/dur, r.f(t, "request_goodput"), eps, "TTFT <= 30 ms: requests 0, 1, 2")
		require.InDelta(t, 0.6, r.f(t, "slo_attainment"), eps)
		require.InDelta(t, 20/dur, r.f(t, "output_throughput"), eps)
		require.InDelta(t, 180/dur, r.f(t, "total_token_throughput"), eps)
		require.EqualValues(t, 1, r.f(t, "max_concurrent_requests"))
		require.EqualValues(t, 20, r.f(t, "max_output_tokens_per_s"), "every chunk lands within a second of the first POST")

		require.InDelta(t, 30, r.f(t, "mean_ttft_ms"), eps)
		require.InDelta(t, 30, r.f(t, "median_ttft_ms"), eps)
		require.InDelta(t, math.Sqrt(200), r.f(t, "std_ttft_ms"), eps)
		require.InDelta(t, 49.6, r.f(t, "p99_ttft_ms"), eps)
		require.InDelta(t, 10, r.f(t, "mean_tpot_ms"), eps, "(E2EL - TTFT)/(4 - 1) = 30/3")
		require.InDelta(t, 0, r.f(t, "std_tpot_ms"), eps)
		require.InDelta(t, 10, r.f(t, "mean_itl_ms"), eps)
		require.InDelta(t, 10, r.f(t, "median_itl_ms"), eps)
		require.InDelta(t, 15, r.f(t, "p99_itl_ms"), eps)
		require.InDelta(t, 60, r.f(t, "mean_e2el_ms"), eps)
		require.InDelta(t, 79.6, r.f(t, "p99_e2el_ms"), eps, "E2EL 40..80 ms")

		starts := r.floats(t, "start_times")
		for i, s := range starts {
			require.InDelta(t, float64(i+1)*0.1, s, eps, "request %d sent on its arrival", i)
		}
		require.Equal(t, []float64{0, 0, 0, 0, 0}, r.floats(t, "queue_times"))
		require.Equal(t, []float64{0.01, 0.02, 0.03, 0.04, 0.05}, r.floats(t, "ttfts"))

		// What the server was sent: the probe-free start (--token-unit
		// bytes), one test request, two warm-ups, then the run.
		require.Len(t, f.bodies, 1+2+5)
		require.Equal(t, "test", f.ids[0])
		b := f.bodies[3]
		require.Equal(t, "fake-model", b["model"])
		require.Equal(t, true, b["stream"])
		require.Equal(t, map[string]any{"include_usage": true}, b["stream_options"])
		require.NotContains(t, b, "ignore_eos", "an unknown parameter to OpenAI's API: only with --ignore-eos")
		require.EqualValues(t, 4, b["max_tokens"])
		require.NotContains(t, b, "temperature")
		require.Len(t, b["prompt"], 32)
	})
}

// --max-concurrency holds requests before their POST; the wait is their
// queue time, not their TTFT.
func TestServeMaxConcurrency(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &fakeServer{script: func(int, map[string]any) reply { return reply{ttft: 100 * time.Millisecond} }}
		out, _, err := serveFake(t, t.Context(), f, "--num-prompts", "6", "--max-concurrency", "2",
			"--random-input-len", "8", "--random-output-len", "1", "--token-unit", "bytes", "--output", "json",
			"--save-detailed", "--percentile-metrics", "ttft")
		require.NoError(t, err)
		r := decodeReport(t, out)
		require.Equal(t, []float64{0, 0, 0.1, 0.1, 0.2, 0.2}, r.floats(t, "start_times"))
		require.Equal(t, []float64{0, 0, 0.1, 0.1, 0.2, 0.2}, r.floats(t, "queue_times"))
		require.Equal(t, []float64{0.1, 0.1, 0.1, 0.1, 0.1, 0.1}, r.floats(t, "ttfts"))
		require.EqualValues(t, 2, r.f(t, "max_concurrent_requests"))
		require.EqualValues(t, 2, r.f(t, "max_concurrency"))
		require.InDelta(t, 0.3, r.f(t, "duration"), 1e-9)
		// vLLM's report of the wait: client_queue_time with a limit; not
		// e2el_including_client_queue at an infinite rate
		require.InDelta(t, 100, r.f(t, "mean_client_queue_time_ms"), 1e-9)
		require.InDelta(t, 200, r.f(t, "p99_client_queue_time_ms"), 1e-9)
		require.NotContains(t, r, "mean_e2el_including_client_queue_ms")
	})
}

// Refused requests and errors inside the stream count as failed, with
// their messages, and stay out of the latency metrics; a stream with no
// token, only the end marker, completed.
func TestServeFailures(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &fakeServer{script: func(i int, _ map[string]any) reply {
			switch i {
			case 0:
				return reply{ttft: 7 * time.Millisecond, noTokens: true}
			case 1:
				return reply{status: http.StatusTooManyRequests}
			case 2:
				return reply{ttft: 5 * time.Millisecond, gaps: []time.Duration{time.Millisecond}, streamError: true}
			}
			return reply{ttft: 10 * time.Millisecond, gaps: []time.Duration{time.Millisecond}}
		}}
		out, stderr, err := serveFake(t, t.Context(), f, "--num-prompts", "4", "--random-input-len", "8",
			"--random-output-len", "2", "--token-unit", "bytes", "--output", "json", "--save-detailed")
		require.NoError(t, err)
		r := decodeReport(t, out)
		require.EqualValues(t, 2, r.f(t, "completed"))
		require.EqualValues(t, 2, r.f(t, "failed"))
		// request 0 generated nothing (an immediate EOS): it completed, its
		// TTFT and E2EL are its end marker's arrival, it has no TPOT.
		require.Equal(t, []float64{0, 0, 0, 2}, r.floats(t, "output_lens"))
		require.Equal(t, []float64{0.007, 0, 0.005, 0.01}, r.floats(t, "ttfts"), "a failed request keeps what was measured, as in vLLM")
		require.Equal(t, []float64{0.007, 0, 0, 0.011}, r.floats(t, "latencies"))
		require.InDelta(t, 8.5, r.f(t, "mean_ttft_ms"), 1e-9)
		require.InDelta(t, 1, r.f(t, "mean_tpot_ms"), 1e-9)
		errs := r["errors"].([]any)
		require.Equal(t, "HTTP 429 Too Many Requests: The server is at capacity; retry later. (queue_full)", errs[1])
		require.Equal(t, "server error in stream: prefill worker lost (internal_error)", errs[2])
		require.Contains(t, stderr, "Failed requests during benchmark run detected")
	})
}

// A run whose context ends (Ctrl-C) stops sending, cancels what is in
// flight and reports what finished, marked partial.
func TestServeInterruptedPartialReport(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancelCause(t.Context())
		defer cancel(nil)
		f := &fakeServer{script: func(i int, _ map[string]any) reply {
			if i == 3 {
				cancel(errors.New("interrupt"))
			}
			return reply{ttft: 250 * time.Millisecond}
		}}
		// requests at 100, 200, 300, 400 ms; the fourth's arrival stops the
		// run: the first has finished (at 350 ms), three are in flight.
		out, _, err := serveFake(t, ctx, f, "--num-prompts", "10", "--request-rate", "10", "--burstiness", "inf",
			"--random-input-len", "8", "--random-output-len", "1", "--token-unit", "bytes", "--output", "json")
		require.NoError(t, err)
		r := decodeReport(t, out)
		require.Equal(t, true, r["partial"])
		require.EqualValues(t, 1, r.f(t, "completed"))
		require.EqualValues(t, 0, r.f(t, "failed"))
		require.EqualValues(t, 3, r.f(t, "cancelled"))
		require.EqualValues(t, 6, r.f(t, "not_sent"))
		require.InDelta(t, 0.4, r.f(t, "duration"), 1e-9)
		require.InDelta(t, 250, r.f(t, "mean_ttft_ms"), 1e-9)
	})
}

// A sweep over a server that serves one request at a time (50 ms each):
// at 5 and 10 req/s nothing queues, at 40 req/s the queue grows and TTFT
// misses its 80 ms objective; DistServe's goodput is 10 req/s, and the plot
// is a PNG.
func TestServeSweep(t *testing.T) {
	dir := t.TempDir()
	synctest.Test(t, func(t *testing.T) {
		gpu := make(chan struct{}, 1)
		f := &fakeServer{}
		f.script = func(int, map[string]any) reply {
			gpu <- struct{}{}
			time.Sleep(50 * time.Millisecond)
			<-gpu
			return reply{gaps: []time.Duration{5 * time.Millisecond}}
		}
		plot := filepath.Join(dir, "sweep.png")
		out, stderr, err := serveFake(t, t.Context(), f, "--num-prompts", "10", "--sweep-rates", "5,10,40",
			"--burstiness", "inf", "--random-input-len", "8", "--random-output-len", "2", "--token-unit", "bytes",
			"--goodput", "ttft:80", "tpot:10", "--output", "json", "--plot", plot)
		require.NoError(t, err)
		require.Contains(t, stderr, "plot: "+plot)
		var rep struct {
			Partial bool             `json:"partial"`
			Best    *float64         `json:"max_rate_at_attainment"`
			Runs    []map[string]any `json:"runs"`
		}
		require.NoError(t, json.Unmarshal([]byte(out), &rep), out)
		require.False(t, rep.Partial)
		require.Len(t, rep.Runs, 3)
		require.NotNil(t, rep.Best)
		require.Equal(t, 10.0, *rep.Best)
		att := []float64{}
		for _, run := range rep.Runs {
			att = append(att, run["slo_attainment"].(float64))
		}
		require.Equal(t, 1.0, att[0])
		require.Equal(t, 1.0, att[1])
		require.Less(t, att[2], 0.9)
		require.InDelta(t, 50, rep.Runs[0]["p90_ttft_ms"], 1e-9)
		png, err := os.ReadFile(plot)
		require.NoError(t, err)
		require.True(t, bytes.HasPrefix(png, []byte("\x89PNG\r\n\x1a\n")))
	})
}

// --token-unit auto asks the server: prompt_tokens equal to the probe's
// bytes means a byte-level tokenizer.
func TestServeProbesTokenUnit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &fakeServer{script: func(int, map[string]any) reply { return reply{ttft: time.Millisecond} }}
		out, stderr, err := serveFake(t, t.Context(), f, "--num-prompts", "2", "--random-input-len", "40",
			"--random-output-len", "1", "--output", "json", "--ignore-eos", "--temperature", "0.5")
		require.NoError(t, err)
		require.Contains(t, stderr, "token unit: bytes")
		require.Equal(t, "handoff-bench:bytes", decodeReport(t, out)["tokenizer_id"])
		require.Equal(t, false, f.bodies[0]["stream"], "the probe is not streamed")
		require.Len(t, f.bodies[1]["prompt"], 40)
		require.Equal(t, true, f.bodies[1]["ignore_eos"])
		require.Equal(t, 0.5, f.bodies[1]["temperature"])
	})
}

// The initial test request failing stops the benchmark with the reason.
func TestServeTestRunFails(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &fakeServer{script: func(int, map[string]any) reply { return reply{status: http.StatusServiceUnavailable} }}
		_, _, err := serveFake(t, t.Context(), f, "--num-prompts", "2", "--token-unit", "words", "--model", "m")
		require.ErrorContains(t, err, "initial test run failed")
		require.ErrorContains(t, err, "HTTP 503")
		require.Len(t, f.bodies, 1)
		require.Len(t, strings.Fields(f.bodies[0]["prompt"].(string)), 1024, "words: one per token")
	})
}

func TestParseServeFlags(t *testing.T) {
	o, err := parseServeFlags([]string{"--goodput", "ttft:500", "tpot:50", "--request-rate", "inf",
		"--metric-percentiles", "50,90,99.9", "--percentile-metrics", "ttft,e2el", "--sweep-rates", "1,2.5,4"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, serving.SLO{"ttft": 500, "tpot": 50}, o.slo)
	require.True(t, math.IsInf(o.requestRate, 1))
	require.Equal(t, []float64{50, 90, 99.9}, o.percentiles)
	require.Equal(t, []string{"ttft", "e2el"}, o.metrics)
	require.Equal(t, []float64{1, 2.5, 4}, o.sweepRates)
	require.Equal(t, 1000, o.numPrompts)
	require.Equal(t, 1024, o.inputLen)
	require.Equal(t, 128, o.outputLen)
	require.False(t, o.ignoreEOS)
	require.True(t, math.IsNaN(o.temperature))

	o, err = parseServeFlags([]string{"--goodput=ttft:1 e2el:2", "--temperature", "0"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, serving.SLO{"ttft": 1, "e2el": 2}, o.slo)
	require.Zero(t, o.temperature)

	for _, bad := range [][]string{
		{"--request-rate", "0"},
		{"--request-rate", "-1"},
		{"--burstiness", "0"},
		{"--random-range-ratio", "1"},
		{"--random-range-ratio", "-0.1"},
		{"--goodput", "itl:3"},
		{"--metric-percentiles", "0"},
		{"--metric-percentiles", "101"},
		{"--percentile-metrics", "ttft,xyz"},
		{"--output", "yaml"},
		{"--token-unit", "chars"},
		{"--sweep-rates", "1,2"},                                 // no SLO
		{"--sweep-rates", "1,2", "--goodput", "ttft:1"},          // no TPOT SLO
		{"--sweep-rates", "1,inf", "--goodput", "ttft:1 tpot:1"}, // not a rate
		{"--num-prompts", "0"},
		{"stray"},
	} {
		_, err := parseServeFlags(bad, io.Discard)
		require.Error(t, err, "%q", bad)
	}
}

func TestJoinMultiValues(t *testing.T) {
	require.Equal(t, []string{"--goodput=ttft:1 tpot:2", "--seed", "3"},
		joinMultiValues([]string{"--goodput", "ttft:1", "tpot:2", "--seed", "3"}))
	require.Equal(t, []string{"--goodput=ttft:1"}, joinMultiValues([]string{"-goodput", "ttft:1"}))
	require.Equal(t, []string{"--goodput=x", "--", "--goodput", "y"},
		joinMultiValues([]string{"--goodput=x", "--", "--goodput", "y"}))
}

func TestServeHelp(t *testing.T) {
	var stderr bytes.Buffer
	require.NoError(t, run(t.Context(), []string{"serve", "--help"}, io.Discard, &stderr))
	for _, s := range []string{"vllm bench serve", "--random-range-ratio", "floor(L*(1-r))", "--sweep-rates",
		"--goodput", "--max-concurrency", "--burstiness", "--save-detailed"} {
		require.Contains(t, stderr.String(), s)
	}
}

// Ctrl-C on the real command: SIGINT while requests hang in flight gives a
// report marked partial on stdout and exit status 1.
func TestServeSignalPartialReport(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a child process")
	}
	leakcheck.Check(t)
	var (
		mu   sync.Mutex
		done int
	)
	release := make(chan struct{})
	inFlight := make(chan struct{}, 16)
	f := &fakeServer{script: func(i int, _ map[string]any) reply { return reply{ttft: time.Millisecond} }}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if benchIndex(r.Header.Get("X-Request-Id")) >= 0 {
			mu.Lock()
			first := done < 3
			if first {
				done++
			}
			mu.Unlock()
			if !first {
				// read the body: only then does the server watch the
				// connection and end r.Context() when the client goes.
				_, _ = io.Copy(io.Discard, r.Body)
				inFlight <- struct{}{}
				select { // hang until the client goes
				case <-r.Context().Done():
				case <-release:
				}
				return
			}
		}
		f.ServeHTTP(w, r)
	}))
	defer srv.Close()
	defer close(release) // before Close, which waits for the handlers

	cmd := exec.Command(os.Args[0], "serve", "--base-url", srv.URL, "--num-prompts", "8", "--random-input-len", "8",
		"--random-output-len", "2", "--token-unit", "bytes", "--output", "json", "--progress", "lines")
	cmd.Env = append(os.Environ(), testRoleEnv+"=serve")
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	errPipe, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	// the child's progress lines tell when it has seen the three complete
	var stderr strings.Builder
	threeDone := make(chan struct{})
	stderrDone := make(chan struct{})
	go func() {
		defer close(stderrDone)
		sc := bufio.NewScanner(errPipe)
		closed := false
		for sc.Scan() {
			stderr.WriteString(sc.Text() + "\n")
			if strings.Contains(sc.Text(), "3/8 done") && !closed {
				close(threeDone)
				closed = true
			}
		}
	}()
	waitFor := func(ch <-chan struct{}, what string) {
		select {
		case <-ch:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-stderrDone
			_ = cmd.Wait()
			t.Fatalf("%s never happened; stderr:\n%s", what, stderr.String())
		}
	}
	for range 5 {
		waitFor(inFlight, "five requests in flight")
	}
	waitFor(threeDone, "three requests done")
	require.NoError(t, cmd.Process.Signal(syscall.SIGINT))
	<-stderrDone
	err = cmd.Wait()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "stderr:\n%s", stderr.String())
	require.Equal(t, 1, exit.ExitCode())
	require.Contains(t, stderr.String(), "handoff-bench: interrupted")
	require.Contains(t, stderr.String(), "Traffic request rate: inf\n")
	require.Contains(t, stderr.String(), "rate inf: 3/8 done")
	r := decodeReport(t, stdout.String())
	require.Equal(t, true, r["partial"])
	require.EqualValues(t, 3, r.f(t, "completed"))
	require.EqualValues(t, 5, r.f(t, "cancelled"))
	require.EqualValues(t, 0, r.f(t, "failed"))
	require.EqualValues(t, 0, r.f(t, "not_sent"))
}

// On a terminal the progress is one line redrawn in place; otherwise a
// line per tenth of the requests; "none" shows nothing.
func TestServeProgress(t *testing.T) {
	var b bytes.Buffer
	p := newProgress(&b, "auto", true, "rate 2", 4)
	for i := range 4 {
		p.add(serving.Result{Success: i != 1})
	}
	p.finish()
	out := b.String()
	require.Contains(t, out, "\r\x1b[Krate 2 [")
	require.Contains(t, out, "[==============================] 4/4 100%")
	require.Contains(t, out, "failed 1")
	require.True(t, strings.HasSuffix(out, "\n"))

	b.Reset()
	p = newProgress(&b, "auto", false, "rate 2", 20)
	for range 20 {
		p.add(serving.Result{Success: true})
	}
	p.finish()
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	require.Len(t, lines, 10)
	require.True(t, strings.HasPrefix(lines[0], "rate 2: 2/20 done, 0 failed, "), lines[0])
	require.NotContains(t, b.String(), "\r")

	require.Nil(t, newProgress(&b, "none", true, "x", 1))
	var none *progress
	none.add(serving.Result{}) // a nil progress shows nothing
	none.finish()
}

// Ctrl-C during a sweep reports the rates already run and the interrupted
// one, marked partial, and still draws the plot.
func TestServeSweepInterrupted(t *testing.T) {
	dir := t.TempDir()
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancelCause(t.Context())
		defer cancel(nil)
		var mu sync.Mutex
		seen := 0
		f := &fakeServer{script: func(i int, _ map[string]any) reply {
			if i >= 0 {
				mu.Lock()
				seen++
				if seen == 4+3 { // the third request of the second rate
					cancel(errors.New("interrupt"))
				}
				mu.Unlock()
			}
			return reply{ttft: 10 * time.Millisecond, gaps: []time.Duration{time.Millisecond}}
		}}
		plot := filepath.Join(dir, "p.png")
		out, _, err := serveFake(t, ctx, f, "--num-prompts", "4", "--sweep-rates", "10,20,40", "--burstiness", "inf",
			"--random-input-len", "8", "--random-output-len", "2", "--token-unit", "bytes",
			"--goodput", "ttft:100", "tpot:100", "--output", "json", "--plot", plot)
		require.NoError(t, err)
		var rep struct {
			Partial bool             `json:"partial"`
			Best    *float64         `json:"max_rate_at_attainment"`
			Runs    []map[string]any `json:"runs"`
		}
		require.NoError(t, json.Unmarshal([]byte(out), &rep), out)
		require.True(t, rep.Partial)
		require.Len(t, rep.Runs, 2, "the third rate never ran")
		require.Equal(t, false, rep.Runs[0]["partial"])
		require.Equal(t, true, rep.Runs[1]["partial"])
		require.EqualValues(t, 2, rep.Runs[1]["completed"])
		require.EqualValues(t, 1, rep.Runs[1]["cancelled"])
		require.EqualValues(t, 1, rep.Runs[1]["not_sent"])
		_, err = os.Stat(plot)
		require.NoError(t, err)
	})
}

// Several --base-url servers are sent requests in turn, each with the
// endpoint; the first answers the set-up calls.
func TestServeBaseURLsRoundRobin(t *testing.T) {
	o, err := parseServeFlags([]string{"--base-url", "http://a:1, http://b:2/", "--endpoint", "v1/completions"}, io.Discard)
	require.NoError(t, err)
	c := newServeClient(o, nil)
	require.Equal(t, "http://a:1", c.base)
	var got []string
	for range 5 {
		got = append(got, c.nextURL())
	}
	require.Equal(t, []string{"http://a:1/v1/completions", "http://b:2/v1/completions", "http://a:1/v1/completions",
		"http://b:2/v1/completions", "http://a:1/v1/completions"}, got)

	for _, bad := range []string{"http://a:1,", "a:1", "http://a:1,ftp://b"} {
		_, err := parseServeFlags([]string{"--base-url", bad}, io.Discard)
		require.ErrorContains(t, err, "--base-url", bad)
	}
}
