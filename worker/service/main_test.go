package service

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/worker"
)

func TestMainSubcommands(t *testing.T) {
	var out, errb bytes.Buffer
	require.NoError(t, Main(context.Background(), nil, worker.RoleDecode, []string{"version"}, &out, &errb))
	require.Contains(t, out.String(), "handoff decode ")

	out.Reset()
	require.NoError(t, Main(context.Background(), nil, worker.RolePrefill, []string{"--help"}, &out, &errb))
	require.Contains(t, out.String(), "(env NATS_URL)")
	require.NotContains(t, out.String(), "--http-addr", "decode-only flags are not prefill's")

	require.Error(t, Main(context.Background(), nil, worker.RoleDecode, []string{"--dp-size", "0"}, &out, &errb))

	ready := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, `{"ready":true}`) }))
	defer ready.Close()
	notReady := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = io.WriteString(w, `{"ready":false}`)
	}))
	defer notReady.Close()
	out.Reset()
	require.NoError(t, Main(context.Background(), nil, worker.RoleDecode, []string{"healthcheck", "--url", ready.URL}, &out, &errb))
	require.Contains(t, out.String(), "ok")
	err := Main(context.Background(), nil, worker.RoleDecode, []string{"healthcheck", "--url", notReady.URL}, &out, &errb)
	require.ErrorContains(t, err, "503")
	err = Main(context.Background(), nil, worker.RolePrefill, []string{"healthcheck", "--url", "http://127.0.0.1:1/readyz", "--timeout", "1s"}, &out, &errb)
	require.Error(t, err)
}

// TestDrainTimeout: a request still running when the drain timeout expires
// is failed, and the worker still stops cleanly.
func TestDrainTimeout(t *testing.T) {
	cfg := testConfig(t, worker.RoleDecode, "--prefill", "local", "--model", "tiny-hybrid?decode_delay=50ms",
		"--drain-timeout", "200ms")
	ep, stop := startWorker(t, cfg)
	status := make(chan int, 1)
	go func() {
		resp, err := http.Post("http://"+ep.HTTP+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"tiny-hybrid","prompt":"slow","max_tokens":1000,"temperature":0,"stream":true}`))
		if err != nil {
			status <- 0
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if strings.Contains(string(b), `"error"`) {
			status <- 503
			return
		}
		status <- resp.StatusCode
	}()
	require.Eventually(t, func() bool {
		return metricValue(t, ep.Admin, `handoff_mamba_rows{rank="0",role="decode",state="used"}`) == 1
	}, 10*time.Second, 5*time.Millisecond)
	start := time.Now()
	require.NoError(t, stop())
	require.Less(t, time.Since(start), 10*time.Second)
	select {
	case s := <-status:
		require.NotEqual(t, http.StatusOK, s, fmt.Sprintf("status %d", s))
	case <-time.After(10 * time.Second):
		t.Fatal("the request did not end")
	}
}

// A stop (SIGTERM) while the worker still waits for NATS ends it cleanly:
// exit 0, as after a drain, not a start-up failure.
func TestMainStoppedBeforeServing(t *testing.T) {
	for _, role := range []worker.Role{worker.RolePrefill, worker.RoleDecode} {
		t.Run(string(role), func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(300*time.Millisecond, cancel)
			args := []string{"--nats-url", "nats://127.0.0.1:1", "--admin-addr", "127.0.0.1:0", "--data-addr", "127.0.0.1:0"}
			if role == worker.RoleDecode {
				args = append(args, "--http-addr", "127.0.0.1:0", "--prefill", "remote")
			}
			var out, errb bytes.Buffer
			require.NoError(t, Main(ctx, nil, role, args, &out, &errb))
			require.Contains(t, errb.String(), "stopped before serving")
		})
	}
}
