package service

import (
	"net/http"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/worker"
)

// Every metric both binaries expose, theirs and the Go runtime's, passes
// client_golang's lint (issue 15): names, units, suffixes, help.
func TestMetricsExpositionLint(t *testing.T) {
	ns := natstest.Run(t)
	pep, _ := startWorker(t, testConfig(t, worker.RolePrefill, "--nats-url", ns.ClientURL(), "--namespace", "lint"))
	dep, _ := startWorker(t, testConfig(t, worker.RoleDecode, "--nats-url", ns.ClientURL(), "--namespace", "lint"))
	for _, ep := range []Endpoints{pep, dep} {
		resp, err := http.Get("http://" + ep.Admin + "/metrics")
		require.NoError(t, err)
		problems, err := promlint.New(resp.Body).Lint()
		resp.Body.Close()
		require.NoError(t, err)
		require.Empty(t, problems, ep.Admin)
	}
}
