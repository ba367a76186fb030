//go:build integration

package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"
)

const readyWithin = 30 * time.Second

// modelName asks decode which model it serves.
func modelName(t *testing.T, api string) string {
	t.Helper()
	resp, err := http.Get(api + "/v1/models")
	require.NoError(t, err)
	defer resp.Body.Close()
	var out struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&out))
	require.NotEmpty(t, out.Data)
	return out.Data[0].ID
}

// warmUp waits until one completion succeeds: readiness says each worker is
// registered, and this says the pair has found each other too. Failures on the
// way are logged, so a slow start stays visible.
func warmUp(ctx context.Context, t *testing.T, api, model string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		c, err := complete(ctx, api, completionRequest{Model: model, Prompt: "warm up", MaxTokens: 1, Temperature: ptr(0.0)})
		if err == nil && c.Status == http.StatusOK {
			return
		}
		t.Logf("warm-up: status %d, %q, %v", c.Status, c.Err, err)
		if time.Now().After(deadline) {
			t.Fatalf("no completion succeeded within 15s")
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// randomPrompts returns n printable prompts of varied length from a fixed seed.
func randomPrompts(n int, seed uint64) []string {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	words := strings.Fields("the a cache block row state mamba attention prefill decode token " +
		"transfer grant epoch fence commit manifest region extent river stone cloud seven blue")
	out := make([]string, n)
	for i := range out {
		k := 1 + r.IntN(40)
		var b strings.Builder
		for j := 0; j < k; j++ {
			if j > 0 {
				b.WriteByte(' ')
			}
			b.WriteString(words[r.IntN(len(words))])
		}
		out[i] = b.String()
	}
	return out
}

// idle asserts that a worker holds no rows or blocks for requests.
func requireIdle(t *testing.T, p *proc, role string) {
	t.Helper()
	require.Eventuallyf(t, func() bool {
		mf := p.metrics()
		return sum(mf, "handoff_mamba_rows", map[string]string{"role": role, "state": "used"}) == 0 &&
			sum(mf, "handoff_kv_blocks", map[string]string{"role": role, "state": "used"}) == 0 &&
			sum(mf, "handoff_sessions_inflight", map[string]string{"role": role}) == 0
	}, 15*time.Second, 100*time.Millisecond, "%s pools did not return to idle", p.name)
}

// requireSameAnswers is the oracle's loop: each prompt goes to the
// disaggregated API remote and to the aggregated API local, greedy (OpenAI's
// default temperature is 1 with a random seed: greedy is said explicitly),
// and every third one sampled at 0.8 with its index as seed; both must
// answer 200 with the same text. what names the pair in a failure.
func requireSameAnswers(ctx context.Context, t *testing.T, remote, local, model string, prompts []string, maxTokens int, what string) {
	t.Helper()
	for i, p := range prompts {
		req := completionRequest{Model: model, Prompt: p, MaxTokens: maxTokens, Temperature: ptr(0.0)}
		if i%3 == 2 {
			req.Temperature, req.Seed = ptr(0.8), ptr(uint64(i))
		}
		a, err := complete(ctx, remote, req)
		require.NoError(t, err)
		b, err := complete(ctx, local, req)
		require.NoError(t, err)
		require.Equalf(t, http.StatusOK, a.Status, "remote: %s", a.Err)
		require.Equalf(t, http.StatusOK, b.Status, "local: %s", b.Err)
		require.Equalf(t, b.Text, a.Text, "prompt %d %q: %s differ", i, p, what)
	}
}

// TestRemoteEqualsLocal is the oracle: disaggregated output equals aggregated
// output token for token, greedy and seeded sampling alike.
func TestRemoteEqualsLocal(t *testing.T) {
	ns := startNATS(t, nil)
	pre := startProc(t, "prefill", "--nats-url", ns.url(), "--namespace", "oracle")
	remote := startProc(t, "decode", "--nats-url", ns.url(), "--namespace", "oracle", "--prefill", "remote")
	local := startProc(t, "decode", "--prefill", "local", "--nats-url", ns.url(), "--namespace", "oracle-local")
	pre.waitReady(readyWithin)
	remote.waitReady(readyWithin)
	local.waitReady(readyWithin)
	name := modelName(t, remote.api)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	warmUp(ctx, t, remote.api, name)
	before := sum(remote.metrics(), "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"})
	prompts := randomPrompts(24, 7)
	requireSameAnswers(ctx, t, remote.api, local.api, name, prompts, 12, "remote and local")
	mf := remote.metrics()
	require.Equal(t, float64(len(prompts)), sum(mf, "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"})-before)
	require.Positive(t, sum(mf, "handoff_transfer_bytes_total", map[string]string{"role": "decode", "kind": "kv"}))
	require.Positive(t, sum(mf, "handoff_transfer_bytes_total", map[string]string{"role": "decode", "kind": "mamba"}))
	requireIdle(t, remote, "decode")
	requireIdle(t, pre, "prefill")
}

