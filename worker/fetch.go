package worker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/model"
)

// CacheSource fills a decode request's freshly prepared resources with its
// prefilled cache, produced elsewhere (a remote prefill worker).
//
// Fetch must not return before no further byte can land in the destination
// (the data-plane grant is closed or revoked): the scheduler frees and reuses
// the resources as soon as Fetch returns, except when the error is (or
// wraps) a Quarantine (transfer.QuarantinedError: a live writer may still
// store into them), when they stay allocated until its Released channel
// closes. Errors that are a peer's refusal
// should wrap ErrTransferRefused, a peer's failure ErrTransferFailed,
// deadlines ErrTransferTimeout or
// context.DeadlineExceeded, so the transfer metric is labelled right.
type CacheSource interface {
	Fetch(ctx context.Context, f FetchRequest) (FetchResult, error)
}

// Quarantine is implemented by the error of a failed Fetch whose
// destination a live writer may still store into (transfer.QuarantinedError
// is one). The scheduler finds it with errors.As and keeps the request's
// blocks and row allocated, out of every pool, until Released closes; any
// other failed Fetch frees them at once.
type Quarantine interface {
	// Released returns a channel that closes once no further byte can land
	// in the destination.
	Released() <-chan struct{}
}

// FetchRequest describes the destination of one prefilled cache.
type FetchRequest struct {
	ID     uint64 // scheduler-local request id, never 0
	LogID  string // the request id used in logs
	Rank   int
	Prompt []int32
	// Sampling picks the first token (and asks for its logprobs).
	Sampling
	// Resources are the Mamba row and the KV runs (covering exactly
	// len(Prompt) tokens) the scheduler prepared on the rank: the cache's
	// destination, which the scheduler frees once Fetch returned.
	hybrid.Resources
	// CacheKey is the request's GenerateRequest.CacheKey.
	CacheKey string
	// Skip is how many leading KV blocks of Resources the rank's prefix
	// cache filled already (shared, read-only): a delta handoff moves only
	// the blocks after them and the row (transfer.Request.Skip).
	Skip int
	// Drafts, with speculative decoding, is how many draft tokens the
	// first decode step verifies: the source may ship up to this many
	// (FetchResult.Drafts).
	Drafts int
	// Holder, for an adoption (Scheduler.Adopt), is the instance holding
	// the state: the fetch goes there only.
	Holder string
}

// FetchResult is what a successful Fetch reports.
type FetchResult struct {
	First int32 // the first generated token, sampled at step 0
	// FirstLogprobs are the first token's logprobs, when asked for.
	FirstLogprobs *model.Logprobs
	Cached        int           // prompt tokens the remote worker's prefix cache served
	Compute       time.Duration // prefill compute on the remote worker
	Transfer      time.Duration // data-plane write and commit, as measured by the writer
	KVBytes       int64
	MambaBytes    int64
	// Drafts are the source's draft tokens after First, verified by the
	// first decode step: at most FetchRequest.Drafts, each in the model's
	// vocabulary, or the fetch fails.
	Drafts []int32
	// Instance is the instance that served the fetch.
	Instance string
}

// routeRemote reports whether q's prefill runs at the Source, placed on
// rank r whose prefix cache holds the first cached tokens of its prompt:
// always without a Router, else as it decides for the tokens a local
// prefill would compute, counted by route and reason.
func (s *Scheduler) routeRemote(q *request, r *Rank, cached int) bool {
	if s.cfg.Router == nil {
		return true
	}
	local := LocalLoad{Rows: r.rows}
	for _, o := range r.held {
		if o != q && (o.phase == PhaseContext || o.phase == PhaseGenerate) {
			local.Running++
		}
	}
	d := s.cfg.Router.Route(len(q.prompt)-cached, local)
	s.m.PrefillRoutes.WithLabelValues(string(s.cfg.Role), d.Route(), d.Reason).Inc()
	q.log.Debug("prefill routed", "route", d.Route(), "reason", d.Reason)
	return d.Remote
}

// fetched applies a finished Fetch.
func (s *Scheduler) fetched(q *request, res FetchResult, err error) {
	if q.adopt {
		s.adoptFetched(q, res, err)
		return
	}
	role := string(s.cfg.Role)
	s.m.TransferDuration.WithLabelValues(role).Observe(time.Since(q.admitted).Seconds())
	s.m.Transfers.WithLabelValues(role, TransferResult(err)).Inc()
	if reason := fallbackReason(err); reason != "" && s.cfg.Router != nil &&
		q.ctx.Err() == nil && quarantined(err) == nil {
		// No further byte can land (Fetch's contract, no quarantine): the
		// resources are the request's still, and it is prefilled here. A
		// prefill from the prompt's first token overwrites every byte a
		// failed transfer may have left (the Mamba row is zeroed, every
		// KV position read is written first).
		s.m.PrefillRoutes.WithLabelValues(role, RouteLocal, reason).Inc()
		q.log.Info("remote prefill did not complete; prefilling here", "reason", reason, "err", err)
		s.setPhase(q, PhaseContext)
		return
	}
	if err != nil {
		if cause := context.Cause(q.ctx); cause != nil && !errors.Is(err, cause) {
			// Ended by its context: say why (ErrClosed at shutdown, so
			// the request fails as every other phase does then).
			err = fmt.Errorf("%w: %w", cause, err)
		}
		s.finish(q, fmt.Errorf("worker: fetch cache: %w", err))
		return
	}
	s.m.TransferBytes.WithLabelValues(role, "kv").Add(float64(res.KVBytes))
	s.m.TransferBytes.WithLabelValues(role, "mamba").Add(float64(res.MambaBytes))
	q.timing.Prefill = res.Compute
	q.prefilledBy = res.Instance
	s.m.PrefillDuration.WithLabelValues(role).Observe(res.Compute.Seconds())
	q.timing.Transfer = res.Transfer
	q.timing.Handoff = time.Since(q.admitted)
	q.cached = min(max(res.Cached, 0), len(q.prompt)-1) // a peer's count, bounded
	q.pos = len(q.prompt)
	if err := s.checkShipped(q, res.Drafts); err != nil {
		s.finish(q, fmt.Errorf("worker: fetch cache: %w", err))
		return
	}
	if q.accept(res.First, res.FirstLogprobs) {
		s.finish(q, nil)
		return
	}
	s.setPhase(q, PhaseGenerate)
}

// fallbackReason is the route reason of a remote prefill that ended in err
// and may run here instead: refused, or failed (its worker died, its
// executor failed, its bytes or messages did not check out); "" for any
// other outcome (success, deadline, cancellation).
func fallbackReason(err error) string {
	switch {
	case errors.Is(err, ErrTransferRefused):
		return ReasonRemoteRefused
	case errors.Is(err, ErrTransferFailed):
		return ReasonRemoteFailed
	}
	return ""
}

// quarantined returns the channel that closes once the destination of a
// failed fetch is safe to reuse, when err is a Quarantine, else nil.
func quarantined(err error) <-chan struct{} {
	var q Quarantine
	if errors.As(err, &q) {
		return q.Released()
	}
	return nil
}

// TransferResult maps a transfer's error to its metric label.
func TransferResult(err error) string {
	switch {
	case err == nil:
		return TransferOK
	case errors.Is(err, ErrTransferRefused):
		return TransferRefused
	case errors.Is(err, ErrTransferTimeout), errors.Is(err, context.DeadlineExceeded):
		return TransferTimeout
	case errors.Is(err, context.Canceled), errors.Is(err, ErrClosed):
		return TransferCancelled
	default:
		return TransferFailed
	}
}
