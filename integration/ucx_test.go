//go:build integration && ucx

package integration

// The ucx transport between the real binaries: the oracle (disaggregated
// output equals aggregated output, token for token) and a prefill worker
// killed while it serves, with both workers on --transport ucx. Run with
// -tags 'integration ucx' where UCX is installed (scripts/install-ucx);
// UCX picks its transports from the environment (UCX_TLS=tcp, or
// UCX_TLS=cma,tcp with UCX_CMA_MEMORY_INVALIDATE=y), which the workers
// inherit.

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// ucxBins holds the binaries built with -tags ucx, once, in a folder under
// binDir (TestMain removes it with binDir).
var ucxBins struct {
	once sync.Once
	dir  string
	err  error
	out  []byte
}

// useUCXBinaries makes startProc run the ucx build of prefill and decode
// for the rest of t. The tests of this package run one at a time (none is
// parallel), so swapping binDir is safe.
func useUCXBinaries(t *testing.T) {
	t.Helper()
	ucxBins.once.Do(func() {
		ucxBins.dir = filepath.Join(binDir, "ucx")
		cmd := exec.Command("go", "build", "-tags", "ucx", "-o", ucxBins.dir+"/", "../cmd/prefill", "../cmd/decode")
		ucxBins.out, ucxBins.err = cmd.CombinedOutput()
	})
	require.NoError(t, ucxBins.err, "building prefill and decode with -tags ucx (needs cgo and libucx-dev: scripts/install-ucx):\n%s", ucxBins.out)
	old := binDir
	binDir = ucxBins.dir
	t.Cleanup(func() { binDir = old })
}

// requireUCX asserts that a worker runs the ucx transport.
func requireUCX(t *testing.T, p *proc) {
	t.Helper()
	require.Equal(t, float64(1), sum(p.metrics(), "handoff_transport_info", map[string]string{"transport": "ucx"}),
		"%s does not say it runs ucx", p.name)
}

// TestUCXRemoteEqualsLocal is the oracle over ucx: a prefill and a decode
// process that move every KV block and Mamba row through UCX answer as an
// aggregated worker does, greedy and seeded sampling alike.
func TestUCXRemoteEqualsLocal(t *testing.T) {
	useUCXBinaries(t)
	ns := startNATS(t, nil)
	common := []string{"--nats-url", ns.url(), "--namespace", "ucx-oracle", "--transport", "ucx"}
	pre := startProc(t, "prefill", common...)
	remote := startProc(t, "decode", append(common, "--prefill", "remote")...)
	local := startProc(t, "decode", "--prefill", "local", "--nats-url", ns.url(), "--namespace", "ucx-oracle-local")
	pre.waitReady(readyWithin)
	remote.waitReady(readyWithin)
	local.waitReady(readyWithin)
	name := modelName(t, remote.api)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	warmUp(ctx, t, remote.api, name)
	requireUCX(t, pre) // set once a worker met its peer
	requireUCX(t, remote)
	before := sum(remote.metrics(), "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"})
	prompts := randomPrompts(24, 29)
	requireSameAnswers(ctx, t, remote.api, local.api, name, prompts, 12, "ucx remote and local")
	mf := remote.metrics()
	require.Equal(t, float64(len(prompts)), sum(mf, "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"})-before)
	require.Positive(t, sum(mf, "handoff_transfer_bytes_total", map[string]string{"role": "decode", "kind": "kv"}))
	require.Positive(t, sum(mf, "handoff_transfer_bytes_total", map[string]string{"role": "decode", "kind": "mamba"}))
	requireIdle(t, remote, "decode")
	requireIdle(t, pre, "prefill")
}

