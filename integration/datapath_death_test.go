//go:build integration

package integration

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestDataPathResetThenDeath: the lone prefill instance's write is cut by a
// data-path reset; the decoder retries it fenced, through the queue group
// (it knows no other instance), where the same instance takes it again; that
// instance is then killed while it computes the retry. The decoder learns of
// the death within milliseconds, and the request must end within a second
// of the kill, not at its deadline (30 s): with --prefill remote it fails
// cleanly (5xx with a message, pools idle); with --prefill auto it is
// prefilled locally and its output equals the aggregated worker's.
func TestDataPathResetThenDeath(t *testing.T) {
	ns := startNATS(t, nil)
	local := startProc(t, "decode", "--prefill", "local", "--nats-url", ns.url(), "--namespace", "death-local")
	local.waitReady(readyWithin)
	name := modelName(t, local.api)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	prompt := "a prompt long enough for a remote prefill " + strings.Repeat("death ", 12)
	req := completionRequest{Model: name, Prompt: prompt, MaxTokens: 4, Temperature: ptr(0.0)}
	oracle, err := complete(ctx, local.api, req)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, oracle.Status, oracle.Err)

	for _, mode := range []string{"remote", "auto"} {
		t.Run(mode, func(t *testing.T) {
			space := "death-" + mode
			common := []string{"--nats-url", ns.url(), "--namespace", space, "--transport", "tcp"}
			dataPort := reservePort(t) // the proxy must know it before decode starts
			px := startDataPathProxy(t, fmt.Sprintf("127.0.0.1:%d", dataPort))
			// The prefill worker computes 4 ms a token, about 450 ms for the
			// prompt: the window in which it is killed during the retry.
			// (The delay is simulated time, not layout: decode's own
			// prefill, the fallback, runs at full speed.)
			pre := startProc(t, "prefill", append(common, "--model", "tiny-hybrid?prefill_delay=4ms")...)
			args := append(common, "--prefill", mode, "--request-timeout", "30s",
				"--data-addr", fmt.Sprintf("127.0.0.1:%d", dataPort), "--data-advertise", px.proxy.Listen)
			if mode == "auto" {
				args = append(args, "--prefill-auto-min-tokens", "16")
			}
			dec := startProc(t, "decode", args...)
			pre.waitReady(readyWithin)
			dec.waitReady(readyWithin)
			transfers := func() float64 {
				return sum(dec.metrics(), "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"})
			}
			// A remote handoff first, so the data path is up and, with
			// auto, decode knows the prefill instance.
			for transfers() == 0 {
				require.NoError(t, ctx.Err(), "no request was prefilled remotely")
				c, err := complete(ctx, dec.api, req)
				require.NoError(t, err)
				require.Equal(t, http.StatusOK, c.Status, c.Err)
				require.Equal(t, oracle.Text, c.Text)
			}
			retries := func() float64 { return sum(dec.metrics(), "handoff_retries_total", nil) }
			r0 := retries()

			remove := px.add("reset_peer", `{"timeout":0}`)
			type result struct {
				c   completion
				err error
				at  time.Time
			}
			done := make(chan result, 1)
			go func() {
				c, err := complete(ctx, dec.api, req)
				done <- result{c, err, time.Now()}
			}()
			// The write is reset and retried: the retry went to the
			// queue group and is computing on the same instance.
			require.Eventually(t, func() bool { return retries() > r0 }, 10*time.Second, 5*time.Millisecond,
				"the reset write was not retried")
			remove()
			pre.kill()
			killed := time.Now()
			var r result
			select {
			case r = <-done:
			case <-time.After(35 * time.Second):
				t.Fatal("the request never ended")
			}
			require.NoError(t, r.err)
			took := r.at.Sub(killed)
			t.Logf("%s: request ended %v after the kill: %d %s", mode, took, r.c.Status, r.c.Err)
			require.Less(t, took, time.Second, "the request waited for its deadline after its prefill instance died")
			if mode == "auto" {
				require.Equal(t, http.StatusOK, r.c.Status, r.c.Err)
				require.Equal(t, oracle.Text, r.c.Text, "the local fallback differs from the aggregated worker")
				require.Equal(t, 1.0, sum(dec.metrics(), "handoff_prefill_routes_total",
					map[string]string{"role": "decode", "route": "local", "reason": "remote_failed"}))
			} else {
				require.GreaterOrEqual(t, r.c.Status, 500, r.c.Err)
				require.NotEmpty(t, r.c.Err)
			}
			requireIdle(t, dec, "decode")
		})
	}
}