// TestSeedScenario is the bug this project was born from: attention DP with
// max_batch_size=1 under skewed load. A request waiting for its cache holds the
// only real row of its rank while the idle rank (and this one) pads the ADP dummy.
func TestSeedScenario(t *testing.T) {
	ns := startNATS(t, nil)
	common := []string{"--nats-url", ns.url(), "--namespace", "seed", "--dp-size", "2", "--max-batch-size", "1",
		"--model", "tiny-hybrid?prefill_delay=2ms"}
	pre := startProc(t, "prefill", common...)
	dec := startProc(t, "decode", append(common, "--prefill", "remote")...)
	pre.waitReady(readyWithin)
	dec.waitReady(readyWithin)
	name := modelName(t, dec.api)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// Skewed: one long-running request keeps a rank busy while short ones queue behind it.
	var wg sync.WaitGroup
	const n = 16
	results := make([]completion, n)
	errs := make([]error, n)
	for i := 0; i < n; i++ {
		wg.Go(func() {
			max := 4
			if i == 0 {
				max = 64
			}
			results[i], errs[i] = complete(ctx, dec.api, completionRequest{Model: name, Prompt: fmt.Sprintf("request %d %s", i, strings.Repeat("x", i*7)), MaxTokens: max})
		})
	}
	wg.Wait()
	for i := range results {
		require.NoError(t, errs[i])
		require.Equalf(t, http.StatusOK, results[i].Status, "request %d: %s", i, results[i].Err)
	}
	dm, pm := dec.metrics(), pre.metrics()
	require.Positive(t, sum(dm, "handoff_dummy_requests_total", map[string]string{"role": "decode"}), "decode padded no dummy")
	require.Positive(t, sum(pm, "handoff_dummy_requests_total", map[string]string{"role": "prefill"}), "prefill padded no dummy")
	require.Equal(t, float64(n), sum(dm, "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"}), "transfers != requests")
	require.Equal(t, float64(n), sum(dm, "handoff_transfers_total", map[string]string{"role": "decode"}), "a transfer beyond the real requests happened")
	require.Equal(t, float64(n), sum(pm, "handoff_transfers_total", map[string]string{"role": "prefill"}), "prefill transferred more than the real requests")
	// Reserved rows: padding + ADP on each of the two ranks, never handed out.
	require.Equal(t, float64(4), sum(dm, "handoff_mamba_rows", map[string]string{"role": "decode", "state": "reserved"}))
	requireIdle(t, dec, "decode")
	requireIdle(t, pre, "prefill")
}

