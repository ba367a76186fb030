package worker

import (
	"context"
	"strconv"
	"sync"
	"time"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
)

// step runs one lockstep iteration: ranks step concurrently.
func (s *Scheduler) step(ctx context.Context, plan Plan) {
	dl, batch := s.stepDraftLen()
	var wg sync.WaitGroup
	for i, r := range s.ranks {
		dummy := plan.Dummy[i]
		if !dummy && !hasWork(r) {
			continue
		}
		wg.Go(func() { s.stepRank(ctx, r, dummy, dl, batch) })
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

func (s *Scheduler) stepRank(ctx context.Context, r *Rank, dummy bool, dl, batch int) {
	if s.cfg.Speculation.On() {
		// Draft before the step: its simulated time depends on them.
		for _, q := range r.held {
			if q.phase == PhaseGenerate {
				s.drafts(r, q, dl)
			}
		}
	}
	if st, ok := r.exec.(model.StepTimer); ok {
		span := func(q *request) model.Span { return s.span(r, q) }
		defer simulateStep(ctx, st, r.held, dummy, span)() // the step lasts its simulated time
	}
	if s.cfg.Speculation.On() {
		defer s.padGraph(r, dummy, dl, batch)()
	}
	if dummy {
		// The rank's forward pass is the dummy's; what else it steps
		// (states served from the cache or adopted) computes nothing.
		s.padDummy(ctx, r)
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

// padGraph pads r's decode batch up to the step's (attention-DP ranks run
// one graph shape in lockstep), and an idle rank's ADP dummy step, with
// the padding dummy of the step's draft length, as TensorRT-LLM pads a CUDA-graph batch with the id
// CUDA_GRAPH_DUMMY_REQUEST_ID - draft_len: the dummy takes the reserved
// padding row of that length (repeated padding shares it) and no real
// row. It runs no compute here (the simulated step time counts the step,
// not its padding). The returned func frees it after the step.
func (s *Scheduler) padGraph(r *Rank, dummy bool, dl, batch int) (free func()) {
	n := 0
	for _, q := range r.held {
		if q.phase == PhaseGenerate {
			n++
		}
	}
	// An idle attention-DP rank runs the step's graph too (sized by its
	// draft length) with the ADP dummy in it: it pads as well.
	if !dummy && n >= max(batch, 1) {
		return func() {}
	}
	id := mambacache.PaddingIDFor(dl)
	if _, err := r.mgr.Mamba().AddDummy(id); err != nil {
		s.log.Error("padding dummy not placed", "rank", r.index, "draft_len", dl, "err", err)
		s.m.PaddingFailures.WithLabelValues(string(s.cfg.Role), strconv.Itoa(dl)).Inc()
		return func() {}
	}
	s.m.PaddingDummies.WithLabelValues(string(s.cfg.Role), strconv.Itoa(dl)).Inc()
	return func() {
		if err := r.mgr.Mamba().Free(id); err != nil {
			s.log.Error("padding dummy free", "rank", r.index, "err", err)
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
	if q.fromCache {
		s.lendFromCache(r, q, c)
		return
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
		drafts, err := s.prefillDrafts(r, q, c, tok)
		if err != nil {
			q.stepErr = err
			return
		}
		runs, err := r.mgr.KV().Runs(q.id, nil)
		if err != nil {
			q.stepErr = err
			return
		}
		s.lend(r, q, hybrid.Resources{Row: c.Row, Runs: runs}, tok, lp, drafts)
		return
	}
	if q.accept(tok, lp) {
		q.finished = true
		return
	}
	s.setPhase(q, PhaseGenerate)
}

// lend hands a prefill job's cache res (its first token tok, with lp and
// drafts) to the job's holder: it is pushed now (PhasePush).
func (s *Scheduler) lend(r *Rank, q *request, res hybrid.Resources, tok int32, lp *model.Logprobs, drafts []int32) {
	q.generated, q.last = 1, tok
	q.firstAt = time.Now()
	q.timing.FirstToken = q.firstAt.Sub(q.accepted)
	s.setPhase(q, PhasePush)
	q.leaseOut = true
	q.lease <- leaseResult{lease: &Lease{
		Rank: r.index, ID: q.id, Resources: res, Tokens: q.pos, Cached: q.cached,
		First: tok, FirstLogprobs: lp, Compute: q.timing.Prefill, s: s, q: q,
		Drafts: drafts,
	}}
}

// decodeStep runs one decode step of q, a verification when q drafted
// this step (q.draft, see stepRank).
func (s *Scheduler) decodeStep(r *Rank, q *request) {
	if q.stepErr != nil { // drafting failed (stepRank)
		return
	}
	if q.adopt { // a state that arrived: kept, nothing generated
		s.keepAdopted(r, q)
		return
	}
	drafts := q.draft
	if err := r.mgr.Grow(q.id, q.pos+1+len(drafts)); err != nil {
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
	if len(drafts) > 0 {
		if err := s.verify(r, q, c, drafts); err != nil {
			q.stepErr = err
			return
		}
		if q.finished {
			s.keepGenerated(r, q, c)
		}
		q.traceFirstStep(traced)
		return
	}
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
