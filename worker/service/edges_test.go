package service

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/worker"
)

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().String()
}

type readyState struct {
	status int
	Ready  bool              `json:"ready"`
	Checks map[string]string `json:"checks"`
}

func getReadyz(client *http.Client, addr string) (readyState, error) {
	resp, err := client.Get("http://" + addr + "/readyz")
	if err != nil {
		return readyState{}, err
	}
	defer resp.Body.Close()
	r := readyState{status: resp.StatusCode}
	err = json.NewDecoder(resp.Body).Decode(&r)
	return r, err
}

// runWorker runs RunDecode with o until the test ends.
func runWorker(t *testing.T, _ worker.Role, run func(ctx context.Context) error) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() { cancel(); err = <-done })
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// Issue 19 finding 1: /readyz is 503 from process start until the API
// accepts connections; probing both in a tight loop never sees ready while
// the API port refuses. (It answered 200 before the first check was added,
// and in standalone once prefill's checks passed, before decode's.)
func TestReadyNeverBeforeListening(t *testing.T) {
	admin, api := freeAddr(t), freeAddr(t)
	cfg := testConfig(t, worker.RoleDecode, "--standalone", "--admin-addr", admin, "--http-addr", api)
	stop := runWorker(t, worker.RoleDecode, func(ctx context.Context) error {
		return RunDecode(ctx, cfg, Options{Stdout: io.Discard, Stderr: io.Discard})
	})
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(30 * time.Second)
	probes, notReady := 0, 0
	for time.Now().Before(deadline) {
		r, err := getReadyz(client, admin)
		if err != nil {
			continue // admin not up yet
		}
		probes++
		if r.status != http.StatusOK {
			require.False(t, r.Ready)
			notReady++
			continue
		}
		c, err := net.DialTimeout("tcp", api, time.Second)
		require.NoError(t, err, "ready, but the API refuses connections (after %d probes)", probes)
		c.Close()
		require.Equal(t, "ok", r.Checks["serving"])
		require.Equal(t, "ok", r.Checks["prefill_serving"])
		require.Equal(t, "ok", r.Checks["prefill_instances"])
		require.Equal(t, "ok", r.Checks["scheduler"], "decode's scheduler check (named engine before)")
		break
	}
	require.Positive(t, notReady, "the start was never observed unready")
	require.NoError(t, stop())
}

// A decode whose NATS never connects is never ready (it answered 200 at 8 ms).
func TestNotReadyWithoutNATS(t *testing.T) {
	admin := freeAddr(t)
	cfg := testConfig(t, worker.RoleDecode, "--admin-addr", admin, "--nats-url", "nats://"+freeAddr(t))
	runWorker(t, worker.RoleDecode, func(ctx context.Context) error {
		return RunDecode(ctx, cfg, Options{Stdout: io.Discard, Stderr: io.Discard})
	})
	client := &http.Client{Timeout: time.Second}
	seen := 0
	for end := time.Now().Add(time.Second); time.Now().Before(end); {
		r, err := getReadyz(client, admin)
		if err != nil {
			continue
		}
		seen++
		require.Equal(t, http.StatusServiceUnavailable, r.status, "%v", r.Checks)
	}
	require.Positive(t, seen)
}