// TestPrefillKilledMidTransfer kills one of two prefill workers with SIGKILL
// under load. Every request must end within its deadline, and decode's pools
// must return to idle.
func TestPrefillKilledMidTransfer(t *testing.T) {
	ns := startNATS(t, nil)
	common := []string{"--nats-url", ns.url(), "--namespace", "kill", "--model", "tiny-hybrid?prefill_delay=3ms"}
	p1 := startProc(t, "prefill", common...)
	p2 := startProc(t, "prefill", common...)
	dec := startProc(t, "decode", append(common, "--prefill", "remote")...)
	p1.waitReady(readyWithin)
	p2.waitReady(readyWithin)
	dec.waitReady(readyWithin)
	name := modelName(t, dec.api)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	took, retried := loadAcrossPrefillKill(ctx, t, dec, p1, name, 11)
	t.Logf("%d requests succeeded across the SIGKILL; slowest took %v; %v handoffs retried", len(took), slices.Max(took), retried)
	require.Positive(t, retried, "no handoff failed over: the kill did not land mid-transfer")
	requireIdle(t, dec, "decode")
	// The survivor still serves.
	c, err := complete(ctx, dec.api, completionRequest{Model: name, Prompt: "after the fault", MaxTokens: 4})
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, c.Status, c.Err)
	requireIdle(t, p2, "prefill")
}

// TestDecodeKilledMidTransfer kills decode while prefill is pushing: prefill frees.
func TestDecodeKilledMidTransfer(t *testing.T) {
	ns := startNATS(t, nil)
	common := []string{"--nats-url", ns.url(), "--namespace", "killdec", "--model", "tiny-hybrid?prefill_delay=5ms"}
	pre := startProc(t, "prefill", common...)
	dec := startProc(t, "decode", append(common, "--prefill", "remote")...)
	pre.waitReady(readyWithin)
	dec.waitReady(readyWithin)
	name := modelName(t, dec.api)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i := 0; i < 6; i++ {
		go complete(ctx, dec.api, completionRequest{Model: name, Prompt: fmt.Sprintf("doomed %d %s", i, strings.Repeat("y", 200)), MaxTokens: 8})
	}
	require.Eventually(t, func() bool {
		return sum(pre.metrics(), "handoff_sessions_inflight", map[string]string{"role": "prefill"}) > 0
	}, 10*time.Second, 5*time.Millisecond, "prefill never had a session in flight")
	dec.kill()
	requireIdle(t, pre, "prefill")
	require.True(t, pre.ready(), "prefill should stay ready after its peer died")
}

// TestNATSRestart stops the NATS server: workers report not ready, reconnect
// when it is back, and serve new requests.
func TestNATSRestart(t *testing.T) {
	ns := startNATS(t, nil)
	common := []string{"--nats-url", ns.url(), "--namespace", "restart"}
	pre := startProc(t, "prefill", common...)
	dec := startProc(t, "decode", append(common, "--prefill", "remote")...)
	pre.waitReady(readyWithin)
	dec.waitReady(readyWithin)
	name := modelName(t, dec.api)

	ns.stop()
	require.Eventually(t, func() bool { return !pre.ready() && !dec.ready() }, 15*time.Second, 50*time.Millisecond,
		"readiness did not follow the NATS outage")
	ns.start()
	pre.waitReady(readyWithin)
	dec.waitReady(readyWithin)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.Eventually(t, func() bool {
		c, err := complete(ctx, dec.api, completionRequest{Model: name, Prompt: "back again", MaxTokens: 4})
		return err == nil && c.Status == http.StatusOK
	}, 20*time.Second, 200*time.Millisecond, "no request succeeded after the NATS restart")
	requireIdle(t, dec, "decode")
}

