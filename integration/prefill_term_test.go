//go:build integration

package integration

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestPrefillTerminatedUnderLoad sends SIGTERM to one of two prefill
// workers while four clients keep the decode busy, as a Kubernetes pod
// deletion does: the prefill drains and leaves, a replacement joins, and no
// request fails. On
// one NATS server, and with each worker on its own node of a three-node
// cluster (a Service spreads them so).
func TestPrefillTerminatedUnderLoad(t *testing.T) {
	t.Run("one server", func(t *testing.T) {
		ns := startNATS(t, nil)
		prefillTerminatedUnderLoad(t, ns.url(), ns.url(), ns.url())
	})
	t.Run("three-node cluster", func(t *testing.T) {
		nodes := startNATSCluster(t, 3)
		prefillTerminatedUnderLoad(t, nodes[0].url(), nodes[1].url(), nodes[2].url())
	})
}

func prefillTerminatedUnderLoad(t *testing.T, url1, url2, urlDec string) {
	common := []string{"--namespace", "term", "--model", "tiny-hybrid"}
	p1 := startProc(t, "prefill", append(common, "--nats-url", url1)...)
	p2 := startProc(t, "prefill", append(common, "--nats-url", url2)...)
	dec := startProc(t, "decode", append(common, "--nats-url", urlDec, "--prefill", "remote")...)
	p1.waitReady(readyWithin)
	p2.waitReady(readyWithin)
	dec.waitReady(readyWithin)
	name := modelName(t, dec.api)

	ctx, cancel := context.WithCancel(context.Background())
	var ok, failed atomic.Int64
	var mu sync.Mutex
	var errs []string
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				rctx, rcancel := context.WithTimeout(context.Background(), time.Minute)
				c, err := complete(rctx, dec.api, completionRequest{Model: name, Prompt: fmt.Sprintf("client %d request %d", w, i), MaxTokens: 24})
				rcancel()
				if err == nil && c.Status == http.StatusOK {
					ok.Add(1)
					continue
				}
				failed.Add(1)
				mu.Lock()
				if len(errs) < 5 {
					errs = append(errs, fmt.Sprintf("client %d request %d: status %d %q %v", w, i, c.Status, c.Err, err))
				}
				mu.Unlock()
			}
		})
	}
	time.Sleep(time.Second)
	before := ok.Load()
	require.NoError(t, p1.cmd.Process.Signal(syscall.SIGTERM))
	// Its replacement starts meanwhile, as a ReplicaSet's does, and joins
	// under load.
	p3 := startProc(t, "prefill", append(common, "--nats-url", url1)...)
	select {
	case <-p1.done:
	case <-time.After(40 * time.Second):
		t.Fatal("the terminated prefill did not exit")
	}
	p3.waitReady(readyWithin)
	time.Sleep(time.Second)
	cancel()
	wg.Wait()
	t.Logf("%d requests before the SIGTERM, %d in all, %d failed", before, ok.Load()+failed.Load(), failed.Load())
	require.Zerof(t, failed.Load(), "requests failed while a prefill drained: %v", errs)
	require.Positive(t, before)
	require.Zero(t, p1.cmd.ProcessState.ExitCode(), "the drained prefill exits 0")
	requireIdle(t, dec, "decode")
	requireIdle(t, p2, "prefill")
	requireIdle(t, p3, "prefill")
}
