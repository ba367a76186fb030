package service

import (
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/handoff-io/handoff/internal/topology"
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

// registerHostStats exports what topology discovery found at start-up:
// handoff_host_gpus and handoff_host_nics{rdma}.
func registerHostStats(reg prometheus.Registerer, role worker.Role, host topology.Host, log *slog.Logger) {
	gpus := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "handoff_host_gpus",
		Help:        "GPUs this worker's host offers the data path (NVML; 0 without it).",
		ConstLabels: prometheus.Labels{"role": string(role)},
	})
	gpus.Set(float64(len(host.GPUs)))
	nics := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name:        "handoff_host_nics",
		Help:        "Network interfaces of this worker's host, by whether they are RDMA-capable.",
		ConstLabels: prometheus.Labels{"role": string(role)},
	}, []string{"rdma"})
	rdmaNICs := len(host.RDMANICs())
	nics.WithLabelValues("true").Set(float64(rdmaNICs))
	nics.WithLabelValues("false").Set(float64(len(host.NICs) - rdmaNICs))
	for _, c := range []prometheus.Collector{gpus, nics} {
		if err := reg.Register(c); err != nil {
			log.Warn("metrics: host topology not registered", "err", err)
		}
	}
}
