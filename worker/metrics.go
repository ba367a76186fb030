package worker

import (
	"strconv"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/prometheus/client_golang/prometheus"
)

// Role is the part a worker plays. Its value is the "role" metric label.
type Role string

const (
	RolePrefill Role = "prefill"
	RoleDecode  Role = "decode"
)

// Request results (label values of handoff_requests_total).
const (
	ResultOK        = "ok"
	ResultCancelled = "cancelled"
	ResultFailed    = "failed"
	ResultRejected  = "rejected" // queue full or draining
	ResultInvalid   = "invalid"  // bad input, refused before admission
)

// Transfer results (label values of handoff_transfers_total).
const (
	TransferOK        = "ok"
	TransferTimeout   = "timeout"
	TransferCancelled = "cancelled"
	TransferFailed    = "failed"
	TransferRefused   = "refused"
)

// Metrics holds the worker's Prometheus collectors. Names and labels are the
// project's fixed metric contract; no request id is ever a label.
type Metrics struct {
	Requests         *prometheus.CounterVec   // handoff_requests_total{role,result}
	Transfers        *prometheus.CounterVec   // handoff_transfers_total{role,result}
	TransferBytes    *prometheus.CounterVec   // handoff_transfer_bytes_total{role,kind}
	StreamedBytes    *prometheus.CounterVec   // handoff_transfer_streamed_bytes_total{role}
	TransferDuration *prometheus.HistogramVec // handoff_transfer_duration_seconds{role}
	QueueDuration    *prometheus.HistogramVec // handoff_queue_duration_seconds{role}
	PrefillDuration  *prometheus.HistogramVec // handoff_prefill_duration_seconds{role}
	FirstToken       *prometheus.HistogramVec // handoff_time_to_first_token_seconds{role}
	Dummies          *prometheus.CounterVec   // handoff_dummy_requests_total{role}
	MambaRows        *prometheus.GaugeVec     // handoff_mamba_rows{role,rank,state}
	KVBlocks         *prometheus.GaugeVec     // handoff_kv_blocks{role,rank,state}
	Sessions         *prometheus.GaugeVec     // handoff_sessions_inflight{role}
	Queued           *prometheus.GaugeVec     // handoff_queued_requests{role}
	TransportInfo    *prometheus.GaugeVec     // handoff_transport_info{transport}
	PrefillRoutes    *prometheus.CounterVec   // handoff_prefill_routes_total{role,route,reason}

	// The prefix cache.
	PrefixLookups   *prometheus.CounterVec // handoff_prefix_lookups_total{role,rank,result}
	PrefixHitTokens *prometheus.CounterVec // handoff_prefix_hit_tokens_total{role,rank}
	PromptComputed  *prometheus.CounterVec // handoff_prompt_tokens_computed_total{role,rank}
	PrefixBlocks    *prometheus.GaugeVec   // handoff_prefix_cached_blocks{role,rank}
	CheckpointRows  *prometheus.GaugeVec   // handoff_state_checkpoint_rows{role,rank,state}
	PrefixEvictions *prometheus.CounterVec // handoff_prefix_evictions_total{role,rank,kind}
}