// TestNATSAuth: a server that requires credentials works with them and refuses without.
func TestNATSAuth(t *testing.T) {
	ns := startNATS(t, func(o *server.Options) {
		o.Username, o.Password = "handoff", "s3cret"
	})
	common := []string{"--nats-url", ns.url(), "--namespace", "auth"}
	pre := startProc(t, "prefill", append(common, "--nats-user", "handoff", "--nats-password", "s3cret")...)
	dec := startProc(t, "decode", append(common, "--prefill", "remote", "--nats-user", "handoff", "--nats-password", "s3cret")...)
	pre.waitReady(readyWithin)
	dec.waitReady(readyWithin)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := complete(ctx, dec.api, completionRequest{Model: modelName(t, dec.api), Prompt: "with credentials", MaxTokens: 4})
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, c.Status, c.Err)

	bad := startProc(t, "prefill", append(common, "--nats-user", "handoff", "--nats-password", "wrong")...)
	time.Sleep(2 * time.Second)
	select {
	case <-bad.done:
		// Exiting with an error is an acceptable refusal.
	default:
		require.False(t, bad.ready(), "a worker with wrong credentials must not be ready")
	}
	require.True(t, strings.Contains(strings.ToLower(bad.log.String()), "authorization"),
		"the refusal should be logged by name:\n%s", tail(bad.log.String(), 2000))
}

// TestNATSRestartMidLoad restarts the single NATS server while requests are
// in flight, several times. A request whose prefill request or reply was in
// flight when the connections dropped is resent, fenced, once they are back,
// and one sent before the prefill worker resubscribed is sent again: every
// request succeeds (none ends at its timeout), and the pools return to idle.
func TestNATSRestartMidLoad(t *testing.T) {
	ns := startNATS(t, nil)
	common := []string{"--nats-url", ns.url(), "--namespace", "restartload", "--model", "tiny-hybrid?prefill_delay=20ms"}
	pre := startProc(t, "prefill", common...)
	dec := startProc(t, "decode", append(common, "--prefill", "remote", "--request-timeout", "30s")...)
	pre.waitReady(readyWithin)
	dec.waitReady(readyWithin)
	name := modelName(t, dec.api)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	warmUp(ctx, t, dec.api, name)

	for round := range 3 {
		const n = 40
		var wg sync.WaitGroup
		results := make([]completion, n)
		errs := make([]error, n)
		took := make([]time.Duration, n)
		for i := 0; i < n; i++ {
			wg.Go(func() {
				start := time.Now()
				prompt := fmt.Sprintf("round %d request %d", round, i)
				results[i], errs[i] = complete(ctx, dec.api, completionRequest{Model: name, Prompt: prompt, MaxTokens: 2})
				took[i] = time.Since(start)
			})
			time.Sleep(10 * time.Millisecond)
			if i == n/2 {
				ns.stop()
				time.Sleep(500 * time.Millisecond)
				ns.start()
			}
		}
		wg.Wait()
		// A request whose message was lost and never resent would end at
		// its timeout with 504: every one must be 200.
		for i := range results {
			require.NoError(t, errs[i], "round %d: request %d got no HTTP answer", round, i)
			require.Equal(t, http.StatusOK, results[i].Status, "round %d: request %d (after %v): %s", round, i, took[i], results[i].Err)
		}
		t.Logf("round %d: %d requests across a NATS restart, all 200, slowest %v", round, n, slices.Max(took))
	}
	requireIdle(t, dec, "decode")
	requireIdle(t, pre, "prefill")
}

// startNATSCluster starts n routed nats-servers with JetStream on loopback,
// each restartable on its ports. Every node is configured with every
// node's route port before the first starts (JetStream clustering wants
// its routes configured), so the route ports are reserved (reservePort).
func startNATSCluster(t *testing.T, n int) []*natsServer {
	t.Helper()
	routePorts := make([]int, n)
	for i := range routePorts {
		routePorts[i] = reservePort(t)
	}
	var routes []string
	for _, p := range routePorts {
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", p))
	}
	nodes := make([]*natsServer, n)
	for i := range nodes {
		nodes[i] = startNATS(t, func(o *server.Options) {
			o.ServerName = fmt.Sprintf("node%d", i)
			o.Cluster = server.ClusterOpts{Name: "handoff-it", Host: "127.0.0.1", Port: routePorts[i]}
			o.Routes = server.RoutesFromStr(strings.Join(routes, ","))
		})
	}
	return nodes
}

