package service

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/worker"
)

// TestRemoteSpeculativeMatchesLocal is issue 32's oracle in process: a
// remote-prefill decode worker with speculative decoding (the n-gram
// drafter) gives, greedy and sampled with a seed, exactly the output of a
// local-prefill decode worker without it: with attention DP 2 and
// max_batch_size 1 (the seed's scenario, now with drafts and a
// draft-length schedule), and with TP 2 prefill to TP 1 decode, for the
// n-gram drafter and the model's draft head (MTP). The
// drafts are accepted sometimes, and the decode pools hold one padding row
// per reachable draft length plus the ADP row, all reserved, and end with
// every real row free. The counts are checked after a round of one
// request at a time, whose batches do not depend on timing.
func TestRemoteSpeculativeMatchesLocal(t *testing.T) {
	const mtpModel = "tiny-hybrid?mtp=1"
	cases := []struct {
		name       string
		prefill    []string
		decode     []string
		ranks      int
		reserved   float64
		realPerRnk float64
	}{
		{"adp dp 2 mbs 1", []string{"--dp-size", "2", "--max-batch-size", "1"},
			[]string{"--dp-size", "2", "--max-batch-size", "1", "--draft-len-schedule", "1:4,2:2,8:0"}, 2, 1 + 1, 1},
		{"adp dp 2 mbs 4, three lengths", []string{"--dp-size", "2", "--max-batch-size", "4"},
			[]string{"--dp-size", "2", "--max-batch-size", "4", "--draft-len-schedule", "1:4,2:2,3:0"}, 2, 3 + 1, 4},
		{"tp 2 to 1", []string{"--tp-size", "2", "--max-batch-size", "2"},
			[]string{"--max-batch-size", "2"}, 1, 1, 2},
		{"tp 1 to 2", []string{"--max-batch-size", "2"},
			[]string{"--tp-size", "2", "--max-batch-size", "2"}, 1, 1, 2},
		{"layer-wise streaming, prefill auto", []string{"--layerwise", "on", "--max-batch-size", "2"},
			[]string{"--max-batch-size", "2", "--prefill", "auto", "--prefill-auto-min-tokens", "8"}, 1, 1, 2},
		{"acceptance gate", []string{"--dp-size", "2", "--max-batch-size", "2"},
			[]string{"--dp-size", "2", "--max-batch-size", "2", "--acceptance-rate-window", "4", "--acceptance-rate-threshold", "0.2"}, 2, 2 + 1, 2},
		// The draft head (MTP): prefill and decode run tiny-hybrid with its
		// head, whose draft-layer KV travels with the blocks; the local
		// oracle runs plain tiny-hybrid.
		{"mtp adp dp 2 mbs 1", []string{"--model", mtpModel, "--dp-size", "2", "--max-batch-size", "1"},
			[]string{"--speculative", "mtp", "--dp-size", "2", "--max-batch-size", "1", "--draft-len-schedule", "1:4,2:2,8:0"}, 2, 1 + 1, 1},
		{"mtp tp 2 to 1", []string{"--model", mtpModel, "--tp-size", "2", "--max-batch-size", "2"},
			[]string{"--speculative", "mtp", "--max-batch-size", "2"}, 1, 1, 2},
		{"mtp tp 1 to 2", []string{"--model", mtpModel, "--max-batch-size", "2"},
			[]string{"--speculative", "mtp", "--tp-size", "2", "--max-batch-size", "2"}, 1, 1, 2},
		{"mtp layer-wise streaming, prefill auto", []string{"--model", mtpModel, "--layerwise", "on", "--max-batch-size", "2"},
			[]string{"--speculative", "mtp", "--max-batch-size", "2", "--prefill", "auto", "--prefill-auto-min-tokens", "8"}, 1, 1, 2},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ns, err := StartEmbeddedNATS(-1)
			require.NoError(t, err)
			t.Cleanup(ns.Shutdown)
			common := []string{"--nats-url", ns.URL(), "--transport", "tcp", "--namespace", fmt.Sprintf("spec-%d", i)}
			method, spec := "ngram", []string{"--speculative", "ngram", "--num-speculative-tokens", "4"}
			local := tc.prefill
			if slices.Contains(tc.decode, "mtp") {
				method, spec = "mtp", []string{"--model", mtpModel, "--num-speculative-tokens", "4"}
				local = tc.prefill[2:] // plain tiny-hybrid
			}
			startWorker(t, testConfig(t, worker.RolePrefill, append(common, tc.prefill...)...))
			rep, _ := startWorker(t, testConfig(t, worker.RoleDecode, append(append(append(common, "--prefill", "remote"), spec...), tc.decode...)...))
			lep, _ := startWorker(t, testConfig(t, worker.RoleDecode, append([]string{"--prefill", "local"}, local...)...))
			metric := func(name string) float64 {
				return metricValue(t, rep.Admin, fmt.Sprintf(`%s{method="%s",role="decode"}`, name, method))
			}

			// One request at a time first: each step's batch is then one
			// request, so the draft lengths, the gate and so what is drafted,
			// shipped and accepted are the same on every run; the
			// concurrent round after it batches as the scheduler's timing
			// falls, which no count may depend on.
			for k := range len(prompts) * 2 {
				p, temp := prompts[k/2], []float64{0, 0.9}[k%2]
				remote, local := complete(t, rep.HTTP, p, 24, temp, k), complete(t, lep.HTTP, p, 24, temp, k)
				require.Equal(t, http.StatusOK, remote.status, "remote %d: %s", k, remote.text)
				require.Equal(t, local, remote, "request %d alone", k)
			}
			drafted := metric("handoff_spec_draft_tokens_total")
			accepted := metric("handoff_spec_accepted_tokens_total")
			require.Positive(t, drafted)
			require.Positive(t, accepted)
			require.LessOrEqual(t, accepted, drafted)
			// The prefill worker drafted on the prompts and its drafts were
			// verified by decode's first steps.
			require.Positive(t, metric("handoff_spec_shipped_draft_tokens_total"))
			if method == "mtp" {
				// The draft head reads its layer's KV of the prompt, which
				// came with the blocks (and layer by layer when streamed):
				// a local-prefill decode worker with the head drafts the
				// same tokens and accepts as many, one request at a time.
				var args []string
				for i := 0; i < len(tc.decode); i++ {
					if strings.HasPrefix(tc.decode[i], "--prefill") {
						i++ // its value
						continue
					}
					args = append(args, tc.decode[i])
				}
				args = append(args, "--prefill", "local")
				if i := slices.Index(tc.prefill, "--tp-size"); i >= 0 {
					args = append(args, tc.prefill[i:i+2]...)
				}
				mep, _ := startWorker(t, testConfig(t, worker.RoleDecode, append(args, "--model", mtpModel, "--num-speculative-tokens", "4")...))
				for k := range len(prompts) * 2 {
					complete(t, mep.HTTP, prompts[k/2], 24, []float64{0, 0.9}[k%2], k)
				}
				for _, name := range []string{"handoff_spec_draft_tokens_total", "handoff_spec_accepted_tokens_total"} {
					require.Equal(t, metric(name), metricValue(t, mep.Admin, fmt.Sprintf(`%s{method="mtp",role="decode"}`, name)), name)
				}
			}

			// Then concurrently, the fixed prompts and random ones.
			all := append(slices.Clone(prompts), randomPrompts(rand.New(rand.NewPCG(uint64(i), 32)), 4)...)
			type result struct{ remote, local completionOut }
			results := make([]result, len(all)*2)
			var wg sync.WaitGroup
			for i, p := range all {
				for j, temp := range []float64{0, 0.9} {
					k := 2*i + j
					wg.Go(func() {
						results[k].remote = complete(t, rep.HTTP, p, 24, temp, k)
						results[k].local = complete(t, lep.HTTP, p, 24, temp, k)
					})
				}
			}
			wg.Wait()
			for k, r := range results {
				require.Equal(t, http.StatusOK, r.remote.status, "remote %d: %s", k, r.remote.text)
				require.Equal(t, r.local, r.remote, "request %d", k)
			}
			for r := range tc.ranks {
				rank := fmt.Sprint(r)
				require.Eventually(t, func() bool {
					return metricValue(t, rep.Admin, fmt.Sprintf(`handoff_mamba_rows{rank="%s",role="decode",state="used"}`, rank)) == 0
				}, 5e9, 1e7)
				require.Equal(t, tc.realPerRnk, metricValue(t, rep.Admin, fmt.Sprintf(`handoff_mamba_rows{rank="%s",role="decode",state="free"}`, rank)))
				require.Equal(t, tc.reserved, metricValue(t, rep.Admin, fmt.Sprintf(`handoff_mamba_rows{rank="%s",role="decode",state="reserved"}`, rank)))
			}
		})
	}
}

