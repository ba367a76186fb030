//go:build integration

package integration

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestTPRemoteEqualsLocal is the oracle of issue 12: a prefill worker with
// --tp-size p hands requests to a decode worker with --tp-size d (or with
// attention DP 2, whose ranks keep the full state), the handoff reshards
// KV heads, Mamba heads and conv sections on the way, and the output equals
// a local TP-1 decode token for token, greedy and seeded alike. tiny-hybrid
// at TP 4 replicates its 2 KV heads and its 2 groups. Pools are idle on
// both sides afterwards.
func TestTPOracle(t *testing.T) {
	ns := startNATS(t, nil)
	local := startProc(t, "decode", "--prefill", "local", "--nats-url", ns.url(), "--namespace", "tp-local")
	local.waitReady(readyWithin)
	name := modelName(t, local.api)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	prompts := randomPrompts(8, 12)
	// A long prompt, streamed layer by layer and resharded on the way (as
	// every prompt is by default).
	prompts = append(prompts, strings.Repeat("river stone cloud ", 40))
	reqs := make([]completionRequest, len(prompts))
	want := make([]string, len(prompts))
	for i, p := range prompts {
		reqs[i] = completionRequest{Model: name, Prompt: p + strings.Repeat(" state", i), MaxTokens: 10, Temperature: ptr(0.0)}
		if i%3 == 2 {
			reqs[i].Temperature, reqs[i].Seed = ptr(0.8), ptr(uint64(i))
		}
		b, err := complete(ctx, local.api, reqs[i])
		require.NoError(t, err)
		require.Equalf(t, http.StatusOK, b.Status, "local: %s", b.Err)
		want[i] = b.Text
	}
	for _, c := range []struct {
		name string
		p    int
		dec  []string
	}{
		{"p2d1", 2, []string{"--tp-size", "1"}},
		{"p1d2", 1, []string{"--tp-size", "2"}},
		{"p4d1", 4, []string{"--tp-size", "1"}},
		{"p1d4", 1, []string{"--tp-size", "4"}},
		{"p2d4", 2, []string{"--tp-size", "4"}},
		{"p4d2", 4, []string{"--tp-size", "2"}},
		{"p2adp2", 2, []string{"--dp-size", "2"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			space := "tp-" + c.name
			pre := startProc(t, "prefill", "--nats-url", ns.url(), "--namespace", space, "--tp-size", itoa(c.p))
			dec := startProc(t, "decode", append([]string{"--nats-url", ns.url(), "--namespace", space, "--prefill", "remote"}, c.dec...)...)
			pre.waitReady(readyWithin)
			dec.waitReady(readyWithin)
			warmUp(ctx, t, dec.api, name)
			before := sum(dec.metrics(), "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"})
			for i, req := range reqs {
				a, err := complete(ctx, dec.api, req)
				require.NoError(t, err)
				require.Equalf(t, http.StatusOK, a.Status, "remote: %s", a.Err)
				require.Equalf(t, want[i], a.Text, "prompt %d %q: remote (prefill TP %d, decode %v) and local TP 1 differ", i, req.Prompt, c.p, c.dec)
			}
			mf := dec.metrics()
			require.Equal(t, float64(len(reqs)), sum(mf, "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"})-before)
			requireIdle(t, dec, "decode")
			requireIdle(t, pre, "prefill")
			dec.kill()
			pre.kill()
		})
	}
}

// TestTPIndivisibleRefused: a TP size the model does not split over is
// refused by name, at start-up, before the worker serves.
func TestTPIndivisibleRefused(t *testing.T) {
	ns := startNATS(t, nil)
	p := startProc(t, "prefill", "--nats-url", ns.url(), "--namespace", "tp-bad", "--tp-size", "3")
	select {
	case <-p.done:
	case <-time.After(readyWithin):
		t.Fatal("prefill --tp-size 3 kept running")
	}
	require.Contains(t, p.log.String(), "2 kv heads over TP 3")
}

// TestTPPrefillKilledMidTransfer kills a TP-2 prefill worker while it
// writes into a TP-4 decode worker's shards: every request is still served
// (by the surviving TP-4 prefill worker, which reshards 4 → 4 for the retry),
// and decode's pools are idle afterwards.
func TestTPPrefillKilledMidTransfer(t *testing.T) {
	ns := startNATS(t, nil)
	common := []string{"--nats-url", ns.url(), "--namespace", "tpkill", "--model", "tiny-hybrid?prefill_delay=3ms"}
	p1 := startProc(t, "prefill", append(common, "--tp-size", "2")...)
	p2 := startProc(t, "prefill", append(common, "--tp-size", "4")...)
	dec := startProc(t, "decode", append(common, "--prefill", "remote", "--tp-size", "4")...)
	local := startProc(t, "decode", "--prefill", "local", "--nats-url", ns.url(), "--namespace", "tpkill-local", "--model", "tiny-hybrid?prefill_delay=3ms")
	p1.waitReady(readyWithin)
	p2.waitReady(readyWithin)
	dec.waitReady(readyWithin)
	local.waitReady(readyWithin)
	name := modelName(t, dec.api)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const n = 24
	var wg sync.WaitGroup
	results := make([]completion, n)
	errs := make([]error, n)
	prompts := randomPrompts(n, 13)
	reqOf := func(i int) completionRequest {
		return completionRequest{Model: name, Prompt: prompts[i] + " " + strings.Repeat("long ", 40), MaxTokens: 4, Temperature: ptr(0.0)}
	}
	for i := 0; i < n; i++ {
		wg.Go(func() { results[i], errs[i] = complete(ctx, dec.api, reqOf(i)) })
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
		b, err := complete(ctx, local.api, reqOf(i))
		require.NoError(t, err)
		require.Equalf(t, b.Text, results[i].Text, "request %d: remote and local TP 1 differ", i)
	}
	retried := sum(dec.metrics(), "handoff_retries_total", map[string]string{"role": "decode"})
	t.Logf("%v handoffs retried after the SIGKILL", retried)
	require.Positive(t, retried, "no handoff failed over: the kill did not land mid-transfer")
	requireIdle(t, dec, "decode")
	requireIdle(t, p2, "prefill")
}