// TestNATSClusterNodeLoss spreads the workers over a 3-node NATS cluster and
// kills nodes in turn under load (one down at a time, the first back before
// the second goes): every request is served and the pools end idle.
func TestNATSClusterNodeLoss(t *testing.T) {
	nodes := startNATSCluster(t, 3)
	urls := func(first int) string {
		var u []string
		for i := range nodes {
			u = append(u, nodes[(first+i)%len(nodes)].url())
		}
		return strings.Join(u, ",")
	}
	common := []string{"--namespace", "cluster", "--model", "tiny-hybrid?prefill_delay=5ms"}
	p1 := startProc(t, "prefill", append(common, "--nats-url", urls(0))...)
	p2 := startProc(t, "prefill", append(common, "--nats-url", urls(1))...)
	dec := startProc(t, "decode", append(common, "--nats-url", urls(2), "--prefill", "remote")...)
	for _, p := range []*proc{p1, p2, dec} {
		p.waitReady(readyWithin)
	}
	name := modelName(t, dec.api)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	warmUp(ctx, t, dec.api, name)

	for round, victim := range []int{0, 2, 1} {
		const n = 30
		var wg sync.WaitGroup
		results := make([]completion, n)
		errs := make([]error, n)
		took := make([]time.Duration, n)
		for i := 0; i < n; i++ {
			wg.Go(func() {
				start := time.Now()
				results[i], errs[i] = complete(ctx, dec.api, completionRequest{Model: name, Prompt: fmt.Sprintf("node loss %d.%d", round, i), MaxTokens: 2})
				took[i] = time.Since(start)
			})
			time.Sleep(10 * time.Millisecond)
			if i == n/2 {
				nodes[victim].stop()
			}
		}
		wg.Wait()
		for i := range results {
			require.NoError(t, errs[i], "round %d: request %d got no HTTP answer", round, i)
			require.Equal(t, http.StatusOK, results[i].Status, "round %d (node%d down): request %d (after %v): %s", round, victim, i, took[i], results[i].Err)
		}
		t.Logf("round %d: node%d killed under load: %d requests, all 200, slowest %v", round, victim, n, slices.Max(took))
		nodes[victim].start()
	}
	requireIdle(t, dec, "decode")
	requireIdle(t, p1, "prefill")
	requireIdle(t, p2, "prefill")
}

// loadAcrossPrefillKill sends 24 concurrent completions to dec and SIGKILLs
// prefill worker p1 once it has a session of its own in flight, a third of
// the way through: not before or after its share of the load. Every request
// must be answered 200 well within any sane deadline (one the dead worker
// held is retried on a survivor). It returns each request's time and the
// decode's retries.
func loadAcrossPrefillKill(ctx context.Context, t *testing.T, dec, p1 *proc, name string, seed uint64) ([]time.Duration, float64) {
	t.Helper()
	const n = 24
	var wg sync.WaitGroup
	results := make([]completion, n)
	errs := make([]error, n)
	took := make([]time.Duration, n)
	prompts := randomPrompts(n, seed)
	for i := 0; i < n; i++ {
		wg.Go(func() {
			start := time.Now()
			results[i], errs[i] = complete(ctx, dec.api, completionRequest{Model: name, Prompt: prompts[i] + " " + strings.Repeat("long ", 40), MaxTokens: 4})
			took[i] = time.Since(start)
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
		require.Less(t, took[i], 60*time.Second, "request %d outlived any sane deadline", i)
		require.Equal(t, http.StatusOK, results[i].Status, "request %d was not served by the survivor: %s", i, results[i].Err)
	}
	return took, sum(dec.metrics(), "handoff_retries_total", map[string]string{"role": "decode"})
}
