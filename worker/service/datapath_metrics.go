package service

import (
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/worker"
)

// registerDataPathStats exports the receiver's quarantine: destinations of
// failed grants that a live prefill writer was still copying into (stopped,
// frozen), kept out of the pools until its copy ends or it exits.
func registerDataPathStats(reg prometheus.Registerer, eng *rdma.Engine, log *slog.Logger) {
	labels := prometheus.Labels{"role": string(worker.RoleDecode)}
	for _, c := range []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "handoff_quarantined_bytes",
			Help:        "Destination bytes held out of the pools because a live writer may still copy into them (its grant failed while it was stopped inside a copy).",
			ConstLabels: labels,
		}, func() float64 { return float64(eng.Stats().QuarantinedBytes) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "handoff_grants_quarantined_total",
			Help:        "Grants that failed while a live writer was still inside a copy into them, so that their destination was quarantined.",
			ConstLabels: labels,
		}, func() float64 { return float64(eng.Stats().GrantsQuarantined) }),
	} {
		if err := reg.Register(c); err != nil {
			log.Warn("metrics: data path quarantine not registered", "err", err)
		}
	}
}
