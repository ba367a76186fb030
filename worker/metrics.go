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
	DeltaBlocks     *prometheus.CounterVec // handoff_delta_skipped_blocks_total{role}
	// StateReturns counts conversation states moved back from a decode
	// worker (state.go): offered and served by decode, adopted, held
	// already or failed at the prefill worker.
	StateReturns     *prometheus.CounterVec // handoff_state_returns_total{role,result}
	StateReturnBytes *prometheus.CounterVec // handoff_state_return_bytes_total{role,kind}: decode sent, prefill received
	PromptComputed   *prometheus.CounterVec // handoff_prompt_tokens_computed_total{role,rank}
	PrefixBlocks     *prometheus.GaugeVec   // handoff_prefix_cached_blocks{role,rank}
	CheckpointRows   *prometheus.GaugeVec   // handoff_state_checkpoint_rows{role,rank,state}
	PrefixEvictions  *prometheus.CounterVec // handoff_prefix_evictions_total{role,rank,kind}

	// Speculative decoding (spec.go). The acceptance rate is
	// accepted/draft; the mean accepted length per verification is
	// accepted/verifications, the tokens a verification yields that plus 1.
	SpecDraftTokens    *prometheus.CounterVec // handoff_spec_draft_tokens_total{role,method}
	SpecAcceptedTokens *prometheus.CounterVec // handoff_spec_accepted_tokens_total{role,method}
	SpecVerifications  *prometheus.CounterVec // handoff_spec_verifications_total{role,method}
	SpecShipped        *prometheus.CounterVec // handoff_spec_shipped_draft_tokens_total{role,method}
	SpecGated          *prometheus.GaugeVec   // handoff_spec_gated{role}
	PaddingDummies     *prometheus.CounterVec // handoff_padding_dummies_total{role,draft_len}
	PaddingFailures    *prometheus.CounterVec // handoff_padding_dummy_failures_total{role,draft_len}
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
		DeltaBlocks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_delta_skipped_blocks_total",
			Help: "Leading KV blocks that no handoff moved, since this worker's prefix cache held them (delta handoffs): of prompts on a decode worker with --prefill remote, of returned conversation states on a prefill worker.",
		}, []string{"role"}),
		StateReturns: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_state_returns_total",
			Help: "Conversation end-of-turn states moved from a decode worker to a prefill worker's cache, by role and result (decode: offered, served, failed, refused, busy; prefill: adopted, held, failed, busy, malformed, layout_mismatch).",
		}, []string{"role", "result"}),
		StateReturnBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_state_return_bytes_total",
			Help: "Bytes of returned conversation states (kv, mamba): sent by decode workers, received by prefill workers.",
		}, []string{"role", "kind"}),
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
		SpecDraftTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_spec_draft_tokens_total",
			Help: "Speculative decoding: draft tokens proposed for verification, by method (ngram).",
		}, []string{"role", "method"}),
		SpecAcceptedTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_spec_accepted_tokens_total",
			Help: "Speculative decoding: draft tokens the model confirmed, by method; over handoff_spec_draft_tokens_total, the acceptance rate.",
		}, []string{"role", "method"}),
		SpecVerifications: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_spec_verifications_total",
			Help: "Speculative decoding: verification steps (one request's drafts checked in one step), by method.",
		}, []string{"role", "method"}),
		SpecShipped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_spec_shipped_draft_tokens_total",
			Help: "Speculative decoding: of handoff_spec_draft_tokens_total, the drafts a prefill worker shipped with the first token, verified by the first decode step.",
		}, []string{"role", "method"}),
		SpecGated: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "handoff_spec_gated",
			Help: "Speculative decoding: 1 while the acceptance-rate gate stops drafting (but for a probe step per window), else 0.",
		}, []string{"role"}),
		PaddingDummies: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_padding_dummies_total",
			Help: "Speculative decoding: padding dummies placed on a rank's reserved padding row of a draft length, to pad its batch to the step's.",
		}, []string{"role", "draft_len"}),
		PaddingFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "handoff_padding_dummy_failures_total",
			Help: "Padding dummies a step could not place (no padding row for the step's draft length): the rank ran its step short of the batch its graph was sized for. Never expected; alert on any.",
		}, []string{"role", "draft_len"}),
	}
	reg.MustRegister(m.Requests, m.Transfers, m.TransferBytes, m.StreamedBytes, m.TransferDuration,
		m.QueueDuration, m.PrefillDuration, m.FirstToken,
		m.Dummies, m.MambaRows, m.KVBlocks, m.Sessions, m.Queued, m.TransportInfo, m.PrefillRoutes,
		m.PrefixLookups, m.PrefixHitTokens, m.DeltaBlocks, m.StateReturns, m.StateReturnBytes, m.PromptComputed, m.PrefixBlocks, m.CheckpointRows, m.PrefixEvictions,
		m.SpecDraftTokens, m.SpecAcceptedTokens, m.SpecVerifications, m.SpecShipped, m.SpecGated, m.PaddingDummies, m.PaddingFailures)
	return m
}

// initSpec creates, at 0, the speculative-decoding series of method.
func (m *Metrics) initSpec(role Role, method string) {
	r := string(role)
	m.SpecDraftTokens.WithLabelValues(r, method)
	m.SpecAcceptedTokens.WithLabelValues(r, method)
	m.SpecVerifications.WithLabelValues(r, method)
	m.SpecShipped.WithLabelValues(r, method)
	m.SpecGated.WithLabelValues(r)
}

// specObserve counts one verification of drafts draft tokens of which
// accepted were confirmed.
func (m *Metrics) specObserve(role Role, method string, drafts, accepted int) {
	r := string(role)
	m.SpecDraftTokens.WithLabelValues(r, method).Add(float64(drafts))
	m.SpecAcceptedTokens.WithLabelValues(r, method).Add(float64(accepted))
	m.SpecVerifications.WithLabelValues(r, method).Inc()
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
