package worker

import (
	"context"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/handoff-io/handoff/model"
)

// Generate queues a decode request. It returns at once: ErrQueueFull,
// ErrDraining or ErrClosed when the request is not taken, ErrInvalidRequest
// or ErrTooLong for a request that can never run. Cancelling ctx ends the
// request and frees its resources.
func (s *Scheduler) Generate(ctx context.Context, g GenerateRequest) (*Stream, error) {
	if s.cfg.Role != RoleDecode {
		return nil, ErrWrongRole
	}
	if err := s.check(g.Prompt, g.MaxTokens, g.Sampling); err != nil {
		s.m.Requests.WithLabelValues(string(s.cfg.Role), ResultInvalid).Inc()
		return nil, err
	}
	for _, st := range g.Stop {
		if st == "" {
			s.m.Requests.WithLabelValues(string(s.cfg.Role), ResultInvalid).Inc()
			return nil, fmt.Errorf("%w: empty stop sequence", ErrInvalidRequest)
		}
	}
	need := len(g.Prompt) + g.MaxTokens
	q := s.newRequest(ctx, g.LogID, g.Prompt, g.MaxTokens, g.Sampling, need)
	// Nothing here is sized by MaxTokens: the stream grows with the tokens
	// generated, once the request was admitted.
	q.out = newStream()
	q.ttft = s.m.FirstToken.WithLabelValues(string(s.cfg.Role))
	q.stop.stops = g.Stop
	q.cacheKey = g.CacheKey
	if err := s.enqueue(q); err != nil {
		return nil, err
	}
	q.out.ID = q.id
	return q.out, nil
}

// Prefill queues a prefill job and waits until it ran: the returned lease
// holds the cache until Release. Errors as Generate's, or ctx's. A job that
// failed is abandoned at once, so a caller whose Parts hand the bytes to a
// reader that may outlive the call uses SubmitPrefill, and abandons the
// job once that reader stopped.
func (s *Scheduler) Prefill(ctx context.Context, j PrefillJob) (*Lease, error) {
	p, err := s.SubmitPrefill(ctx, j)
	if err != nil {
		return nil, err
	}
	l, err := p.Wait(ctx)
	if err != nil {
		p.Abandon()
	}
	return l, err
}

// PendingPrefill is a queued prefill job.
//
// Its blocks and row are freed only once its holder (the caller of
// SubmitPrefill) lets go of the job, exactly when nothing reads them any
// more: Release of the lease Wait returned, or Abandon. Whatever else ends
// the job first (its context, Wait's, a failed step, shutdown) stops its
// compute and fails Wait, but leaves them allocated, out of every other
// job's reach (PhaseHeld): what its Parts named may still be read. Only a
// stopping scheduler frees them regardless, after Config.ReleaseGrace.
type PendingPrefill struct {
	s *Scheduler
	q *request
}

// SubmitPrefill queues a prefill job without waiting for it: it fails at once
// with ErrQueueFull, ErrDraining, ErrClosed, ErrInvalidRequest or ErrTooLong.
// Ending ctx ends the job; its holder still lets go of it (PendingPrefill).
func (s *Scheduler) SubmitPrefill(ctx context.Context, j PrefillJob) (*PendingPrefill, error) {
	prompt := j.Prompt
	switch {
	case j.FromCache && !s.cfg.PrefixCache:
		return nil, ErrWrongRole
	case j.FromCache && len(prompt) == 0:
		return nil, fmt.Errorf("%w: empty prompt", ErrInvalidRequest)
	case j.FromCache:
		// Looked up with one more token, the longest hit is the state
		// after exactly the job's tokens (a hit leaves a token to compute).
		prompt = append(slices.Clone(prompt), 0)
	case s.cfg.Role != RolePrefill:
		return nil, ErrWrongRole
	}
	if err := s.check(prompt, 1, j.Sampling); err != nil {
		s.m.Requests.WithLabelValues(string(s.cfg.Role), ResultInvalid).Inc()
		return nil, err
	}
	q := s.newRequest(ctx, j.LogID, prompt, 1, j.Sampling, len(prompt))
	q.prefillOnly, q.fromCache = true, j.FromCache
	q.parts = j.Parts
	q.draftAsk = min(max(j.Drafts, 0), MaxSpeculativeTokens)
	q.lease = make(chan leaseResult, 1)
	if err := s.enqueue(q); err != nil {
		return nil, err
	}
	return &PendingPrefill{s: s, q: q}, nil
}

