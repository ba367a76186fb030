package service

import (
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/worker"
)

// BenchmarkCompletion measures one non-streaming completion end to end over
// HTTP, local prefill against remote prefill (embedded NATS, TCP data path),
// and reports the latency split the API returns in its X-Handoff-* headers.
//
//	go test -run '^$' -bench Completion -benchtime 50x ./worker/service
func BenchmarkCompletion(b *testing.B) {
	ns := natstest.Run(b)
	models := []struct{ name, flags string }{
		{"tiny-hybrid", "--model tiny-hybrid"},
		// Real Nemotron-H-8B cache shapes (49 MiB Mamba state per request),
		// synthetic compute.
		{"nemotron-h-8b", "--model nemotron-h-8b --kv-blocks 64"},
	}
	prompt := strings.Repeat("handoff ", 32) // 256 tokens
	for _, m := range models {
		for _, mode := range []string{"local", "remote-tcp", "remote-shm"} {
			b.Run(m.name+"/"+mode, func(b *testing.B) {
				space := fmt.Sprintf("bench-%d", time.Now().UnixNano())
				where, transport, _ := strings.Cut(mode, "-")
				if transport == "" {
					transport = "tcp"
				}
				flags := append(strings.Fields(m.flags), "--max-batch-size", "1", "--nats-url", ns.ClientURL(), "--namespace", space,
					"--transport", transport, "--prefill", where)
				if where == "remote" {
					pflags := append(strings.Fields(m.flags), "--max-batch-size", "1", "--nats-url", ns.ClientURL(),
						"--namespace", space, "--transport", transport)
					startWorker(b, testConfig(b, worker.RolePrefill, pflags...))
				}
				ep, _ := startWorker(b, testConfig(b, worker.RoleDecode, flags...))
				body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":16,"temperature":0}`, m.name, prompt)
				var ttft, prefill, transfer, handoff, total float64
				b.ReportAllocs()
				b.ResetTimer()
				for range b.N {
					resp, err := http.Post("http://"+ep.HTTP+"/v1/completions", "application/json", strings.NewReader(body))
					require.NoError(b, err)
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					require.Equal(b, http.StatusOK, resp.StatusCode)
					ttft += header(resp, "X-Handoff-Ttft-Ms")
					prefill += header(resp, "X-Handoff-Prefill-Ms")
					transfer += header(resp, "X-Handoff-Transfer-Ms")
					handoff += header(resp, "X-Handoff-Handoff-Ms")
					total += header(resp, "X-Handoff-Total-Ms")
				}
				n := float64(b.N)
				b.ReportMetric(ttft/n, "ttft-ms")
				b.ReportMetric(prefill/n, "prefill-ms")
				b.ReportMetric(transfer/n, "transfer-ms")
				b.ReportMetric(handoff/n, "handoff-ms")
				b.ReportMetric(total/n, "total-ms")
			})
		}
	}
}

func header(resp *http.Response, name string) float64 {
	v, _ := strconv.ParseFloat(resp.Header.Get(name), 64)
	return v
}
