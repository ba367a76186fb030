//go:build integration

package integration

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/Shopify/toxiproxy/v2"
	"github.com/Shopify/toxiproxy/v2/collectors"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"
)

// dataPathProxy is a Toxiproxy proxy in front of a decode worker's tcp data
// port: the prefill workers dial it (decode advertises it), so every byte of
// the data path crosses it and its toxics.
type dataPathProxy struct {
	t     *testing.T
	proxy *toxiproxy.Proxy
}

// startDataPathProxy starts the proxy on a port of its own choosing
// (proxy.Listen, once started) in front of upstream.
func startDataPathProxy(t *testing.T, upstream string) *dataPathProxy {
	t.Helper()
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
	srv.Metrics.ProxyMetrics = collectors.NewProxyMetricCollectors()
	p := toxiproxy.NewProxy(srv, "data", "127.0.0.1:0", upstream)
	require.NoError(t, p.Start())
	t.Cleanup(p.Stop)
	return &dataPathProxy{t: t, proxy: p}
}

// add adds a toxic on both directions; the returned func removes it.
func (d *dataPathProxy) add(kind string, attrs string) func() {
	d.t.Helper()
	var names []string
	for _, stream := range []string{"upstream", "downstream"} {
		name := kind + "_" + stream
		_, err := d.proxy.Toxics.AddToxicJson(strings.NewReader(fmt.Sprintf(
			`{"name":%q,"type":%q,"stream":%q,"toxicity":1,"attributes":%s}`, name, kind, stream, attrs)))
		require.NoError(d.t, err, "toxic %s", name)
		names = append(names, name)
	}
	return func() {
		for _, n := range names {
			require.NoError(d.t, d.proxy.Toxics.RemoveToxic(context.Background(), n))
		}
	}
}

// TestDataPathFaults runs real prefill and decode workers whose tcp data path
// crosses a Toxiproxy proxy, and injects in turn: latency, a bandwidth cap, a
// reset of the connections mid-stream, and a half-open link (bytes dropped,
// no FIN, no RST). Every request must end within its deadline; a request that
// succeeds must match the aggregated worker token for token (nothing landed
// that should not have); both workers' pools end idle, and once the fault is
// gone the next requests succeed.
func TestDataPathFaults(t *testing.T) {
	ns := startNATS(t, nil)
	common := []string{"--nats-url", ns.url(), "--namespace", "faults", "--transport", "tcp",
		"--model", "tiny-hybrid?prefill_delay=1ms"}
	// The proxy forwards to decode's data port, so that port is known
	// before decode starts: reserved (reservePort), not picked by decode.
	dataPort := reservePort(t)
	px := startDataPathProxy(t, fmt.Sprintf("127.0.0.1:%d", dataPort))
	const timeout = 8 * time.Second
	pre := startProc(t, "prefill", common...)
	dec := startProc(t, "decode", append(common, "--prefill", "remote", "--request-timeout", timeout.String(),
		"--data-addr", fmt.Sprintf("127.0.0.1:%d", dataPort), "--data-advertise", px.proxy.Listen)...)
	local := startProc(t, "decode", "--prefill", "local", "--nats-url", ns.url(), "--namespace", "faults-local")
	for _, p := range []*proc{pre, dec, local} {
		p.waitReady(readyWithin)
	}
	name := modelName(t, dec.api)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	warmUp(ctx, t, dec.api, name)

	// want holds the aggregated worker's answer for each prompt.
	prompts := randomPrompts(12, 23)
	for i := range prompts {
		prompts[i] += " " + strings.Repeat("fault ", 8+i*3)
	}
	want := make([]string, len(prompts))
	for i, p := range prompts {
		c, err := complete(ctx, local.api, completionRequest{Model: name, Prompt: p, MaxTokens: 4, Temperature: ptr(0.0)})
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, c.Status, c.Err)
		want[i] = c.Text
	}

	// burst sends every prompt at once while fault runs beside them, and
	// checks every answer; it returns how many succeeded.
	burst := func(label string, during func()) int {
		t.Helper()
		var wg sync.WaitGroup
		results := make([]completion, len(prompts))
		errs := make([]error, len(prompts))
		took := make([]time.Duration, len(prompts))
		for i, p := range prompts {
			wg.Go(func() {
				start := time.Now()
				results[i], errs[i] = complete(ctx, dec.api, completionRequest{Model: name, Prompt: p, MaxTokens: 4, Temperature: ptr(0.0)})
				took[i] = time.Since(start)
			})
		}
		if during != nil {
			during()
		}
		wg.Wait()
		ok := 0
		failed := map[string]int{} // why requests failed, for the log
		for i := range results {
			require.NoError(t, errs[i], "%s: request %d got no HTTP answer", label, i)
			// The handoff's deadline, plus the decode steps and slack
			// for a loaded machine.
			require.Less(t, took[i], timeout+5*time.Second, "%s: request %d outlived its deadline", label, i)
			if results[i].Status == http.StatusOK {
				require.Equal(t, want[i], results[i].Text, "%s: request %d differs from the aggregated worker", label, i)
				ok++
				continue
			}
			require.GreaterOrEqual(t, results[i].Status, 500, "%s: request %d: %s", label, i, results[i].Err)
			require.NotEmpty(t, results[i].Err, "%s: request %d failed without a message", label, i)
			failed[fmt.Sprintf("%d %s", results[i].Status, results[i].Err)]++
		}
		t.Logf("%s: %d of %d served, slowest %v", label, ok, len(prompts), slices.Max(took))
		for why, n := range failed {
			t.Logf("%s: %d failed: %s", label, n, why)
		}
		requireIdle(t, dec, "decode")
		requireIdle(t, pre, "prefill")
		return ok
	}
	healthy := func(label string) {
		t.Helper()
		// The workers may still be reconnecting the data path.
		require.Eventually(t, func() bool { return burst(label, nil) == len(prompts) }, 30*time.Second, 100*time.Millisecond,
			"%s: requests still fail after the fault was removed", label)
	}

	healthy("before any fault")

	// Latency and a bandwidth cap slow the data path down; nothing fails.
	remove := px.add("latency", `{"latency":20,"jitter":5}`)
	require.Equal(t, len(prompts), burst("20 ms latency", nil))
	remove()
	remove = px.add("bandwidth", `{"rate":2048}`) // KB/s
	require.Equal(t, len(prompts), burst("2 MB/s bandwidth cap", nil))
	remove()

	// Connections reset while bytes flow: requests in flight fail or are
	// retried fenced; none outlives its deadline, none delivers wrong bytes.
	burst("connections reset mid-stream", func() {
		time.Sleep(5 * time.Millisecond)
		remove := px.add("reset_peer", `{"timeout":0}`)
		time.Sleep(300 * time.Millisecond)
		remove()
	})
	healthy("after the resets")

	// A half-open link: every byte dropped, the connections left open (no
	// FIN, no RST), for longer than the handoff's deadline.
	burst("half-open link", func() {
		remove := px.add("timeout", `{"timeout":0}`)
		time.Sleep(timeout + time.Second)
		remove()
	})
	healthy("after the half-open link")
}