// Wait blocks until the job ran and returns its lease, or its error. When
// ctx ends first the job ends (its compute stops) and Wait returns ctx's
// error. After an error, call Abandon once nothing reads what the job's
// Parts named. Call Wait at most once.
func (p *PendingPrefill) Wait(ctx context.Context) (*Lease, error) {
	select {
	case r := <-p.q.lease:
		return r.lease, r.err
	case <-ctx.Done():
		err := fmt.Errorf("worker: prefill: %w", context.Cause(ctx))
		p.q.cancel(err) // the job's context: the loop ends it (evCancel)
		return nil, err
	}
}

// Abandon lets go of a job whose lease Wait did not return (it failed, or
// Wait was not called): it ends, and whatever it holds is freed. Call it
// once nothing reads what its Parts named any more; later calls do
// nothing. Do not call it after Wait returned a lease (Release that
// instead).
func (p *PendingPrefill) Abandon() { p.s.post(inboxEvent{kind: evAbandon, q: p.q}) }

func (s *Scheduler) check(prompt []int32, maxTokens int, smp Sampling) error {
	temp := smp.Temperature
	switch {
	case len(prompt) == 0:
		return fmt.Errorf("%w: empty prompt", ErrInvalidRequest)
	case maxTokens < 1:
		return fmt.Errorf("%w: max tokens %d", ErrInvalidRequest, maxTokens)
	case temp < 0 || math.IsNaN(temp) || math.IsInf(temp, 0):
		return fmt.Errorf("%w: temperature %v", ErrInvalidRequest, temp)
	case !(smp.TopP >= 0 && smp.TopP <= 1):
		return fmt.Errorf("%w: top_p %v", ErrInvalidRequest, smp.TopP)
	case smp.TopLogprobs < 0 || smp.TopLogprobs > model.MaxTopLogprobs:
		return fmt.Errorf("%w: top logprobs %d", ErrInvalidRequest, smp.TopLogprobs)
	case len(prompt)+maxTokens > s.maxContext:
		return fmt.Errorf("%w: %d prompt + %d new tokens > %d", ErrTooLong, len(prompt), maxTokens, s.maxContext)
	}
	return nil
}

func (s *Scheduler) newRequest(ctx context.Context, logID string, prompt []int32, maxTokens int,
	smp Sampling, tokens int) *request {
	rctx, cancel := context.WithCancelCause(ctx)
	return &request{
		logID: logID, ctx: rctx, cancel: cancel,
		prompt: prompt, maxTokens: maxTokens, smp: smp,
		promise:  ranksBlocksFor(s.ranks[0], tokens),
		accepted: time.Now(),
		spec:     s.cfg.Role == RoleDecode && s.cfg.Speculation.On(),
	}
}

func ranksBlocksFor(r *Rank, tokens int) int { return r.kvCfg.BlocksFor(tokens) }

func (s *Scheduler) enqueue(q *request) error {
	s.mu.Lock()
	var err error
	switch {
	case s.stopped:
		err = ErrClosed
	case s.draining:
		err = ErrDraining
	case len(s.queue) >= s.cfg.QueueSize:
		err = ErrQueueFull
	case q.bestEffort() && len(s.queue) > 0:
		err = fmt.Errorf("%w: %w", ErrQueueFull, errBusy)
	}
	if err != nil {
		s.mu.Unlock()
		q.cancel(err)
		if q.bestEffort() {
			s.countStateReturn(q, err)
		} else {
			s.m.Requests.WithLabelValues(string(s.cfg.Role), ResultRejected).Inc()
		}
		return err
	}
	q.id = s.nextID
	s.nextID++
	if q.logID == "" {
		q.logID = fmt.Sprintf("%s-%d", s.cfg.Role, q.id)
	}
	// seq is the id the pools and the transfer protocol know the request by
	// (a prefill worker logs it as <decode instance>-<seq>).
	q.log = s.log.With("request_id", q.logID, "seq", q.id)
	// The callback runs on its own goroutine, never under s.mu.
	q.stopAfter = context.AfterFunc(q.ctx, func() { s.post(inboxEvent{kind: evCancel, q: q}) })
	log := q.log
	s.queue = append(s.queue, q)
	s.live++
	s.mu.Unlock()
	log.Debug("request queued", "prompt_tokens", len(q.prompt), "max_tokens", q.maxTokens)
	s.kick()
	return nil
}