// NewMetrics creates the collectors and registers them on reg (a private
// registry, never the global default).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_requests_total",
			Help: "Requests that ended, by role and result (ok, cancelled, failed, rejected, invalid).",
		}, []string{"role", "result"}),
		Transfers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_transfers_total",
			Help: "Cache transfers that ended, by role and result (ok, timeout, cancelled, failed, refused).",
		}, []string{"role", "result"}),
		TransferBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_transfer_bytes_total",
			Help: "Cache bytes moved by successful transfers, by role and kind (kv, mamba).",
		}, []string{"role", "kind"}),
		StreamedBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_transfer_streamed_bytes_total",
			Help: "Of handoff_transfer_bytes_total, the bytes that left layer by layer while prefill still computed (--layerwise).",
		}, []string{"role"}),
		TransferDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "handoff_transfer_duration_seconds",
			Help:    "Duration of cache transfers, from the request on the control plane to the accepted commit.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 18),
		}, []string{"role"}),
		QueueDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "handoff_queue_duration_seconds",
			Help:    "Time requests waited for admission to a rank (a row and blocks for their whole life).",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 18),
		}, []string{"role"}),
		PrefillDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "handoff_prefill_duration_seconds",
			Help: "Prefill compute per request: on a prefill worker its own step; on decode the local step, " +
				"or the compute the prefill worker reported for a remote prefill.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 18),
		}, []string{"role"}),
		FirstToken: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "handoff_time_to_first_token_seconds",
			Help:    "Time from a request's acceptance to its first generated token (decode).",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 18),
		}, []string{"role"}),
		Dummies: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_dummy_requests_total",
			Help: "Attention-DP dummy requests padded on idle ranks.",
		}, []string{"role"}),
		MambaRows: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "handoff_mamba_rows",
			Help: "Mamba state rows per rank, by state (free, used, reserved).",
		}, []string{"role", "rank", "state"}),
		KVBlocks: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "handoff_kv_blocks",
			Help: "KV cache blocks per rank, by state: free, used (held by requests), cached (in the prefix cache, held by none: evictable).",
		}, []string{"role", "rank", "state"}),
		Sessions: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "handoff_sessions_inflight",
			Help: "Requests whose cache is in flight between prefill and decode.",
		}, []string{"role"}),
		Queued: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "handoff_queued_requests",
			Help: "Requests waiting for admission to a rank (bounded by --queue-size; beyond it requests are refused with 429).",
		}, []string{"role"}),
		TransportInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "handoff_transport_info",
			Help: "The data-plane transport in use (value 1).",
		}, []string{"transport"}),
		PrefillRoutes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_prefill_routes_total",
			Help: "Decode with --prefill auto: admitted requests by where their prefill ran (local, remote) and why " +
				"(short_prompt, prefill_busy, no_prefill, long_prompt).",
		}, []string{"role", "route", "reason"}),
		PrefixLookups: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_prefix_lookups_total",
			Help: "Prompts looked up in the prefix cache where they were placed, by result (hit, miss).",
		}, []string{"role", "rank", "result"}),
		PrefixHitTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_prefix_hit_tokens_total",
			Help: "Prompt tokens served from the prefix cache instead of computed.",
		}, []string{"role", "rank"}),
		PromptComputed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_prompt_tokens_computed_total",
			Help: "Prompt tokens computed by this worker's prefills (hits excluded).",
		}, []string{"role", "rank"}),
		PrefixBlocks: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "handoff_prefix_cached_blocks",
			Help: "KV blocks in the prefix cache (read-only, shared or evictable), per rank.",
		}, []string{"role", "rank"}),
		CheckpointRows: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "handoff_state_checkpoint_rows",
			Help: "Mamba state checkpoint rows per rank, by state (free, filling, ready, pinned).",
		}, []string{"role", "rank", "state"}),
		PrefixEvictions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_prefix_evictions_total",
			Help: "Prefix cache evictions to make room, by kind (block, checkpoint).",
		}, []string{"role", "rank", "kind"}),
	}
	reg.MustRegister(m.Requests, m.Transfers, m.TransferBytes, m.StreamedBytes, m.TransferDuration,
		m.QueueDuration, m.PrefillDuration, m.FirstToken,
		m.Dummies, m.MambaRows, m.KVBlocks, m.Sessions, m.Queued, m.TransportInfo, m.PrefillRoutes,
		m.PrefixLookups, m.PrefixHitTokens, m.PromptComputed, m.PrefixBlocks, m.CheckpointRows, m.PrefixEvictions)
	return m
}

