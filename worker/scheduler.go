package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/kvcache"
)

type evKind uint8

const (
	evCancel       evKind = iota // the request's context ended
	evFetched                    // a Fetch returned
	evRelease                    // a lease was released
	evAbandon                    // Prefill gave up before taking its lease
	evUnquarantine               // a failed fetch's destination can be freed now
)

type inboxEvent struct {
	kind evKind
	q    *request
	res  FetchResult
	err  error
}

// Scheduler runs a worker's attention-DP ranks in lockstep. Generate (decode)
// and Prefill (prefill) queue requests from any goroutine; Run is the loop,
// run by exactly one goroutine the caller owns.
//
// Each iteration the loop (1) applies inbox events (cancellations, finished
// fetches, released leases), (2) admits queued requests in order while some
// rank has a free real row and unpromised blocks for the request's whole
// life, (3) plans with PlanStep, and (4) when any rank has schedulable work,
// steps every rank: one prefill or decode step per schedulable request, and
// the attention-DP dummy (id 0, on the reserved row) on each idle rank,
// freed at the end of the iteration. It sleeps when no rank has work.
//
// Lock order: Scheduler.mu, then the managers' locks; the loop never holds
// Scheduler.mu across executor calls.
type Scheduler struct {
	cfg        Config
	gate       *acceptanceGate // speculative decoding's acceptance-rate gate, nil without one
	ranks      []*Rank
	log        *slog.Logger
	m          *Metrics
	maxContext int

	wake chan struct{} // capacity 1: a pending wake-up is enough

	mu        sync.Mutex
	queue     []*request
	inbox     []inboxEvent
	nextID    uint64
	live      int // queued plus held
	running   bool
	stopped   bool
	draining  bool
	idle      chan struct{} // closed once draining and live == 0
	idleShut  bool
	fetches   sync.WaitGroup
	quit      chan struct{} // closed when shutdown starts
	scratchPh []Phase

	// The admission rate while requests wait, for QueueWait (under mu).
	lastAdmit  time.Time // when the loop last admitted
	backlogged bool      // requests were still queued after that admission
	admitGap   float64   // EWMA of the seconds between admissions while backlogged
	gapKnown   bool      // admitGap holds at least one sample
}

// NewScheduler returns a scheduler over ranks. The ranks must share one model.
func NewScheduler(cfg Config, ranks []*Rank) (*Scheduler, error) {
	if err := cfg.validate(ranks); err != nil {
		return nil, err
	}
	maxCtx := ranks[0].exec.Spec().MaxContext
	for _, r := range ranks {
		maxCtx = min(maxCtx, r.MaxTokens())
	}
	s := &Scheduler{
		cfg: cfg, ranks: ranks, log: cfg.Logger, m: cfg.Metrics, maxContext: maxCtx,
		wake: make(chan struct{}, 1), idle: make(chan struct{}), nextID: 1, quit: make(chan struct{}),
	}
	s.m.init(cfg.Role)
	for _, r := range ranks {
		if r.prefix && cfg.PrefixCache {
			s.m.initPrefix(cfg.Role, r.index)
		}
	}
	if cfg.Router != nil {
		s.m.initRoutes(cfg.Role)
	}
	if cfg.Role == RoleDecode && cfg.Speculation.On() {
		s.m.initSpec(cfg.Role, cfg.Speculation.Method)
		if g := cfg.Speculation; g.GateWindow > 0 {
			s.gate = newAcceptanceGate(g.GateWindow, g.GateThreshold)
		}
	}
	s.publish()
	return s, nil
}

// MaxContext is the most tokens (prompt plus generated) one request may use.
func (s *Scheduler) MaxContext() int { return s.maxContext }

// Ranks returns the scheduler's ranks.
func (s *Scheduler) Ranks() []*Rank { return s.ranks }

// Role returns the scheduler's role.
func (s *Scheduler) Role() Role { return s.cfg.Role }

// Metrics returns the scheduler's metrics.
func (s *Scheduler) Metrics() *Metrics { return s.m }

func (s *Scheduler) kick() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *Scheduler) post(ev inboxEvent) {
	s.mu.Lock()
	s.inbox = append(s.inbox, ev)
	s.mu.Unlock()
	s.kick()
}

// Run is the scheduling loop. It returns when ctx ends, after failing queued
// and running requests with ErrClosed and freeing everything they held.
// It must be called once.
func (s *Scheduler) Run(ctx context.Context) error {
	s.mu.Lock()
	if s.running || s.stopped {
		s.mu.Unlock()
		return fmt.Errorf("%w: Run called twice", ErrInvalidConfig)
	}
	s.running = true
	s.mu.Unlock()
	defer s.shutdown()
	for {
		s.applyInbox()
		s.admit()
		plan := s.plan()
		if plan.Step {
			s.step(ctx, plan)
			s.collect()
		}
		s.publish()
		if ctx.Err() != nil {
			return nil
		}
		if plan.Step {
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-s.wake:
		}
	}
}

