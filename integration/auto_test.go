//go:build integration

package integration

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestPrefillAuto runs decode --prefill auto against a real prefill worker:
// short prompts are prefilled by decode itself, long ones by the prefill
// worker (their caches transferred), and once the prefill worker is gone
// long ones are prefilled locally too, without a failed request. Every
// output equals the aggregated worker's, and the routes are counted.
func TestPrefillAuto(t *testing.T) {
	ns := startNATS(t, nil)
	pre := startProc(t, "prefill", "--nats-url", ns.url(), "--namespace", "auto")
	auto := startProc(t, "decode", "--nats-url", ns.url(), "--namespace", "auto", "--prefill", "auto",
		"--prefill-auto-min-tokens", "64")
	local := startProc(t, "decode", "--prefill", "local", "--nats-url", ns.url(), "--namespace", "auto-local")
	pre.waitReady(readyWithin)
	auto.waitReady(readyWithin)
	local.waitReady(readyWithin)
	name := modelName(t, auto.api)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	routes := func(route, reason string) float64 {
		return sum(auto.metrics(), "handoff_prefill_routes_total", map[string]string{"role": "decode", "route": route, "reason": reason})
	}
	transfers := func() float64 {
		return sum(auto.metrics(), "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"})
	}
	same := func(prompt string) {
		t.Helper()
		req := completionRequest{Model: name, Prompt: prompt, MaxTokens: 8, Temperature: ptr(0.0)}
		a, err := complete(ctx, auto.api, req)
		require.NoError(t, err)
		b, err := complete(ctx, local.api, req)
		require.NoError(t, err)
		require.Equalf(t, http.StatusOK, a.Status, "auto: %s", a.Err)
		require.Equalf(t, http.StatusOK, b.Status, "local: %s", b.Err)
		require.Equalf(t, b.Text, a.Text, "prompt %q: auto and local differ", prompt)
	}
	long := func(i int) string { return strings.Repeat("long prompt, remote prefill ", 3) + itoa(i) }

	// Decode learns of the prefill worker from the registry: until then a
	// long prompt is prefilled here (no_prefill).
	require.Eventually(t, func() bool {
		same(long(0))
		return routes("remote", "long_prompt") > 0
	}, 15*time.Second, 100*time.Millisecond, "no long prompt was sent to the prefill worker")

	r0, l0, x0 := routes("remote", "long_prompt"), routes("local", "short_prompt"), transfers()
	prompts := randomPrompts(6, 3) // 1-40 words, but cut below 64 bytes
	for i, p := range prompts {
		if len(p) >= 60 {
			p = p[:60]
		}
		same(p)
		same(long(i + 1))
	}
	require.Equal(t, float64(len(prompts)), routes("local", "short_prompt")-l0)
	require.Equal(t, float64(len(prompts)), routes("remote", "long_prompt")-r0)
	require.Equal(t, float64(len(prompts)), transfers()-x0, "only the long prompts' caches were transferred")

	// The prefill worker dies: every request still succeeds, prefilled here
	// (remote_failed when it died under the request, remote_refused while
	// the registry still lists it, no_prefill once its entry expired).
	pre.kill()
	require.Eventually(t, func() bool {
		same(long(100))
		return routes("local", "no_prefill") > 0
	}, 30*time.Second, 200*time.Millisecond, "long prompts still go remote after the prefill worker died")
	requireIdle(t, auto, "decode")
}