// init creates the series of role so that they read 0 before the first event.
func (m *Metrics) init(role Role) {
	r := string(role)
	for _, res := range []string{ResultOK, ResultCancelled, ResultFailed, ResultRejected, ResultInvalid} {
		m.Requests.WithLabelValues(r, res)
	}
	for _, res := range []string{TransferOK, TransferTimeout, TransferCancelled, TransferFailed, TransferRefused} {
		m.Transfers.WithLabelValues(r, res)
	}
	m.TransferBytes.WithLabelValues(r, "kv")
	m.TransferBytes.WithLabelValues(r, "mamba")
	m.TransferDuration.WithLabelValues(r)
	m.QueueDuration.WithLabelValues(r)
	m.PrefillDuration.WithLabelValues(r)
	if role == RoleDecode {
		m.FirstToken.WithLabelValues(r)
	}
	m.Dummies.WithLabelValues(r)
	m.Sessions.WithLabelValues(r)
	m.Queued.WithLabelValues(r)
}

// setPools publishes one rank's pool counts; last holds the eviction
// counts it published before, and is updated.
func (m *Metrics) setPools(role Role, rank int, s hybrid.Stats, last *hybrid.Stats) {
	r, k := string(role), strconv.Itoa(rank)
	m.PrefixBlocks.WithLabelValues(r, k).Set(float64(s.BlocksCached))
	c := s.Checkpoints
	m.CheckpointRows.WithLabelValues(r, k, "free").Set(float64(c.Free))
	m.CheckpointRows.WithLabelValues(r, k, "filling").Set(float64(c.Filling))
	m.CheckpointRows.WithLabelValues(r, k, "ready").Set(float64(c.Ready))
	m.CheckpointRows.WithLabelValues(r, k, "pinned").Set(float64(c.Pinned))
	m.PrefixEvictions.WithLabelValues(r, k, "block").Add(float64(s.BlocksEvicted - last.BlocksEvicted))
	m.PrefixEvictions.WithLabelValues(r, k, "checkpoint").Add(float64(s.CheckpointsEvicted - last.CheckpointsEvicted))
	last.BlocksEvicted, last.CheckpointsEvicted = s.BlocksEvicted, s.CheckpointsEvicted
	m.MambaRows.WithLabelValues(r, k, "free").Set(float64(s.RowsFree))
	m.MambaRows.WithLabelValues(r, k, "used").Set(float64(s.RowsUsed))
	m.MambaRows.WithLabelValues(r, k, "reserved").Set(float64(s.RowsReserved))
	evictable := s.BlocksAvailable - s.BlocksFree
	m.KVBlocks.WithLabelValues(r, k, "free").Set(float64(s.BlocksFree))
	m.KVBlocks.WithLabelValues(r, k, "used").Set(float64(s.BlocksUsed - evictable))
	m.KVBlocks.WithLabelValues(r, k, "cached").Set(float64(evictable))
}

// initPrefix creates, at 0, a prefix-caching rank's counters.
func (m *Metrics) initPrefix(role Role, rank int) {
	r, k := string(role), strconv.Itoa(rank)
	m.PrefixLookups.WithLabelValues(r, k, "hit")
	m.PrefixLookups.WithLabelValues(r, k, "miss")
	m.PrefixHitTokens.WithLabelValues(r, k)
	m.PromptComputed.WithLabelValues(r, k)
	m.PrefixEvictions.WithLabelValues(r, k, "block")
	m.PrefixEvictions.WithLabelValues(r, k, "checkpoint")
}

func rankLabel(r *Rank) string { return strconv.Itoa(r.index) }

// initRoutes creates, at 0, the route series a Router can produce.
func (m *Metrics) initRoutes(role Role) {
	r := string(role)
	for _, reason := range []string{ReasonShortPrompt, ReasonPrefillBusy, ReasonNoPrefill, ReasonRemoteRefused, ReasonRemoteFailed} {
		m.PrefillRoutes.WithLabelValues(r, RouteLocal, reason)
	}
	m.PrefillRoutes.WithLabelValues(r, RouteRemote, ReasonLongPrompt)
	m.PrefillRoutes.WithLabelValues(r, RouteRemote, ReasonDecodeBusy)
}