func (s *Scheduler) plan() Plan {
	loads := make([]RankLoad, len(s.ranks))
	ph := s.scratchPh[:0]
	for i, r := range s.ranks {
		start := len(ph)
		l := r.load(ph)
		ph = l.Phases
		l.Phases = ph[start:len(ph):len(ph)]
		loads[i] = l
	}
	s.scratchPh = ph
	return PlanStep(loads, s.cfg.AttentionDP)
}

// applyInbox handles the events posted since the last iteration.
func (s *Scheduler) applyInbox() {
	s.mu.Lock()
	events := s.inbox
	s.inbox = nil
	s.mu.Unlock()
	for _, ev := range events {
		q := ev.q
		switch ev.kind {
		case evCancel, evAbandon:
			switch q.phase {
			case PhaseQueued:
				if s.unqueue(q) {
					s.finish(q, cancelCause(q))
				}
			case PhaseContext, PhaseGenerate:
				if ev.kind == evAbandon {
					s.finish(q, cancelCause(q)) // let go: nothing reads its parts
				} else {
					s.end(q, cancelCause(q))
				}
			case PhasePush:
				// Once the lease was handed out only Release frees it; an
				// abandoned Prefill never handed it out.
				if ev.kind == evAbandon {
					s.finish(q, cancelCause(q))
				}
			case PhaseHeld:
				if ev.kind == evAbandon {
					s.finish(q, q.heldErr)
				}
			case PhaseAwaitCache:
				// The fetch runs under q.ctx and ends on its own.
			}
		case evFetched:
			if q.phase == PhaseAwaitCache {
				s.fetched(q, ev.res, ev.err)
			}
		case evRelease:
			if q.phase == PhasePush {
				s.finish(q, nil)
			}
		case evUnquarantine:
			if err := q.rank.mgr.Free(q.id); err != nil {
				q.log.Error("free resources after quarantine", "err", err)
			}
			q.rank.promised -= q.promise
			q.log.Info("quarantine over: blocks and row freed")
		}
	}
}

// cancelCause is why a cancelled or abandoned request ends.
func cancelCause(q *request) error {
	if err := context.Cause(q.ctx); err != nil {
		return err
	}
	return context.Canceled
}

func (s *Scheduler) unqueue(q *request) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, x := range s.queue {
		if x == q {
			s.queue = slices.Delete(s.queue, i, i+1) // clears the vacated slot
			if len(s.queue) == 0 {
				// Nobody waits any more: the next admission may follow
				// idle time, which is no sample of the admission rate.
				s.backlogged = false
			}
			return true
		}
	}
	return false
}

// admit moves queued requests onto ranks, in order, while the head fits.
func (s *Scheduler) admit() {
	rooms := make([]RankRoom, len(s.ranks))
	hits := make([]hybrid.Hit, len(s.ranks))
	popped, admitted := 0, 0
	for {
		s.mu.Lock()
		if len(s.queue) == 0 || s.stopped {
			s.noteAdmittedLocked(popped, admitted, time.Now())
			s.mu.Unlock()
			return
		}
		q := s.queue[0]
		s.lookup(q, hits)
		if s.awaitsAdoption(q, hits) {
			s.noteAdmittedLocked(popped, admitted, time.Now())
			// Waiting for a state is not the ranks making room: the
			// admission that ends it is no sample of QueueWait's.
			s.backlogged = false
			s.mu.Unlock()
			return
		}
		for i, r := range s.ranks {
			rooms[i] = r.room()
			rooms[i].Hit = hits[i].Tokens
			if s.cfg.Router == nil {
				// It will take its hit. With a Router it may yet go
				// remote and take none: it is admitted for its whole
				// promise, which a local hit only lowers (place).
				rooms[i].Blocks += hitRoom(hits[i])
			}
		}
		idx := PickRank(rooms, q.promise)
		if idx < 0 && q.bestEffort() {
			// A returned state never waits for room: a request that
			// would wait behind it matters more (state.go).
			s.queue = slices.Delete(s.queue, 0, 1)
			s.mu.Unlock()
			popped++
			s.finish(q, fmt.Errorf("%w: %w", ErrQueueFull, errBusy))
			continue
		}
		if idx < 0 {
			s.noteAdmittedLocked(popped, admitted, time.Now())
			s.mu.Unlock()
			return
		}
		// Shift rather than reslice: a resliced array would keep every
		// admitted request (and its stream) reachable until it is
		// reallocated.
		s.queue = slices.Delete(s.queue, 0, 1)
		s.mu.Unlock()
		popped++
		if q.ctx.Err() == nil { // a request whose client left ends at once: no sample
			admitted++
		}
		s.place(q, s.ranks[idx], hits[idx])
	}
}

