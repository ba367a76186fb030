package worker

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

// The metric contract passes client_golang's lint (names, units, help),
// and the per-phase histograms see every request of both roles.
func TestMetricsLintAndPhases(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	pre := newScheduler(t, Config{Role: RolePrefill, Metrics: m}, newRanks(t, rankOpts{ranks: 1, batch: 1}))
	dranks := newRanks(t, rankOpts{ranks: 1, batch: 1})
	dec := newScheduler(t, Config{Metrics: m, Source: &gateSource{pre: pre, dst: dranks}}, dranks)
	for range 3 {
		s, err := dec.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("metrics"), MaxTokens: 2})
		require.NoError(t, err)
		_, ev := drainStream(t, s)
		require.NoError(t, ev.Err)
	}
	problems, err := testutil.GatherAndLint(reg)
	require.NoError(t, err)
	require.Empty(t, problems)

	count := func(h *prometheus.HistogramVec, role Role) uint64 {
		var d dto.Metric
		require.NoError(t, h.WithLabelValues(string(role)).(prometheus.Histogram).Write(&d))
		return d.GetHistogram().GetSampleCount()
	}
	for _, role := range []Role{RolePrefill, RoleDecode} {
		require.Equal(t, uint64(3), count(m.QueueDuration, role), "queue %s", role)
		require.Equal(t, uint64(3), count(m.PrefillDuration, role), "prefill %s", role)
	}
	require.Equal(t, uint64(3), count(m.FirstToken, RoleDecode))
	require.Equal(t, uint64(3), count(m.TransferDuration, RoleDecode))
}
