package agent

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the agent's Prometheus collectors (Config.Registerer): what
// an operator of the engines' agents watches, as worker.Metrics is for the
// workers. Labels are bounded: an op is one of the local API's (others
// count as "other"), a result "ok" or the code of the error (Code).
type metrics struct {
	engines   prometheus.Gauge       // handoff_agent_engines
	requests  *prometheus.CounterVec // handoff_agent_requests_total{op,result}
	grants    *prometheus.CounterVec // handoff_agent_grants_total{result}
	sends     *prometheus.CounterVec // handoff_agent_sends_total{result}
	bytes     *prometheus.CounterVec // handoff_agent_bytes_total{direction}
	sendTime  prometheus.Histogram   // handoff_agent_send_duration_seconds
	openGrant prometheus.Gauge       // handoff_agent_grants_open
}

// The directions of handoff_agent_bytes_total.
const (
	dirSent     = "sent"     // by sends that ended done
	dirReceived = "received" // into grants that ended done
)

// newMetrics creates the collectors and registers them on reg, if any (an
// error if it holds them already: one agent per registry).
func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		engines: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "handoff_agent_engines",
			Help: "Engine connections open (one per engine process, registered or not).",
		}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_agent_requests_total",
			Help: "Local API requests answered, by op and result (ok, or the error's code: reserved, layout_mismatch, bad_request, ...).",
		}, []string{"op", "result"}),
		grants: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_agent_grants_total",
			Help: "Grants that ended, by result (ok: every byte landed and verified, or the failure's code: revoked, deadline, ...).",
		}, []string{"result"}),
		sends: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_agent_sends_total",
			Help: "Sends that ended, by result (ok: the receiver accepted the commit, or the failure's code).",
		}, []string{"result"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_agent_bytes_total",
			Help: "Bytes of cache moved, by direction: sent by sends that ended ok, received into grants that ended ok.",
		}, []string{"direction"}),
		sendTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "handoff_agent_send_duration_seconds",
			Help:    "Sends from the engine's request to their end, ok or not (a layer-by-layer send includes the forward pass it follows).",
			Buckets: prometheus.ExponentialBuckets(100e-6, 2, 20), // 100 µs to 52 s
		}),
		openGrant: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "handoff_agent_grants_open",
			Help: "Grants opened and not yet ended.",
		}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.engines, m.requests, m.grants, m.sends, m.bytes, m.sendTime, m.openGrant} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("agent: metrics: %w", err)
			}
		}
	}
	return m, nil
}

// ops are the op label's values: the local API's ops.
var ops = map[string]bool{
	OpHello: true, OpRegister: true, OpGrant: true, OpRevoke: true, OpSend: true, OpOpenSend: true,
	OpSendLayer: true, OpCommit: true, OpCancel: true, OpOffer: true, OpPeers: true,
}

// result is the result label of err: "ok" or its code.
func result(err error) string {
	if err == nil {
		return "ok"
	}
	return Code(err)
}

// request counts one request answered (err nil: accepted).
func (m *metrics) request(op string, err error) {
	if !ops[op] {
		op = "other"
	}
	m.requests.WithLabelValues(op, result(err)).Inc()
}

// sendEnded counts a send's end: its bytes when done, how long it took.
func (m *metrics) sendEnded(err error, bytes uint64, took time.Duration) {
	m.sends.WithLabelValues(result(err)).Inc()
	if err == nil {
		m.bytes.WithLabelValues(dirSent).Add(float64(bytes))
	}
	m.sendTime.Observe(took.Seconds())
}

// grantEnded counts a grant's end and its bytes when done.
func (m *metrics) grantEnded(err error, bytes uint64) {
	m.openGrant.Dec()
	m.grants.WithLabelValues(result(err)).Inc()
	if err == nil {
		m.bytes.WithLabelValues(dirReceived).Add(float64(bytes))
	}
}