func (s *Scheduler) place(q *request, r *Rank, h hybrid.Hit) {
	if q.ctx.Err() != nil {
		s.finish(q, context.Cause(q.ctx))
		return
	}
	// Where the prefill runs is decided first: a prefill here computes only
	// what the rank's cache lacks (a conversation's next turn, on the rank
	// that served its last one), while a remote one writes every byte and
	// takes no hit.
	if q.fromCache && h.Tokens != len(q.prompt)-1 {
		s.finish(q, fmt.Errorf("%w: %d tokens (the cache of rank %d holds %d)", ErrNotCached, len(q.prompt)-1, r.index, h.Tokens))
		return
	}
	if q.adopt && !s.placeAdopted(q, r) {
		return
	}
	remote := q.adopt || !q.prefillOnly && s.cfg.Source != nil && s.routeRemote(q, r, h.Tokens)
	if remote && h.Tokens > 0 {
		h = hybrid.Hit{} // a remote prefill takes no state hit; a delta keeps its blocks (delta.go)
	}
	res, err := s.prepare(q, r, h)
	if err != nil {
		// Admission checked rows and blocks; this is a bug, not load.
		s.finish(q, fmt.Errorf("worker: admit on rank %d: %w", r.index, err))
		return
	}
	if q.hit.Tokens > 0 {
		q.promise += hitPromise(q.hit) // shared blocks counted once (see prefix.go)
	}
	if !remote && !q.fromCache && r.prefix && s.reusesCache(q) {
		s.countLookup(r, q.hit.Tokens)
	}
	q.rank = r
	q.admitted = time.Now()
	q.timing.Queued = q.admitted.Sub(q.accepted)
	q.traceQueued()
	s.m.QueueDuration.WithLabelValues(string(s.cfg.Role)).Observe(q.timing.Queued.Seconds())
	q.log = q.log.With("rank", r.index)
	r.held = append(r.held, q)
	r.promised += q.promise
	if !remote {
		s.setPhase(q, PhaseContext)
		q.log.Debug("request admitted", "row", res.Row, "runs", len(res.Runs))
		return
	}
	s.setPhase(q, PhaseAwaitCache)
	q.log.Debug("request admitted, awaiting cache", "row", res.Row, "runs", len(res.Runs))
	f := FetchRequest{
		ID: q.id, LogID: q.logID, Rank: r.index, Prompt: q.prompt,
		Sampling: q.smp, CacheKey: q.cacheKey, Skip: q.skip,
		Resources: hybrid.Resources{Row: res.Row, Runs: append([]kvcache.Run(nil), res.Runs...)},
	}
	if q.spec {
		f.Drafts = s.cfg.Speculation.Tokens
	}
	src := s.cfg.Source
	if q.adopt {
		src, f.Holder = s.cfg.StateSource, q.holder
	}
	s.fetches.Go(func() {
		res, err := src.Fetch(q.ctx, f)
		s.post(inboxEvent{kind: evFetched, q: q, res: res, err: err})
	})
}

// collect ends the requests the iteration finished or failed.
func (s *Scheduler) collect() {
	var done []*request
	for _, r := range s.ranks {
		for _, q := range r.held {
			if q.stepErr != nil || q.finished {
				done = append(done, q)
			}
		}
	}
	for _, q := range done {
		err := q.stepErr
		if err != nil && q.ctx.Err() != nil {
			err = context.Cause(q.ctx)
		}
		s.end(q, err)
	}
}

// end ends q with err. A prefill job in compute keeps its blocks and row
// until its holder lets go of it (PendingPrefill): its Parts may have
// named them to a reader that has not stopped yet (the layer-wise stream,
// whose queued pieces would otherwise be read from blocks another job
// computes into). Wait hears err at once; the job is held (PhaseHeld)
// until Abandon finishes it. Every other request finishes now.
func (s *Scheduler) end(q *request, err error) {
	if !q.prefillOnly || q.phase != PhaseContext {
		s.finish(q, err)
		return
	}
	q.heldErr = err
	s.setPhase(q, PhaseHeld)
	if !q.leaseOut {
		q.leaseOut = true
		q.lease <- leaseResult{err: err}
	}
	q.log.Debug("prefill ended; its blocks and row stay held until its holder lets go", "err", err)
}

