package service

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/config"
)

// testConfig is a worker config on loopback with random ports.
func testConfig(t testing.TB, role worker.Role, args ...string) config.Config {
	t.Helper()
	base := []string{"--admin-addr", "127.0.0.1:0", "--data-addr", "127.0.0.1:0", "--log-level", "warn",
		"--instance-id", fmt.Sprintf("%s-%d", role, time.Now().UnixNano())}
	if role == worker.RoleDecode {
		base = append(base, "--http-addr", "127.0.0.1:0")
	}
	c, err := config.Parse(role, append(base, args...), func(string) string { return "" }, io.Discard)
	require.NoError(t, err)
	return c
}

// startWorker runs run in the background and returns its endpoints once it
// serves; the worker is stopped (and must stop cleanly) when the test ends.
// opts adjust the worker's Options.
func startWorker(t testing.TB, cfg config.Config, opts ...func(*Options)) (Endpoints, func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan Endpoints, 1)
	done := make(chan error, 1)
	var logs bytes.Buffer
	var mu sync.Mutex
	o := Options{Ready: func(ep Endpoints) { ready <- ep }, Stdout: io.Discard, Stderr: lockedWriter{&mu, &logs}}
	for _, f := range opts {
		f(&o)
	}
	go func() {
		if cfg.Role == worker.RoleDecode {
			done <- RunDecode(ctx, cfg, o)
		} else {
			done <- RunPrefill(ctx, cfg, o)
		}
	}()
	var ep Endpoints
	select {
	case ep = <-ready:
	case err := <-done:
		cancel()
		t.Fatalf("%s did not start: %v", cfg.Role, err)
	case <-time.After(20 * time.Second):
		cancel()
		t.Fatalf("%s did not start", cfg.Role)
	}
	var once sync.Once
	var stopErr error
	stop := func() error {
		once.Do(func() {
			cancel()
			stopErr = <-done
		})
		return stopErr
	}
	t.Cleanup(func() {
		require.NoError(t, stop())
		mu.Lock()
		defer mu.Unlock()
		if t.Failed() {
			t.Logf("%s logs:\n%s", cfg.Role, logs.String())
		}
	})
	return ep, stop
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

type completionOut struct {
	status int
	text   string
	finish string
	tokens int
}

