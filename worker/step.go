package worker

import (
	"context"
	"sync"
	"time"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
)

// step runs one lockstep iteration: ranks step concurrently.
func (s *Scheduler) step(ctx context.Context, plan Plan) {
	var wg sync.WaitGroup
	for i, r := range s.ranks {
		dummy := plan.Dummy[i]
		if !dummy && !hasWork(r) {
			continue
		}
		wg.Go(func() { s.stepRank(ctx, r, dummy) })
	}
	wg.Wait()
}

func hasWork(r *Rank) bool {
	for _, q := range r.held {
		if q.phase.Schedulable() {
			return true
		}
	}
	return false
}

func (s *Scheduler) stepRank(ctx context.Context, r *Rank, dummy bool) {
	if st, ok := r.exec.(model.StepTimer); ok {
		span := func(q *request) model.Span { return s.span(r, q) }
		defer simulateStep(ctx, st, r.held, dummy, span)() // the step lasts its simulated time
	}
	if dummy {
		s.padDummy(ctx, r)
		return
	}
	for _, q := range r.held {
		switch q.phase {
		case PhaseContext:
			s.prefillStep(r, q)
		case PhaseGenerate:
			s.decodeStep(r, q)
		}
	}
}

// padDummy places the ADP dummy on r's reserved row, runs a decode step on
// it so the rank joins the iteration, and frees it.
func (s *Scheduler) padDummy(ctx context.Context, r *Rank) {
	id := mambacache.ADPDummyID
	if err := r.mgr.AddDummy(id); err != nil {
		s.log.Error("adp dummy not placed", "rank", r.index, "err", err)
		return
	}
	c, err := r.cache(id, nil)
	if err == nil {
		_, err = model.DecodeContext(ctx, r.exec, c, 0, 0)
	}
	if err != nil && ctx.Err() == nil {
		s.log.Error("adp dummy step", "rank", r.index, "err", err)
	}
	if err := r.mgr.Free(id); err != nil {
		s.log.Error("adp dummy free", "rank", r.index, "err", err)
	}
	s.m.Dummies.WithLabelValues(string(s.cfg.Role)).Inc()
}

func (s *Scheduler) prefillStep(r *Rank, q *request) {
	start := time.Now()
	c, err := r.cache(q.id, q.blocks)
	if err != nil {
		q.stepErr = err
		return
	}
	q.blocks = c.Blocks
	if q.hit.Tokens > 0 {
		if err := s.copyHit(r, q, c); err != nil {
			q.stepErr = err
			return
		}
	}
	logits, err := s.prefillChunk(r, q, c)
	if err != nil {
		q.stepErr = err
		return
	}
	if logits == nil { // chunks to go: the request stays in its context phase
		q.computed += time.Since(start)
		q.traceCompute(start)
		return
	}
	tok, lp := q.sample(logits)
	q.timing.Prefill = q.computed + time.Since(start)
	q.traceCompute(start)
	s.m.PrefillDuration.WithLabelValues(string(s.cfg.Role)).Observe(q.timing.Prefill.Seconds())
	q.pos = len(q.prompt)
	if r.prefix && s.reusesCache(q) {
		s.keep(r, q, c, q.pos)
	}
	if q.prefillOnly {
		q.generated, q.last = 1, tok
		runs, err := r.mgr.KV().Runs(q.id, nil)
		if err != nil {
			q.stepErr = err
			return
		}
		q.firstAt = time.Now()
		q.timing.FirstToken = q.firstAt.Sub(q.accepted)
		s.setPhase(q, PhasePush)
		q.leaseOut = true
		q.lease <- leaseResult{lease: &Lease{
			Rank: r.index, ID: q.id, Resources: hybrid.Resources{Row: c.Row, Runs: runs}, Tokens: len(q.prompt), Cached: q.cached,
			First: tok, FirstLogprobs: lp, Compute: q.timing.Prefill, s: s, q: q,
		}}
		return
	}
	if q.accept(tok, lp) {
		q.finished = true
		return
	}
	s.setPhase(q, PhaseGenerate)
}

func (s *Scheduler) decodeStep(r *Rank, q *request) {
	if err := r.mgr.Grow(q.id, q.pos+1); err != nil {
		q.stepErr = err
		return
	}
	c, err := r.cache(q.id, q.blocks)
	if err != nil {
		q.stepErr = err
		return
	}
	q.blocks = c.Blocks
	traced := q.firstStepStart()
	logits, err := model.DecodeContext(q.ctx, r.exec, c, q.last, q.pos)
	if err != nil {
		q.stepErr = err
		return
	}
	if q.seq != nil {
		q.seq = append(q.seq, q.last) // absorbed at q.pos
	}
	tok, lp := q.sample(logits)
	q.pos++
	q.finished = q.accept(tok, lp)
	if q.finished {
		s.keepGenerated(r, q, c)
	}
	q.traceFirstStep(traced)
}