// TestUCXPrefillKilledMidTransfer kills one of two prefill workers with
// SIGKILL while it serves, over ucx: every request ends well within its
// deadline and is served (one the dead worker held is retried on the
// survivor, fenced: its grant revoked, nothing of the dead writer's landing
// after), and both survivors' pools return to idle.
func TestUCXPrefillKilledMidTransfer(t *testing.T) {
	useUCXBinaries(t)
	ns := startNATS(t, nil)
	common := []string{"--nats-url", ns.url(), "--namespace", "ucx-kill", "--transport", "ucx", "--model", "tiny-hybrid?prefill_delay=3ms"}
	p1 := startProc(t, "prefill", common...)
	p2 := startProc(t, "prefill", common...)
	dec := startProc(t, "decode", append(common, "--prefill", "remote")...)
	p1.waitReady(readyWithin)
	p2.waitReady(readyWithin)
	dec.waitReady(readyWithin)
	name := modelName(t, dec.api)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	warmUp(ctx, t, dec.api, name)
	requireUCX(t, dec)
	took, retried := loadAcrossPrefillKill(ctx, t, dec, p1, name, 31)
	t.Logf("%d requests succeeded across the SIGKILL over ucx (UCX_TLS=%q); slowest took %v; %v handoffs retried", len(took), os.Getenv("UCX_TLS"), slices.Max(took), retried)
	require.Positive(t, retried, "no handoff failed over: the kill did not land mid-transfer")
	requireIdle(t, dec, "decode")
	c, err := complete(ctx, dec.api, completionRequest{Model: name, Prompt: "after the fault", MaxTokens: 4})
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, c.Status, c.Err)
	requireIdle(t, p2, "prefill")
}

// TestUCXLayerwiseTPOracle is the oracle over ucx where
// prefill and decode split the model differently (prefill TP 2, decode
// TP 1: each decode rank gathers its cache from two writers) and where
// prefill streams the cache layer by layer while it computes (--layerwise
// on), whole prompts at once and in chunks: the answers equal the
// aggregated ones, token for token, and the pools return to idle.
func TestUCXLayerwiseTPOracle(t *testing.T) {
	useUCXBinaries(t)
	ns := startNATS(t, nil)
	local := startProc(t, "decode", "--prefill", "local", "--nats-url", ns.url(), "--namespace", "ucx-lw-local")
	local.waitReady(readyWithin)
	for _, c := range []struct {
		name      string
		p, d      int
		layerwise bool
		args      []string
	}{
		{"p2d1", 2, 1, false, nil},
		{"lw", 1, 1, true, nil},
		{"lw-chunked", 1, 1, true, []string{"--prefill-chunk-tokens", "7"}},
		{"p2d1-lw-chunked", 2, 1, true, []string{"--prefill-chunk-tokens", "16"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			space := "ucx-lw-" + c.name
			common := append([]string{"--nats-url", ns.url(), "--namespace", space, "--transport", "ucx", "--model", "tiny-hybrid?prefill_delay=1ms"}, c.args...)
			lw := "off"
			if c.layerwise {
				lw = "on"
			}
			preArgs := append(common, "--tp-size", itoa(c.p), "--layerwise", lw)
			pre := startProc(t, "prefill", preArgs...)
			remote := startProc(t, "decode", append(common, "--prefill", "remote", "--tp-size", itoa(c.d))...)
			pre.waitReady(readyWithin)
			remote.waitReady(readyWithin)
			name := modelName(t, remote.api)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			warmUp(ctx, t, remote.api, name)
			requireUCX(t, pre)
			requireUCX(t, remote)
			before := sum(remote.metrics(), "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"})
			prompts := randomPrompts(12, 29)
			for i := range prompts {
				prompts[i] += strings.Repeat(" river", 2+4*i)
			}
			requireSameAnswers(ctx, t, remote.api, local.api, name, prompts, 8,
				fmt.Sprintf("ucx remote (prefill TP %d, decode TP %d, layer-wise %v) and local", c.p, c.d, c.layerwise))
			require.Equal(t, float64(len(prompts)), sum(remote.metrics(), "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"})-before)
			mf := pre.metrics()
			streamed := sum(mf, "handoff_transfer_streamed_bytes_total", map[string]string{"role": "prefill"})
			moved := sum(mf, "handoff_transfer_bytes_total", map[string]string{"role": "prefill"})
			t.Logf("%.0f of %.0f bytes left while prefill computed (UCX_TLS=%q)", streamed, moved, os.Getenv("UCX_TLS"))
			require.Positive(t, moved)
			if c.layerwise {
				require.Positive(t, streamed, "nothing was streamed: the cache went in one write")
				require.LessOrEqual(t, streamed, moved)
			} else {
				require.Zero(t, streamed, "--layerwise off streamed")
			}
			requireIdle(t, remote, "decode")
			requireIdle(t, pre, "prefill")
		})
	}
}