// TestDraftHeadLayoutMismatchIsNamed: a decode worker whose model has a
// draft head and a prefill worker whose model has none have different
// cache layouts (the head's KV is a layer of the pool); the decode worker
// uses no such prefill instance, and its readiness says why, with both
// fingerprints and the options that make them.
func TestDraftHeadLayoutMismatchIsNamed(t *testing.T) {
	ns, err := StartEmbeddedNATS(-1)
	require.NoError(t, err)
	t.Cleanup(ns.Shutdown)
	common := []string{"--nats-url", ns.URL(), "--transport", "tcp", "--namespace", "spec-mismatch"}
	startWorker(t, testConfig(t, worker.RolePrefill, common...))
	dep, _ := startWorker(t, testConfig(t, worker.RoleDecode, append(common, "--prefill", "remote",
		"--model", "tiny-hybrid?mtp=1", "--speculative", "mtp", "--num-speculative-tokens", "2")...))
	client := &http.Client{Timeout: 2 * time.Second}
	var why string
	require.Eventually(t, func() bool {
		r, err := getReadyz(client, dep.Admin)
		why = r.Checks["prefill_instances"]
		return err == nil && r.status == http.StatusServiceUnavailable && strings.Contains(why, "prefill layout")
	}, 10*time.Second, 50*time.Millisecond, "last: %q", why)
	require.Contains(t, why, "?mtp=1")
	require.Contains(t, why, "tiny-hybrid?mtp=1")
}

// randomPrompts returns n prompts of 1 to 80 printable ASCII bytes.
func randomPrompts(rng *rand.Rand, n int) []string {
	out := make([]string, n)
	for i := range out {
		b := make([]byte, 1+rng.IntN(80))
		for j := range b {
			b[j] = byte(' ' + rng.IntN('~'-' '+1))
		}
		out[i] = string(b)
	}
	return out
}