// Issue 19 finding 5: with --prefill remote, readiness reports
// prefill_instances: 503 until a prefill instance is seen, 200 while one
// is there, still 200 (with a warning) for --prefill-grace after the last
// one left, 503 after that.
func TestPrefillInstancesReadiness(t *testing.T) {
	ns := natstest.Run(t)
	common := []string{"--nats-url", ns.ClientURL(), "--namespace", "presence"}
	dep, _ := startWorker(t, testConfig(t, worker.RoleDecode, append(common, "--prefill-grace", "1500ms")...))
	client := &http.Client{Timeout: time.Second}
	r, err := getReadyz(client, dep.Admin)
	require.NoError(t, err)
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Contains(t, r.Checks["prefill_instances"], "no usable prefill instance seen yet")

	_, stopPrefill := startWorker(t, testConfig(t, worker.RolePrefill, common...))
	require.Eventually(t, func() bool {
		r, err := getReadyz(client, dep.Admin)
		return err == nil && r.status == http.StatusOK && r.Checks["prefill_instances"] == "ok"
	}, 10*time.Second, 20*time.Millisecond)

	require.NoError(t, stopPrefill())
	gone := time.Now()
	require.Eventually(t, func() bool {
		r, err := getReadyz(client, dep.Admin)
		return err == nil && strings.HasPrefix(r.Checks["prefill_instances"], "warn: ")
	}, 10*time.Second, 20*time.Millisecond, "the prefill worker's leaving is seen")
	r, err = getReadyz(client, dep.Admin)
	require.NoError(t, err)
	if time.Since(gone) < time.Second {
		require.Equal(t, http.StatusOK, r.status, "within the grace, still ready: %v", r.Checks)
	}
	require.Eventually(t, func() bool {
		r, err := getReadyz(client, dep.Admin)
		return err == nil && r.status == http.StatusServiceUnavailable
	}, 10*time.Second, 20*time.Millisecond, "unready after the grace")
	require.GreaterOrEqual(t, time.Since(gone), 1500*time.Millisecond)
}

// Issue 19 finding 2, the repro in process: a request still
// waiting for its cache when the drain times out gets the documented 503
// unavailable (it got 500 internal_error), counted failed.
func TestShutdownFailsAwaitCacheWith503(t *testing.T) {
	cfg := testConfig(t, worker.RoleDecode, "--standalone", "--model", "tiny-hybrid?prefill_delay=5ms", "--drain-timeout", "300ms")
	ep, stop := startWorker(t, cfg)
	type res struct {
		status int
		body   string
	}
	out := make(chan res, 1)
	go func() {
		body := fmt.Sprintf(`{"model":"tiny-hybrid","prompt":%q,"max_tokens":4}`, strings.Repeat("p", 2000))
		resp, err := http.Post("http://"+ep.HTTP+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			out <- res{0, err.Error()}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		out <- res{resp.StatusCode, string(b)}
	}()
	require.Eventually(t, func() bool {
		return metricValue(t, ep.Admin, `handoff_sessions_inflight{role="decode"}`) == 1
	}, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())
	r := <-out
	require.Equal(t, http.StatusServiceUnavailable, r.status, r.body)
	require.Contains(t, r.body, `"code":"unavailable"`)
}

// Issue 19 finding 6: a second signal (Options.Abort) ends the drain at
// once: the request left fails with 503 and RunDecode returns ErrAborted,
// long before --drain-timeout.
func TestAbortEndsDrain(t *testing.T) {
	cfg := testConfig(t, worker.RoleDecode, "--prefill", "local", "--model", "tiny-hybrid?decode_delay=20ms", "--drain-timeout", "60s")
	ctx, cancel := context.WithCancel(context.Background())
	abort, doAbort := context.WithCancel(context.Background())
	defer doAbort()
	ready := make(chan Endpoints, 1)
	done := make(chan error, 1)
	go func() {
		done <- RunDecode(ctx, cfg, Options{Stdout: io.Discard, Stderr: io.Discard, Abort: abort,
			Ready: func(ep Endpoints) { ready <- ep }})
	}()
	ep := <-ready
	status := make(chan int, 1)
	go func() {
		resp, err := http.Post("http://"+ep.HTTP+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"tiny-hybrid","prompt":"long","max_tokens":2000,"temperature":0}`))
		if err != nil {
			status <- 0
			return
		}
		resp.Body.Close()
		status <- resp.StatusCode
	}()
	require.Eventually(t, func() bool {
		return metricValue(t, ep.Admin, `handoff_mamba_rows{rank="0",role="decode",state="used"}`) == 1
	}, 10*time.Second, 5*time.Millisecond)
	cancel()
	time.Sleep(100 * time.Millisecond) // draining
	start := time.Now()
	doAbort()
	select {
	case err := <-done:
		require.ErrorIs(t, err, ErrAborted)
	case <-time.After(15 * time.Second):
		t.Fatal("the drain went on after the abort")
	}
	require.Less(t, time.Since(start), 15*time.Second)
	require.Equal(t, http.StatusServiceUnavailable, <-status)
}
