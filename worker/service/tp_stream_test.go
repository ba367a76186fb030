package service

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/worker"
)

// Layer-wise streaming across TP sizes with chunked prefill, in process:
// every remote answer equals the local worker's, token for token.
func TestHeteroTPStreamMatchesLocal(t *testing.T) {
	ns, err := StartEmbeddedNATS(-1)
	require.NoError(t, err)
	t.Cleanup(ns.Shutdown)
	lep, _ := startWorker(t, testConfig(t, worker.RoleDecode, "--prefill", "local", "--max-batch-size", "4"))
	for _, c := range []struct {
		p, d  int
		tr    string
		chunk string
	}{{2, 4, "tcp", "3"}, {4, 1, "shm", "5"}, {1, 2, "tcp", "2"}} {
		t.Run(fmt.Sprintf("p%dd%d-%s-chunk%s", c.p, c.d, c.tr, c.chunk), func(t *testing.T) {
			space := fmt.Sprintf("zz-%d-%d-%s", c.p, c.d, c.tr)
			common := []string{"--nats-url", ns.URL(), "--transport", c.tr, "--namespace", space, "--max-batch-size", "4"}
			startWorker(t, testConfig(t, worker.RolePrefill, append(common, "--tp-size", fmt.Sprint(c.p), "--layerwise", "on", "--prefill-chunk-tokens", c.chunk)...))
			rep, _ := startWorker(t, testConfig(t, worker.RoleDecode, append(common, "--prefill", "remote", "--tp-size", fmt.Sprint(c.d))...))
			ps := []string{"Hello, handoff", "x", "The quick brown fox jumps over the lazy dog", strings.Repeat("river ", 9), "0123456789abcdef", "ab"}
			type res struct{ r, l completionOut }
			out := make([]res, len(ps)*2)
			var wg sync.WaitGroup
			for i, p := range ps {
				for j, temp := range []float64{0, 0.8} {
					k := 2*i + j
					wg.Go(func() {
						out[k].r = complete(t, rep.HTTP, p, 6, temp, k)
						out[k].l = complete(t, lep.HTTP, p, 6, temp, k)
					})
				}
			}
			wg.Wait()
			for k, o := range out {
				require.Equal(t, http.StatusOK, o.r.status, "remote %d: %s", k, o.r.text)
				require.Equal(t, o.l, o.r, "request %d", k)
			}
		})
	}
}