func complete(t *testing.T, addr, prompt string, maxTokens int, temp float64, seed int) completionOut {
	t.Helper()
	body := fmt.Sprintf(`{"model":"tiny-hybrid","prompt":%q,"max_tokens":%d,"temperature":%v,"seed":%d}`,
		prompt, maxTokens, temp, seed)
	resp, err := http.Post("http://"+addr+"/v1/completions", "application/json", strings.NewReader(body))
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	var c struct {
		Choices []struct {
			Text         string `json:"text"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	out := completionOut{status: resp.StatusCode}
	if resp.StatusCode == http.StatusOK {
		require.NoError(t, json.Unmarshal(b, &c), string(b))
		out.text, out.finish, out.tokens = c.Choices[0].Text, c.Choices[0].FinishReason, c.Usage.CompletionTokens
	} else {
		out.text = string(b)
	}
	return out
}

func metricValue(t testing.TB, adminAddr, series string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + adminAddr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`)
	m := re.FindSubmatch(b)
	require.NotNil(t, m, "series %s not found", series)
	v, err := strconv.ParseFloat(string(m[1]), 64)
	require.NoError(t, err)
	return v
}

var prompts = []string{
	"Hello, handoff",
	"The quick brown fox",
	"x",
	"disaggregated prefill and decode",
	"0123456789",
}

// TestRemoteMatchesLocal is the standalone wiring in process: an embedded
// NATS server, a prefill worker and a remote-prefill decode worker over the
// TCP data path, both with --dp-size 2 --max-batch-size 1 (the seed
// scenario). Every output must equal the local-prefill decode worker's.
func TestRemoteMatchesLocal(t *testing.T) {
	ns, err := StartEmbeddedNATS(-1) // the standalone server, not natstest's: its wiring is under test
	require.NoError(t, err)
	t.Cleanup(ns.Shutdown)
	common := []string{"--nats-url", ns.URL(), "--transport", "tcp", "--dp-size", "2", "--max-batch-size", "1",
		"--namespace", "remote-vs-local"}
	pep, _ := startWorker(t, testConfig(t, worker.RolePrefill, common...))
	rep, _ := startWorker(t, testConfig(t, worker.RoleDecode, append(common, "--prefill", "remote")...))
	lep, _ := startWorker(t, testConfig(t, worker.RoleDecode, "--prefill", "local", "--dp-size", "2", "--max-batch-size", "1"))
	require.Empty(t, lep.Data, "local mode opens no data path")

	type result struct{ remote, local completionOut }
	results := make([]result, len(prompts)*2+1)
	var wg sync.WaitGroup
	for i, p := range prompts {
		for j, temp := range []float64{0, 0.9} {
			k := 2*i + j
			wg.Go(func() {
				results[k].remote = complete(t, rep.HTTP, p, 10, temp, k)
				results[k].local = complete(t, lep.HTTP, p, 10, temp, k)
			})
		}
	}
	wg.Wait()
	// One request alone: whatever the timing of the burst above, its steps
	// run with the other rank idle, so each role must pad the dummy.
	k := len(results) - 1
	results[k].remote = complete(t, rep.HTTP, prompts[0], 10, 0, k)
	results[k].local = complete(t, lep.HTTP, prompts[0], 10, 0, k)
	for k, r := range results {
		require.Equal(t, http.StatusOK, r.remote.status, "remote %d: %s", k, r.remote.text)
		require.Equal(t, http.StatusOK, r.local.status, "local %d: %s", k, r.local.text)
		require.Equal(t, r.local, r.remote, "request %d", k)
	}
	n := float64(len(results))
	require.Equal(t, n, metricValue(t, rep.Admin, `handoff_transfers_total{result="ok",role="decode"}`))
	require.Equal(t, n, metricValue(t, rep.Admin, `handoff_requests_total{result="ok",role="decode"}`))
	require.Equal(t, n, metricValue(t, pep.Admin, `handoff_requests_total{result="ok",role="prefill"}`))
	require.Equal(t, n, metricValue(t, pep.Admin, `handoff_transfers_total{result="ok",role="prefill"}`))
	require.Greater(t, metricValue(t, rep.Admin, `handoff_transfer_bytes_total{kind="mamba",role="decode"}`), 0.0)
	for _, kind := range []string{"kv", "mamba"} { // every handoff served: both sides count the same bytes
		require.Equal(t, metricValue(t, rep.Admin, `handoff_transfer_bytes_total{kind="`+kind+`",role="decode"}`),
			metricValue(t, pep.Admin, `handoff_transfer_bytes_total{kind="`+kind+`",role="prefill"}`), kind)
	}
	require.Equal(t, 1.0, metricValue(t, rep.Admin, `handoff_transport_info{transport="tcp"}`))
	require.Equal(t, 0.0, metricValue(t, rep.Admin, `handoff_retries_total{role="decode"}`), "no worker refused or died")
	require.Equal(t, 0.0, metricValue(t, rep.Admin, `handoff_quarantined_bytes{role="decode"}`), "no writer stopped inside a copy")
	require.Equal(t, 1.0, metricValue(t, pep.Admin, `handoff_transport_info{transport="tcp"}`))
	// Both roles padded dummies: a rank with no work pads while the other
	// works (the lone request guarantees such steps).
	require.Greater(t, metricValue(t, pep.Admin, `handoff_dummy_requests_total{role="prefill"}`), 0.0)
	require.Greater(t, metricValue(t, rep.Admin, `handoff_dummy_requests_total{role="decode"}`), 0.0)
	// The pools are back to idle: every real row free on both ranks of both roles.
	for _, ep := range []Endpoints{rep, pep} {
		for _, rank := range []string{"0", "1"} {
			role := "decode"
			if ep == pep {
				role = "prefill"
			}
			require.Eventually(t, func() bool {
				return metricValue(t, ep.Admin, fmt.Sprintf(`handoff_mamba_rows{rank="%s",role="%s",state="used"}`, rank, role)) == 0
			}, 5*time.Second, 10*time.Millisecond)
			require.Equal(t, 1.0, metricValue(t, ep.Admin, fmt.Sprintf(`handoff_mamba_rows{rank="%s",role="%s",state="free"}`, rank, role)))
			require.Equal(t, 2.0, metricValue(t, ep.Admin, fmt.Sprintf(`handoff_mamba_rows{rank="%s",role="%s",state="reserved"}`, rank, role)))
		}
	}
	resp, err := http.Get("http://" + rep.Admin + "/readyz")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
}

// TestPrefillPoolsSmallerThanDecode: a prompt that fits the decode
// worker's pools but not its prefill workers' can never run: 400
// context_length_exceeded, not a 503 that tells the client to retry; a
// prompt that fits both is served.
func TestPrefillPoolsSmallerThanDecode(t *testing.T) {
	ns := natstest.Run(t)
	common := []string{"--nats-url", ns.ClientURL(), "--namespace", "small-prefill"}
	startWorker(t, testConfig(t, worker.RolePrefill, append(common, "--kv-blocks", "40")...))
	dep, _ := startWorker(t, testConfig(t, worker.RoleDecode, append(common, "--prefill", "remote")...))
	post := func(prompt int) (int, string) {
		toks := strings.TrimSuffix(strings.Repeat("65,", prompt), ",")
		resp, err := http.Post("http://"+dep.HTTP+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"tiny-hybrid","prompt":[`+toks+`],"max_tokens":4,"temperature":0}`))
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}
	status, body := post(700) // 40 blocks of 16 tokens: 640 at most
	require.Equal(t, http.StatusBadRequest, status, body)
	require.Contains(t, body, `"context_length_exceeded"`)
	status, body = post(100)
	require.Equal(t, http.StatusOK, status, body)
}

// TestNoPrefillWorker: a remote decode worker with no prefill worker answers
// 503 with an error body and frees the request's resources.
func TestNoPrefillWorker(t *testing.T) {
	ns := natstest.Run(t)
	ep, _ := startWorker(t, testConfig(t, worker.RoleDecode, "--nats-url", ns.ClientURL(), "--namespace", "lonely"))
	out := complete(t, ep.HTTP, "anyone there?", 4, 0, 1)
	require.Equal(t, http.StatusServiceUnavailable, out.status, out.text)
	require.Contains(t, out.text, `"error"`)
	require.Equal(t, 1.0, metricValue(t, ep.Admin, `handoff_transfers_total{result="refused",role="decode"}`))
	require.Equal(t, 0.0, metricValue(t, ep.Admin, `handoff_mamba_rows{rank="0",role="decode",state="used"}`))
}

// TestDrain: on shutdown readiness turns 503, new requests get 503, and the
// request in flight completes.
func TestDrain(t *testing.T) {
	cfg := testConfig(t, worker.RoleDecode, "--prefill", "local", "--model", "tiny-hybrid?decode_delay=20ms",
		"--drain-timeout", "20s")
	ep, stop := startWorker(t, cfg)
	type res struct {
		status int
		body   string
	}
	inflight := make(chan res, 1)
	go func() {
		resp, err := http.Post("http://"+ep.HTTP+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"tiny-hybrid","prompt":"drain me","max_tokens":40,"temperature":0}`))
		if err != nil {
			inflight <- res{0, err.Error()}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		inflight <- res{resp.StatusCode, string(b)}
	}()
	require.Eventually(t, func() bool {
		return metricValue(t, ep.Admin, `handoff_mamba_rows{rank="0",role="decode",state="used"}`) == 1
	}, 10*time.Second, 5*time.Millisecond)
	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + ep.Admin + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusServiceUnavailable
	}, 5*time.Second, 5*time.Millisecond)
	out := complete(t, ep.HTTP, "too late", 2, 0, 1)
	require.Equal(t, http.StatusServiceUnavailable, out.status, out.text)
	// The refusal closes its connection: a client that pools connections
	// reaches another replica next, not this one again.
	resp, err := http.Post("http://"+ep.HTTP+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"tiny-hybrid","prompt":"too late","max_tokens":2}`))
	require.NoError(t, err)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	require.True(t, resp.Close, "a draining worker's refusal keeps its connection open")
	r := <-inflight
	require.Equal(t, http.StatusOK, r.status, r.body)
	require.NoError(t, <-stopped)
}