// TestUCXDecodeKilledMidWrite kills the decode worker (SIGKILL) while
// prefill writes caches into it over ucx, once while prefill pushes whole
// caches and once while it streams them layer by layer: prefill fences and
// frees every session it held, stays ready, and serves a new decode worker
// that joins afterwards.
func TestUCXDecodeKilledMidWrite(t *testing.T) {
	useUCXBinaries(t)
	ns := startNATS(t, nil)
	for _, c := range []struct {
		name string
		args []string // prefill's own
	}{
		{"push", nil},
		{"layerwise-chunked", []string{"--layerwise", "on", "--prefill-chunk-tokens", "64"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			common := []string{"--nats-url", ns.url(), "--namespace", "ucx-killdec-" + c.name, "--transport", "ucx", "--model", "tiny-hybrid?prefill_delay=5ms"}
			pre := startProc(t, "prefill", append(common, c.args...)...)
			dec := startProc(t, "decode", append(common, "--prefill", "remote")...)
			pre.waitReady(readyWithin)
			dec.waitReady(readyWithin)
			name := modelName(t, dec.api)

			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			warmUp(ctx, t, dec.api, name)
			requireUCX(t, pre)
			requireUCX(t, dec)
			before := sum(pre.metrics(), "handoff_transfer_bytes_total", map[string]string{"role": "prefill"})
			for i := 0; i < 6; i++ {
				go complete(ctx, dec.api, completionRequest{Model: name, Prompt: fmt.Sprintf("doomed %d %s", i, strings.Repeat("y", 200)), MaxTokens: 8})
			}
			// Kill decode while prefill has a session in its push (or
			// stream) and has written bytes of this batch into decode.
			require.Eventually(t, func() bool {
				mf := pre.metrics()
				return sum(mf, "handoff_sessions_inflight", map[string]string{"role": "prefill"}) > 0 &&
					sum(mf, "handoff_transfer_bytes_total", map[string]string{"role": "prefill"})+
						sum(mf, "handoff_transfer_streamed_bytes_total", map[string]string{"role": "prefill"}) > before
			}, 30*time.Second, time.Millisecond, "prefill never wrote into decode")
			dec.kill()
			requireIdle(t, pre, "prefill")
			require.True(t, pre.ready(), "prefill should stay ready after its peer died")
			mf := pre.metrics()
			ok := sum(mf, "handoff_transfers_total", map[string]string{"role": "prefill", "result": "ok"})
			failed := sum(mf, "handoff_transfers_total", map[string]string{"role": "prefill"}) - ok
			t.Logf("prefill's transfers after the kill (UCX_TLS=%q): ok %v, failed %v", os.Getenv("UCX_TLS"), ok, failed)
			require.Positive(t, failed, "no transfer of prefill failed: the kill did not land mid-write")

			// A new decode worker is served by the same prefill.
			dec2 := startProc(t, "decode", append(common, "--prefill", "remote")...)
			dec2.waitReady(readyWithin)
			for i := 0; i < 4; i++ {
				c, err := complete(ctx, dec2.api, completionRequest{Model: name, Prompt: fmt.Sprintf("after the fault %d %s", i, strings.Repeat("z", 50)), MaxTokens: 4})
				require.NoError(t, err)
				require.Equal(t, http.StatusOK, c.Status, c.Err)
			}
			requireUCX(t, dec2)
			require.Equal(t, float64(4), sum(dec2.metrics(), "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"}),
				"the new decode's requests did not go through the prefill worker")
			requireIdle(t, dec2, "decode")
			requireIdle(t, pre, "prefill")
		})
	}
}