// finish ends q: frees what it holds, reports, and counts it.
func (s *Scheduler) finish(q *request, err error) {
	if q.phase == PhaseDone {
		return
	}
	if q.phase.HoldsResources() && q.rank != nil {
		r := q.rank
		if held := quarantined(err); held != nil {
			// A live writer may still store into the blocks and row: they
			// stay allocated, out of every pool, until its copy ended, and
			// stay promised (admission counts the blocks it promised as
			// taken) until evUnquarantine frees them.
			q.log.Warn("blocks and row quarantined: a live prefill writer may still store into them", "err", err)
			s.fetches.Go(func() {
				select {
				case <-held:
					s.post(inboxEvent{kind: evUnquarantine, q: q})
				case <-s.quit: // the process is going; nothing to reuse them for
				}
			})
		} else {
			if ferr := r.mgr.Free(q.id); ferr != nil {
				q.log.Error("free resources", "err", ferr)
			}
			r.promised -= q.promise
		}
		for i, x := range r.held {
			if x == q {
				r.held = slices.Delete(r.held, i, i+1) // clears the vacated slot
				break
			}
		}
	}
	s.setPhase(q, PhaseDone)
	if q.stopAfter != nil {
		q.stopAfter()
	}
	q.cancel(nil)
	q.timing.Total = time.Since(q.accepted)
	result := ResultOK
	switch {
	case err == nil:
	case errors.Is(err, ErrClosed):
		// Shutdown fails every phase alike, whatever else err wraps.
		result = ResultFailed
	case errors.Is(err, context.Canceled):
		result = ResultCancelled
	default:
		result = ResultFailed
	}
	if q.adopt || q.fromCache {
		s.countStateReturn(q, err) // counted before its owner hears of it
		if q.adopted != nil {
			q.adopted(err)
		}
	} else {
		s.m.Requests.WithLabelValues(string(s.cfg.Role), result).Inc()
	}
	if q.out != nil {
		ev := Output{Done: true, Err: err, Timing: q.timing, Tokens: q.tokens, Cached: q.cached}
		if err == nil {
			ev.Finish = q.reason
			for _, h := range q.stop.flush(q.emit[:0]) {
				q.out.push(h)
			}
		}
		q.out.push(ev)
	}
	if q.lease != nil && !q.leaseOut {
		q.leaseOut = true
		q.lease <- leaseResult{err: err}
	}
	attrs := []any{"result", result, "generated", q.generated, "queued_ms", ms(q.timing.Queued),
		"prefill_ms", ms(q.timing.Prefill), "total_ms", ms(q.timing.Total)}
	if q.timing.Handoff > 0 {
		attrs = append(attrs, "handoff_ms", ms(q.timing.Handoff), "transfer_ms", ms(q.timing.Transfer))
	}
	if q.timing.FirstToken > 0 {
		attrs = append(attrs, "ttft_ms", ms(q.timing.FirstToken))
	}
	level := slog.LevelInfo
	if err != nil {
		attrs = append(attrs, "err", err)
		if !errors.Is(err, context.Canceled) {
			level = slog.LevelWarn // failed, not left by its client: why, at a level operators keep
		}
	}
	q.log.Log(context.Background(), level, "request done", attrs...)
	s.mu.Lock()
	s.live--
	s.maybeIdleLocked()
	s.mu.Unlock()
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// publish updates the pool and queue gauges.
func (s *Scheduler) publish() {
	s.mu.Lock()
	queued := len(s.queue)
	s.mu.Unlock()
	s.m.Queued.WithLabelValues(string(s.cfg.Role)).Set(float64(queued))
	for _, r := range s.ranks {
		s.m.setPools(s.cfg.Role, r.index, r.mgr.Stats(), &r.published)
	}
}

// setPhase moves q to phase p, keeping handoff_sessions_inflight live: it
// counts the requests whose cache is in flight (PhaseAwaitCache, PhasePush)
// as they enter and leave, not at the end of an iteration, which may be long
// (one iteration prefills every admitted prompt). Called by the goroutine
// that owns q.
func (s *Scheduler) setPhase(q *request, p Phase) {
	inFlight := func(p Phase) bool { return p == PhaseAwaitCache || p == PhasePush }
	switch was, now := inFlight(q.phase), inFlight(p); {
	case now && !was:
		s.m.Sessions.WithLabelValues(string(s.cfg.Role)).Inc()
	case was && !now:
		s.m.Sessions.WithLabelValues(string(s.cfg.Role)).Dec()
	}
	q.phase = p
}
