//go:build integration

package integration

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestLayerwiseRemoteEqualsLocal is the oracle with the cache streamed
// layer by layer while prefill computes (--layerwise on), with and without
// chunked prefill, over shm and tcp, with the same TP on both sides and
// with different ones (a TP-p prefill group streams each layer, resharded,
// into a TP-d decode's grant while later layers compute): remote output
// equals local TP-1 output token for token on random prompts, and the
// prefill worker's metrics show that bytes did leave while prefill
// computed.
func TestLayerwiseRemoteEqualsLocal(t *testing.T) {
	ns := startNATS(t, nil)
	local := startProc(t, "decode", "--prefill", "local", "--nats-url", ns.url(), "--namespace", "lw-local")
	local.waitReady(readyWithin)
	for _, c := range []struct {
		name string
		p, d int
		args []string
	}{
		{"shm", 1, 1, nil},
		{"shm-chunked", 1, 1, []string{"--prefill-chunk-tokens", "7"}},
		{"tcp-chunked", 1, 1, []string{"--prefill-chunk-tokens", "16", "--transport", "tcp"}},
		{"p2d1-shm-chunked", 2, 1, []string{"--prefill-chunk-tokens", "7"}},
		{"p1d2-tcp", 1, 2, []string{"--transport", "tcp"}},
		{"p4d2-shm", 4, 2, nil},
		{"p2d4-tcp-chunked", 2, 4, []string{"--prefill-chunk-tokens", "16", "--transport", "tcp"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			space := "lw-" + c.name
			common := append([]string{"--nats-url", ns.url(), "--namespace", space, "--model", "tiny-hybrid?prefill_delay=1ms"}, c.args...)
			pre := startProc(t, "prefill", append(common, "--layerwise", "on", "--tp-size", itoa(c.p))...)
			remote := startProc(t, "decode", append(common, "--prefill", "remote", "--tp-size", itoa(c.d))...)
			pre.waitReady(readyWithin)
			remote.waitReady(readyWithin)
			name := modelName(t, remote.api)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			warmUp(ctx, t, remote.api, name)
			prompts := randomPrompts(12, 29)
			for i := range prompts {
				prompts[i] += strings.Repeat(" river", 2+4*i)
			}
			requireSameAnswers(ctx, t, remote.api, local.api, name, prompts, 8, fmt.Sprintf("remote (layer-wise, prefill TP %d, decode TP %d) and local", c.p, c.d))
			mf := pre.metrics()
			streamed := sum(mf, "handoff_transfer_streamed_bytes_total", map[string]string{"role": "prefill"})
			moved := sum(mf, "handoff_transfer_bytes_total", map[string]string{"role": "prefill"})
			t.Logf("%.0f of %.0f bytes left while prefill computed", streamed, moved)
			require.Positive(t, streamed, "nothing was streamed: the cache went in one write")
			require.LessOrEqual(t, streamed, moved)
			requireIdle(t, remote, "decode")
			requireIdle(t, pre, "prefill")
		})
	}
}

// TestLayerwisePrefillKilledMidStream kills one of two streaming prefill
// workers (SIGKILL) while it has requests in flight: the grants it was
// filling are fenced, every request is served by the survivor, and the
// answers equal the aggregated ones, so no byte the dead writer streamed
// survives into a cache decode used. Decode's pools return to idle.
func TestLayerwisePrefillKilledMidStream(t *testing.T) {
	ns := startNATS(t, nil)
	common := []string{"--nats-url", ns.url(), "--namespace", "lwkill", "--model", "tiny-hybrid?prefill_delay=3ms",
		"--layerwise", "on", "--request-timeout", "90s"}
	p1 := startProc(t, "prefill", common...)
	p2 := startProc(t, "prefill", common...)
	dec := startProc(t, "decode", append(common, "--prefill", "remote")...)
	local := startProc(t, "decode", "--prefill", "local", "--nats-url", ns.url(), "--namespace", "lwkill-local")
	p1.waitReady(readyWithin)
	p2.waitReady(readyWithin)
	dec.waitReady(readyWithin)
	local.waitReady(readyWithin)
	name := modelName(t, dec.api)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const n = 12
	var wg sync.WaitGroup
	results := make([]completion, n)
	errs := make([]error, n)
	prompts := randomPrompts(n, 17)
	for i := range prompts {
		prompts[i] += " " + strings.Repeat("long ", 40)
	}
	for i := 0; i < n; i++ {
		wg.Go(func() {
			results[i], errs[i] = complete(ctx, dec.api, completionRequest{Model: name, Prompt: prompts[i], MaxTokens: 4, Temperature: ptr(0.0)})
		})
		if i == n/3 {
			require.Eventually(t, func() bool {
				return sum(p1.metrics(), "handoff_sessions_inflight", map[string]string{"role": "prefill"}) > 0
			}, 10*time.Second, time.Millisecond, "p1 never had a session in flight")
			p1.kill()
		}
	}
	wg.Wait()
	for i := range results {
		require.NoError(t, errs[i], "request %d got no HTTP answer", i)
		require.Equalf(t, http.StatusOK, results[i].Status, "request %d: %s", i, results[i].Err)
		want, err := complete(ctx, local.api, completionRequest{Model: name, Prompt: prompts[i], MaxTokens: 4, Temperature: ptr(0.0)})
		require.NoError(t, err)
		require.Equal(t, want.Text, results[i].Text, "request %d: a served cache differs from the aggregated one", i)
	}
	retried := sum(dec.metrics(), "handoff_retries_total", map[string]string{"role": "decode"})
	t.Logf("%v handoffs retried across the SIGKILL", retried)
	require.Positive(t, retried, "no handoff failed over: the kill did not land mid-stream")
	requireIdle(t, dec, "decode")
	requireIdle(t, p2, "prefill")
}

// TestLayerwiseDecodeKilledMidStream kills decode while prefill computes
// and streams (chunked): prefill frees everything and stays ready.
func TestLayerwiseDecodeKilledMidStream(t *testing.T) {
	ns := startNATS(t, nil)
	common := []string{"--nats-url", ns.url(), "--namespace", "lwkilldec", "--model", "tiny-hybrid?prefill_delay=5ms"}
	pre := startProc(t, "prefill", append(common, "--layerwise", "on", "--prefill-chunk-tokens", "64")...)
	dec := startProc(t, "decode", append(common, "--prefill", "remote")...)
	pre.waitReady(readyWithin)
	dec.waitReady(readyWithin)
	name := modelName(t, dec.api)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i := 0; i < 6; i++ {
		go complete(ctx, dec.api, completionRequest{Model: name, Prompt: fmt.Sprintf("doomed %d %s", i, strings.Repeat("y", 200)), MaxTokens: 8})
	}
	// Decode waits for caches that prefill computes and streams (about a
	// second of compute each, the first layers leaving early on): kill it
	// then.
	require.Eventually(t, func() bool {
		return sum(dec.metrics(), "handoff_sessions_inflight", map[string]string{"role": "decode"}) > 0
	}, 30*time.Second, 5*time.Millisecond, "decode never waited for a cache")
	time.Sleep(300 * time.Millisecond)
	dec.kill()
	requireIdle(t, pre, "prefill")
	require.True(t, pre.ready(), "prefill should stay ready after its peer died")
}
