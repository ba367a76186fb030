package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
)

// CacheSource fills a decode request's freshly prepared resources with its
// prefilled cache, produced elsewhere (a remote prefill worker).
//
// Fetch must not return before no further byte can land in the destination
// (the data-plane grant is closed or revoked): the scheduler frees and reuses
// the resources as soon as Fetch returns, except when the error has a
// method Released() <-chan struct{} (transfer.QuarantinedError: a live
// writer may still store into them), when they stay allocated until that
// channel closes. Errors that are a peer's refusal
// should wrap ErrTransferRefused, a peer's failure ErrTransferFailed,
// deadlines ErrTransferTimeout or
// context.DeadlineExceeded, so the transfer metric is labelled right.
type CacheSource interface {
	Fetch(ctx context.Context, f FetchRequest) (FetchResult, error)
}

// FetchRequest describes the destination of one prefilled cache.
type FetchRequest struct {
	ID     uint64 // engine-local request id, never 0
	LogID  string // the request id used in logs
	Rank   int
	Prompt []int32
	// Sampling picks the first token (and asks for its logprobs).
	Sampling
	// Resources are the Mamba row and the KV runs (covering exactly
	// len(Prompt) tokens) the scheduler prepared on the rank: the cache's
	// destination, which the scheduler frees once Fetch returned.
	hybrid.Resources
}

// FetchResult is what a successful Fetch reports.
type FetchResult struct {
	First int32 // the first generated token, sampled at step 0
	// FirstLogprobs are the first token's logprobs, when asked for.
	FirstLogprobs *model.Logprobs
	Compute       time.Duration // prefill compute on the remote worker
	Transfer      time.Duration // data-plane write and commit, as measured by the writer
	KVBytes       int64
	MambaBytes    int64
}

// Timing splits a request's latency.
type Timing struct {
	Queued     time.Duration // accepted until admitted to a rank
	Prefill    time.Duration // prefill compute (local, or as reported remotely)
	Transfer   time.Duration // data-plane write and commit (remote only)
	Handoff    time.Duration // admitted until the cache was accepted (remote only)
	FirstToken time.Duration // accepted until the first token
	Total      time.Duration // accepted until done
}

// Sampling is how a request picks its tokens.
type Sampling struct {
	Temperature float64
	// TopP restricts sampling to the nucleus (model.SampleTopP); 0 or 1
	// means no restriction.
	TopP float64
	Seed uint64
	// Logprobs asks for each token's logprobs (Output.Logprobs) with
	// TopLogprobs alternatives (0..model.MaxTopLogprobs).
	Logprobs    bool
	TopLogprobs int
}

// GenerateRequest is a decode request, already tokenized.
type GenerateRequest struct {
	Prompt    []int32
	MaxTokens int
	Sampling
	// Stop ends the generation at the first of these texts (finish
	// "stop"); the matched text is not emitted.
	Stop  []string
	LogID string
}

// PrefillJob is a prefill request, already tokenized.
type PrefillJob struct {
	Prompt []int32
	Sampling
	LogID string
	// Parts, when set, is called with each part of the cache as soon as
	// compute finished it (layer by layer: model.PrefillChunk), on the
	// scheduler's goroutine: it must not block. The bytes it names stay
	// unchanged, and no other job gets them, until the holder let go of
	// the job (see PendingPrefill), even if the job failed meanwhile.
	Parts func(Part)
}

// Lease is a prefilled cache held on a rank until Release. The holder reads
// the rank's arenas through Resources (to push them to a decode worker)
// and must call Release exactly when it no longer reads them.
type Lease struct {
	Rank int
	ID   uint64
	// Resources are the request's Mamba row and KV runs on the rank.
	hybrid.Resources
	Tokens int   // prompt tokens the runs hold
	First  int32 // first token, sampled at step 0
	// FirstLogprobs are the first token's logprobs, when the job asked.
	FirstLogprobs *model.Logprobs
	Compute       time.Duration

	e    *Scheduler
	q    *request
	once sync.Once
}

// Release frees the lease's resources. Idempotent; safe after the scheduler stopped.
func (l *Lease) Release() { l.once.Do(func() { l.e.post(inboxEvent{kind: evRelease, q: l.q}) }) }

// Config tunes a Scheduler.
type Config struct {
	Role Role
	// AttentionDP steps ranks in lockstep with dummy padding.
	AttentionDP bool
	// QueueSize bounds the requests waiting for admission; 0 means
	// DefaultQueueSize.
	QueueSize int
	// Source brings remote prefilled caches (decode role). Nil runs
	// prefill in-process: the aggregated baseline.
	Source CacheSource
	// Router, with a Source, decides per admitted request whether its
	// prefill runs at the Source or here (conditional disaggregation,
	// decode --prefill auto); a request whose remote prefill is refused
	// (ErrTransferRefused) or failed (ErrTransferFailed) is then prefilled
	// here instead of failing. Nil
	// sends every request to the Source.
	Router Router
	// Logger receives the scheduler's logs; nil discards them.
	Logger *slog.Logger
	// Metrics receives the scheduler's metrics; nil keeps them unregistered.
	Metrics *Metrics
	// ReleaseGrace is how long a stopping scheduler waits for leases and
	// fetches to end before it frees their resources anyway; 0 means 10s.
	ReleaseGrace time.Duration
	// PrefillChunkTokens splits a prompt's prefill into chunks of at most
	// this many tokens, one per step, so other requests' steps run between
	// them (executors that prefill whole prompts only take them whole); 0
	// prefills each prompt in one step.
	PrefillChunkTokens int
}

func (c *Config) validate(ranks []*Rank) error {
	if c.Role != RolePrefill && c.Role != RoleDecode {
		return fmt.Errorf("%w: role %q", ErrInvalidConfig, c.Role)
	}
	if len(ranks) == 0 {
		return fmt.Errorf("%w: no ranks", ErrInvalidConfig)
	}
	if c.Role == RolePrefill && c.Source != nil {
		return fmt.Errorf("%w: a prefill engine takes no cache source", ErrInvalidConfig)
	}
	if c.Router != nil && c.Source == nil {
		return fmt.Errorf("%w: a prefill router needs a cache source", ErrInvalidConfig)
	}
	if c.QueueSize < 0 {
		return fmt.Errorf("%w: queue size %d", ErrInvalidConfig, c.QueueSize)
	}
	if c.PrefillChunkTokens < 0 {
		return fmt.Errorf("%w: prefill chunk of %d tokens", ErrInvalidConfig, c.PrefillChunkTokens)
	}
	if c.QueueSize == 0 {
		c.QueueSize = DefaultQueueSize
	}
	if c.ReleaseGrace <= 0 {
		c.ReleaseGrace = 10 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Metrics == nil {
		c.Metrics = NewMetrics(prometheusNopRegisterer{})
	}
	return nil
}

// DefaultQueueSize is the default bound of the admission queue: large
// enough that a burst of a thousand clients on one decode worker waits
// rather than being refused, small enough that the memory it holds stays
// bounded. A queued decode request costs the server about 25 KiB with a
// short prompt and 37 KiB with a 4096-token one (its connection, handler
// goroutine, parsed request and scheduler record; api's
// TestQueuedRequestMemory measures it), so a full default queue holds
// about 30-40 MiB: less than one Mamba row of a large model. What a long
// queue costs instead is waiting: a refused client is told the queue's
// expected wait (QueueWait) in Retry-After.
const DefaultQueueSize = 1024

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

type leaseResult struct {
	lease *Lease
	err   error
}

// request is the scheduler's record of one request. After enqueue, its mutable
// fields are owned by the loop goroutine (and, during a step, by the one
// goroutine stepping its rank).
type request struct {
	id          uint64
	logID       string
	log         *slog.Logger
	ctx         context.Context
	cancel      context.CancelCauseFunc
	stopAfter   func() bool
	prompt      []int32
	maxTokens   int
	smp         Sampling
	prefillOnly bool
	promise     int

	rank      *Rank
	phase     Phase
	blocks    []kvcache.BlockID
	pos       int           // positions the cache holds (during prefill: the chunks done)
	computed  time.Duration // prefill compute of the chunks before this step
	parts     func(Part)    // prefill role: PrefillJob.Parts
	heldErr   error         // prefill role, PhaseHeld: what ended the job
	last      int32
	generated int
	tokens    int // generated tokens other than EOS
	stepErr   error
	finished  bool
	reason    string

	out      *Stream             // decode role
	ttft     prometheus.Observer // decode role: time to first token
	stop     stopper             // decode role
	emit     []Output            // scratch for stop
	lease    chan leaseResult    // prefill role, capacity 1
	leaseOut bool

	accepted, admitted, firstAt time.Time
	timing                      Timing
}

// accept takes the token sampled at step q.generated (with its logprobs
// when asked for) and reports whether the request is complete: EOS ends it
// without being emitted, a stop sequence ends it without emitting the match,
// reaching maxTokens ends it after the token.
func (q *request) accept(tok int32, lp *model.Logprobs) bool {
	if q.generated == 0 {
		q.firstAt = time.Now()
		q.timing.FirstToken = q.firstAt.Sub(q.accepted)
		if q.ttft != nil {
			q.ttft.Observe(q.timing.FirstToken.Seconds())
		}
	}
	q.generated++
	q.last = tok
	if tok == model.EOS {
		q.reason = "stop"
		return true
	}
	q.tokens++
	var match bool
	q.emit, match = q.stop.push(Output{Token: tok, Text: model.TokenText(tok), Logprobs: lp}, q.emit[:0])
	for _, ev := range q.emit {
		q.out.push(ev)
	}
	clear(q.emit)
	if match {
		q.reason = "stop"
		return true
	}
	if q.generated >= q.maxTokens {
		q.reason = "length"
		return true
	}
	return false
}

// sample picks the token at step q.generated from logits, with its
// logprobs when the request asked for them.
func (q *request) sample(logits []float32) (int32, *model.Logprobs) {
	tok := model.SampleTopP(logits, q.smp.Temperature, q.smp.TopP, q.smp.Seed, q.generated)
	if !q.smp.Logprobs {
		return tok, nil
	}
	lp := model.ComputeLogprobs(logits, tok, q.smp.TopLogprobs)
	return tok, &lp
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

// admitAlpha is the EWMA weight of one admission interval. Lockstep ranks
// admit in batches (a whole batch finishes in one step), so intervals come
// as a few long gaps among zeros; 1/16 averages over about two batches of
// the default 8 rows and still follows a change of load within a second
// at the rates of a busy worker.
const admitAlpha = 1.0 / 16

// NewScheduler returns a scheduler over ranks. The ranks must share one model.
func NewScheduler(cfg Config, ranks []*Rank) (*Scheduler, error) {
	if err := cfg.validate(ranks); err != nil {
		return nil, err
	}
	maxCtx := ranks[0].exec.Spec().MaxContext
	for _, r := range ranks {
		maxCtx = min(maxCtx, r.MaxTokens())
	}
	e := &Scheduler{
		cfg: cfg, ranks: ranks, log: cfg.Logger, m: cfg.Metrics, maxContext: maxCtx,
		wake: make(chan struct{}, 1), idle: make(chan struct{}), nextID: 1, quit: make(chan struct{}),
	}
	e.m.init(cfg.Role)
	if cfg.Router != nil {
		e.m.initRoutes(cfg.Role)
	}
	e.publish()
	return e, nil
}

// MaxContext is the most tokens (prompt plus generated) one request may use.
func (e *Scheduler) MaxContext() int { return e.maxContext }

// Ranks returns the scheduler's ranks.
func (e *Scheduler) Ranks() []*Rank { return e.ranks }

// Role returns the scheduler's role.
func (e *Scheduler) Role() Role { return e.cfg.Role }

// Metrics returns the scheduler's metrics.
func (e *Scheduler) Metrics() *Metrics { return e.m }

// Generate queues a decode request. It returns at once: ErrQueueFull,
// ErrDraining or ErrClosed when the request is not taken, ErrInvalidRequest
// or ErrTooLong for a request that can never run. Cancelling ctx ends the
// request and frees its resources.
func (e *Scheduler) Generate(ctx context.Context, g GenerateRequest) (*Stream, error) {
	if e.cfg.Role != RoleDecode {
		return nil, ErrWrongRole
	}
	if err := e.check(g.Prompt, g.MaxTokens, g.Sampling); err != nil {
		e.m.Requests.WithLabelValues(string(e.cfg.Role), ResultInvalid).Inc()
		return nil, err
	}
	for _, st := range g.Stop {
		if st == "" {
			e.m.Requests.WithLabelValues(string(e.cfg.Role), ResultInvalid).Inc()
			return nil, fmt.Errorf("%w: empty stop sequence", ErrInvalidRequest)
		}
	}
	need := len(g.Prompt) + g.MaxTokens
	q := e.newRequest(ctx, g.LogID, g.Prompt, g.MaxTokens, g.Sampling, need)
	// Nothing here is sized by MaxTokens: the stream grows with the tokens
	// generated, once the request was admitted.
	q.out = newStream()
	q.ttft = e.m.FirstToken.WithLabelValues(string(e.cfg.Role))
	q.stop.stops = g.Stop
	if err := e.enqueue(q); err != nil {
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
func (e *Scheduler) Prefill(ctx context.Context, j PrefillJob) (*Lease, error) {
	p, err := e.SubmitPrefill(ctx, j)
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
	e *Scheduler
	q *request
}

// SubmitPrefill queues a prefill job without waiting for it: it fails at once
// with ErrQueueFull, ErrDraining, ErrClosed, ErrInvalidRequest or ErrTooLong.
// Ending ctx ends the job; its holder still lets go of it (PendingPrefill).
func (e *Scheduler) SubmitPrefill(ctx context.Context, j PrefillJob) (*PendingPrefill, error) {
	if e.cfg.Role != RolePrefill {
		return nil, ErrWrongRole
	}
	if err := e.check(j.Prompt, 1, j.Sampling); err != nil {
		e.m.Requests.WithLabelValues(string(e.cfg.Role), ResultInvalid).Inc()
		return nil, err
	}
	q := e.newRequest(ctx, j.LogID, j.Prompt, 1, j.Sampling, len(j.Prompt))
	q.prefillOnly = true
	q.parts = j.Parts
	q.lease = make(chan leaseResult, 1)
	if err := e.enqueue(q); err != nil {
		return nil, err
	}
	return &PendingPrefill{e: e, q: q}, nil
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
func (p *PendingPrefill) Abandon() { p.e.post(inboxEvent{kind: evAbandon, q: p.q}) }

func (e *Scheduler) check(prompt []int32, maxTokens int, smp Sampling) error {
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
	case len(prompt)+maxTokens > e.maxContext:
		return fmt.Errorf("%w: %d prompt + %d new tokens > %d", ErrTooLong, len(prompt), maxTokens, e.maxContext)
	}
	return nil
}

func (e *Scheduler) newRequest(ctx context.Context, logID string, prompt []int32, maxTokens int,
	smp Sampling, tokens int) *request {
	rctx, cancel := context.WithCancelCause(ctx)
	return &request{
		logID: logID, ctx: rctx, cancel: cancel,
		prompt: prompt, maxTokens: maxTokens, smp: smp,
		promise:  ranksBlocksFor(e.ranks[0], tokens),
		accepted: time.Now(),
	}
}

func ranksBlocksFor(r *Rank, tokens int) int { return r.kvCfg.BlocksFor(tokens) }

func (e *Scheduler) enqueue(q *request) error {
	e.mu.Lock()
	var err error
	switch {
	case e.stopped:
		err = ErrClosed
	case e.draining:
		err = ErrDraining
	case len(e.queue) >= e.cfg.QueueSize:
		err = ErrQueueFull
	}
	if err != nil {
		e.mu.Unlock()
		q.cancel(err)
		e.m.Requests.WithLabelValues(string(e.cfg.Role), ResultRejected).Inc()
		return err
	}
	q.id = e.nextID
	e.nextID++
	if q.logID == "" {
		q.logID = fmt.Sprintf("%s-%d", e.cfg.Role, q.id)
	}
	// seq is the id the pools and the transfer protocol know the request by
	// (a prefill worker logs it as <decode instance>-<seq>).
	q.log = e.log.With("request_id", q.logID, "seq", q.id)
	// The callback runs on its own goroutine, never under e.mu.
	q.stopAfter = context.AfterFunc(q.ctx, func() { e.post(inboxEvent{kind: evCancel, q: q}) })
	log := q.log
	e.queue = append(e.queue, q)
	e.live++
	e.mu.Unlock()
	log.Debug("request queued", "prompt_tokens", len(q.prompt), "max_tokens", q.maxTokens)
	e.kick()
	return nil
}

func (e *Scheduler) kick() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

func (e *Scheduler) post(ev inboxEvent) {
	e.mu.Lock()
	e.inbox = append(e.inbox, ev)
	e.mu.Unlock()
	e.kick()
}

// Drain stops intake (Generate and Prefill return ErrDraining) and waits
// until every accepted request ended, or ctx ends.
func (e *Scheduler) Drain(ctx context.Context) error {
	e.mu.Lock()
	e.draining = true
	e.maybeIdleLocked()
	idle := e.idle
	e.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("worker: drain: %w", ctx.Err())
	}
}

// Draining reports whether Drain was called.
func (e *Scheduler) Draining() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.draining
}

// Live is the number of accepted requests not yet ended.
func (e *Scheduler) Live() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.live
}

func (e *Scheduler) maybeIdleLocked() {
	if e.draining && e.live == 0 && !e.idleShut {
		e.idleShut = true
		close(e.idle)
	}
}

// Run is the scheduling loop. It returns when ctx ends, after failing queued
// and running requests with ErrClosed and freeing everything they held.
// It must be called once.
func (e *Scheduler) Run(ctx context.Context) error {
	e.mu.Lock()
	if e.running || e.stopped {
		e.mu.Unlock()
		return fmt.Errorf("%w: Run called twice", ErrInvalidConfig)
	}
	e.running = true
	e.mu.Unlock()
	defer e.shutdown()
	for {
		e.applyInbox()
		e.admit()
		plan := e.plan()
		if plan.Step {
			e.step(ctx, plan)
			e.collect()
		}
		e.publish()
		if ctx.Err() != nil {
			return nil
		}
		if plan.Step {
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-e.wake:
		}
	}
}

func (e *Scheduler) plan() Plan {
	loads := make([]RankLoad, len(e.ranks))
	ph := e.scratchPh[:0]
	for i, r := range e.ranks {
		start := len(ph)
		ph = r.load(ph).Phases
		loads[i] = RankLoad{Phases: ph[start:len(ph):len(ph)]}
	}
	e.scratchPh = ph
	return PlanStep(loads, e.cfg.AttentionDP)
}

// applyInbox handles the events posted since the last iteration.
func (e *Scheduler) applyInbox() {
	e.mu.Lock()
	events := e.inbox
	e.inbox = nil
	e.mu.Unlock()
	for _, ev := range events {
		q := ev.q
		switch ev.kind {
		case evCancel, evAbandon:
			switch q.phase {
			case PhaseQueued:
				if e.unqueue(q) {
					e.finish(q, cancelCause(q))
				}
			case PhaseContext, PhaseGenerate:
				if ev.kind == evAbandon {
					e.finish(q, cancelCause(q)) // let go: nothing reads its parts
				} else {
					e.end(q, cancelCause(q))
				}
			case PhasePush:
				// Once the lease was handed out only Release frees it; an
				// abandoned Prefill never handed it out.
				if ev.kind == evAbandon {
					e.finish(q, cancelCause(q))
				}
			case PhaseHeld:
				if ev.kind == evAbandon {
					e.finish(q, q.heldErr)
				}
			case PhaseAwaitCache:
				// The fetch runs under q.ctx and ends on its own.
			}
		case evFetched:
			if q.phase == PhaseAwaitCache {
				e.fetched(q, ev.res, ev.err)
			}
		case evRelease:
			if q.phase == PhasePush {
				e.finish(q, nil)
			}
		case evUnquarantine:
			if err := q.rank.mgr.Free(q.id); err != nil {
				q.log.Error("free resources after quarantine", "err", err)
			}
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

func (e *Scheduler) unqueue(q *request) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	for i, x := range e.queue {
		if x == q {
			e.queue = slices.Delete(e.queue, i, i+1) // clears the vacated slot
			if len(e.queue) == 0 {
				// Nobody waits any more: the next admission may follow
				// idle time, which is no sample of the admission rate.
				e.backlogged = false
			}
			return true
		}
	}
	return false
}

// admit moves queued requests onto ranks, in order, while the head fits.
func (e *Scheduler) admit() {
	rooms := make([]RankRoom, len(e.ranks))
	popped, admitted := 0, 0
	for {
		e.mu.Lock()
		if len(e.queue) == 0 || e.stopped {
			e.noteAdmittedLocked(popped, admitted, time.Now())
			e.mu.Unlock()
			return
		}
		q := e.queue[0]
		for i, r := range e.ranks {
			rooms[i] = r.room()
		}
		idx := PickRank(rooms, q.promise)
		if idx < 0 {
			e.noteAdmittedLocked(popped, admitted, time.Now())
			e.mu.Unlock()
			return
		}
		// Shift rather than reslice: a resliced array would keep every
		// admitted request (and its stream) reachable until it is
		// reallocated.
		e.queue = slices.Delete(e.queue, 0, 1)
		e.mu.Unlock()
		popped++
		if q.ctx.Err() == nil { // a request whose client left ends at once: no sample
			admitted++
		}
		e.place(q, e.ranks[idx])
	}
}

// noteAdmittedLocked feeds QueueWait's estimate with one pass of admit that
// took popped requests off the queue at now, admitted of them live (the
// others' clients had left). Only a pass that follows one which left
// requests queued is a sample: its gap is the time the ranks took to make
// room, not time the worker sat idle.
func (e *Scheduler) noteAdmittedLocked(popped, admitted int, now time.Time) {
	if popped == 0 {
		return
	}
	if e.backlogged && admitted > 0 {
		per := now.Sub(e.lastAdmit).Seconds() / float64(admitted)
		if e.gapKnown {
			// admitted samples of per at once: the weight of as many EWMA steps.
			e.admitGap += (1 - math.Pow(1-admitAlpha, float64(admitted))) * (per - e.admitGap)
		} else {
			e.admitGap, e.gapKnown = per, true
		}
	}
	e.lastAdmit = now
	e.backlogged = len(e.queue) > 0
}

// QueueWait estimates how long a request that joined the queue now would
// wait for admission: the requests ahead of it, plus itself, times the
// recent interval between admissions while requests were waiting (an EWMA,
// so it follows the load, whatever bounds it: rows, blocks or step time).
// It is 0 until requests have once had to wait. The API turns it into
// Retry-After when it refuses a request for a full queue.
func (e *Scheduler) QueueWait() time.Duration {
	e.mu.Lock()
	defer e.mu.Unlock()
	return time.Duration(float64(len(e.queue)+1) * e.admitGap * float64(time.Second))
}

func (e *Scheduler) place(q *request, r *Rank) {
	if q.ctx.Err() != nil {
		e.finish(q, context.Cause(q.ctx))
		return
	}
	res, err := r.mgr.Prepare(q.id, len(q.prompt))
	if err != nil {
		// Admission checked rows and blocks; this is a bug, not load.
		e.finish(q, fmt.Errorf("worker: admit on rank %d: %w", r.index, err))
		return
	}
	q.rank = r
	q.admitted = time.Now()
	q.timing.Queued = q.admitted.Sub(q.accepted)
	q.traceQueued()
	e.m.QueueDuration.WithLabelValues(string(e.cfg.Role)).Observe(q.timing.Queued.Seconds())
	q.log = q.log.With("rank", r.index)
	r.held = append(r.held, q)
	r.promised += q.promise
	if q.prefillOnly || e.cfg.Source == nil || !e.routeRemote(q) {
		e.setPhase(q, PhaseContext)
		q.log.Debug("request admitted", "row", res.Row, "runs", len(res.Runs))
		return
	}
	e.setPhase(q, PhaseAwaitCache)
	q.log.Debug("request admitted, awaiting cache", "row", res.Row, "runs", len(res.Runs))
	f := FetchRequest{
		ID: q.id, LogID: q.logID, Rank: r.index, Prompt: q.prompt,
		Sampling:  q.smp,
		Resources: hybrid.Resources{Row: res.Row, Runs: append([]kvcache.Run(nil), res.Runs...)},
	}
	src := e.cfg.Source
	e.fetches.Go(func() {
		res, err := src.Fetch(q.ctx, f)
		e.post(inboxEvent{kind: evFetched, q: q, res: res, err: err})
	})
}

// routeRemote reports whether q's prefill runs at the Source: always
// without a Router, else as it decides, counted by route and reason.
func (e *Scheduler) routeRemote(q *request) bool {
	if e.cfg.Router == nil {
		return true
	}
	local := LocalLoad{Rows: q.rank.rows}
	for _, o := range q.rank.held {
		if o != q && (o.phase == PhaseContext || o.phase == PhaseGenerate) {
			local.Running++
		}
	}
	d := e.cfg.Router.Route(len(q.prompt), local)
	e.m.PrefillRoutes.WithLabelValues(string(e.cfg.Role), d.Route(), d.Reason).Inc()
	q.log.Debug("prefill routed", "route", d.Route(), "reason", d.Reason)
	return d.Remote
}

// fetched applies a finished Fetch.
func (e *Scheduler) fetched(q *request, res FetchResult, err error) {
	role := string(e.cfg.Role)
	e.m.TransferDuration.WithLabelValues(role).Observe(time.Since(q.admitted).Seconds())
	e.m.Transfers.WithLabelValues(role, TransferResult(err)).Inc()
	if reason := fallbackReason(err); reason != "" && e.cfg.Router != nil &&
		q.ctx.Err() == nil && quarantined(err) == nil {
		// No further byte can land (Fetch's contract, no quarantine): the
		// resources are the request's still, and it is prefilled here. A
		// prefill from the prompt's first token overwrites every byte a
		// failed transfer may have left (the Mamba row is zeroed, every
		// KV position read is written first).
		e.m.PrefillRoutes.WithLabelValues(role, RouteLocal, reason).Inc()
		q.log.Info("remote prefill did not complete; prefilling here", "reason", reason, "err", err)
		e.setPhase(q, PhaseContext)
		return
	}
	if err != nil {
		if cause := context.Cause(q.ctx); cause != nil && !errors.Is(err, cause) {
			// Ended by its context: say why (ErrClosed at shutdown, so
			// the request fails as every other phase does then).
			err = fmt.Errorf("%w: %w", cause, err)
		}
		e.finish(q, fmt.Errorf("worker: fetch cache: %w", err))
		return
	}
	e.m.TransferBytes.WithLabelValues(role, "kv").Add(float64(res.KVBytes))
	e.m.TransferBytes.WithLabelValues(role, "mamba").Add(float64(res.MambaBytes))
	q.timing.Prefill = res.Compute
	e.m.PrefillDuration.WithLabelValues(role).Observe(res.Compute.Seconds())
	q.timing.Transfer = res.Transfer
	q.timing.Handoff = time.Since(q.admitted)
	q.pos = len(q.prompt)
	if q.accept(res.First, res.FirstLogprobs) {
		e.finish(q, nil)
		return
	}
	e.setPhase(q, PhaseGenerate)
}

// fallbackReason is the route reason of a remote prefill that ended in err
// and may run here instead: refused, or failed mid-way; "" for any other
// outcome (success, deadline, cancellation, integrity).
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
// failed fetch is safe to reuse, when err says a writer may still store into
// it (transfer.QuarantinedError), else nil.
func quarantined(err error) <-chan struct{} {
	var q interface{ Released() <-chan struct{} }
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

// step runs one lockstep iteration: ranks step concurrently.
func (e *Scheduler) step(ctx context.Context, plan Plan) {
	var wg sync.WaitGroup
	for i, r := range e.ranks {
		dummy := plan.Dummy[i]
		if !dummy && !hasWork(r) {
			continue
		}
		wg.Go(func() { e.stepRank(ctx, r, dummy) })
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

func (e *Scheduler) stepRank(ctx context.Context, r *Rank, dummy bool) {
	if st, ok := r.exec.(model.StepTimer); ok {
		defer simulateStep(ctx, st, r.held, dummy)() // the step lasts its simulated time
	}
	if dummy {
		e.padDummy(ctx, r)
		return
	}
	for _, q := range r.held {
		switch q.phase {
		case PhaseContext:
			e.prefillStep(r, q)
		case PhaseGenerate:
			e.decodeStep(r, q)
		}
	}
}

// padDummy places the ADP dummy on r's reserved row, runs a decode step on
// it so the rank joins the iteration, and frees it.
func (e *Scheduler) padDummy(ctx context.Context, r *Rank) {
	id := mambacache.ADPDummyID
	if err := r.mgr.AddDummy(id); err != nil {
		e.log.Error("adp dummy not placed", "rank", r.index, "err", err)
		return
	}
	c, err := r.cache(id, nil)
	if err == nil {
		_, err = model.DecodeContext(ctx, r.exec, c, 0, 0)
	}
	if err != nil && ctx.Err() == nil {
		e.log.Error("adp dummy step", "rank", r.index, "err", err)
	}
	if err := r.mgr.Free(id); err != nil {
		e.log.Error("adp dummy free", "rank", r.index, "err", err)
	}
	e.m.Dummies.WithLabelValues(string(e.cfg.Role)).Inc()
}

func (e *Scheduler) prefillStep(r *Rank, q *request) {
	start := time.Now()
	c, err := r.cache(q.id, q.blocks)
	if err != nil {
		q.stepErr = err
		return
	}
	q.blocks = c.Blocks
	logits, err := e.prefillChunk(r, q, c)
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
	e.m.PrefillDuration.WithLabelValues(string(e.cfg.Role)).Observe(q.timing.Prefill.Seconds())
	q.pos = len(q.prompt)
	if q.prefillOnly {
		q.generated, q.last = 1, tok
		runs, err := r.mgr.KV().Runs(q.id, nil)
		if err != nil {
			q.stepErr = err
			return
		}
		q.firstAt = time.Now()
		q.timing.FirstToken = q.firstAt.Sub(q.accepted)
		e.setPhase(q, PhasePush)
		q.leaseOut = true
		q.lease <- leaseResult{lease: &Lease{
			Rank: r.index, ID: q.id, Resources: hybrid.Resources{Row: c.Row, Runs: runs}, Tokens: len(q.prompt),
			First: tok, FirstLogprobs: lp, Compute: q.timing.Prefill, e: e, q: q,
		}}
		return
	}
	if q.accept(tok, lp) {
		q.finished = true
		return
	}
	e.setPhase(q, PhaseGenerate)
}

func (e *Scheduler) decodeStep(r *Rank, q *request) {
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
	tok, lp := q.sample(logits)
	q.pos++
	q.finished = q.accept(tok, lp)
	q.traceFirstStep(traced)
}

// collect ends the requests the iteration finished or failed.
func (e *Scheduler) collect() {
	var done []*request
	for _, r := range e.ranks {
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
		e.end(q, err)
	}
}

// end ends q with err. A prefill job in compute keeps its blocks and row
// until its holder lets go of it (PendingPrefill): its Parts may have
// named them to a reader that has not stopped yet (the layer-wise stream,
// whose queued pieces would otherwise be read from blocks another job
// computes into). Wait hears err at once; the job is held (PhaseHeld)
// until Abandon finishes it. Every other request finishes now.
func (e *Scheduler) end(q *request, err error) {
	if !q.prefillOnly || q.phase != PhaseContext {
		e.finish(q, err)
		return
	}
	q.heldErr = err
	e.setPhase(q, PhaseHeld)
	if !q.leaseOut {
		q.leaseOut = true
		q.lease <- leaseResult{err: err}
	}
	q.log.Debug("prefill ended; its blocks and row stay held until its holder lets go", "err", err)
}

// finish ends q: frees what it holds, reports, and counts it.
func (e *Scheduler) finish(q *request, err error) {
	if q.phase == PhaseDone {
		return
	}
	if q.phase.HoldsResources() && q.rank != nil {
		r := q.rank
		if held := quarantined(err); held != nil {
			// A live writer may still store into the blocks and row: they
			// stay allocated, out of every pool, until its copy ended.
			q.log.Warn("blocks and row quarantined: a live prefill writer may still store into them", "err", err)
			e.fetches.Go(func() {
				select {
				case <-held:
					e.post(inboxEvent{kind: evUnquarantine, q: q})
				case <-e.quit: // the process is going; nothing to reuse them for
				}
			})
		} else if ferr := r.mgr.Free(q.id); ferr != nil {
			q.log.Error("free resources", "err", ferr)
		}
		r.promised -= q.promise
		for i, x := range r.held {
			if x == q {
				r.held = slices.Delete(r.held, i, i+1) // clears the vacated slot
				break
			}
		}
	}
	e.setPhase(q, PhaseDone)
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
	e.m.Requests.WithLabelValues(string(e.cfg.Role), result).Inc()
	if q.out != nil {
		ev := Output{Done: true, Err: err, Timing: q.timing, Tokens: q.tokens}
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
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	q.log.Info("request done", attrs...)
	e.mu.Lock()
	e.live--
	e.maybeIdleLocked()
	e.mu.Unlock()
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// publish updates the pool and queue gauges.
func (e *Scheduler) publish() {
	e.mu.Lock()
	queued := len(e.queue)
	e.mu.Unlock()
	e.m.Queued.WithLabelValues(string(e.cfg.Role)).Set(float64(queued))
	for _, r := range e.ranks {
		e.m.setPools(e.cfg.Role, r.index, r.mgr.Stats())
	}
}

// setPhase moves q to phase p, keeping handoff_sessions_inflight live: it
// counts the requests whose cache is in flight (PhaseAwaitCache, PhasePush)
// as they enter and leave, not at the end of an iteration, which may be long
// (one iteration prefills every admitted prompt). Called by the goroutine
// that owns q.
func (e *Scheduler) setPhase(q *request, p Phase) {
	inFlight := func(p Phase) bool { return p == PhaseAwaitCache || p == PhasePush }
	switch was, now := inFlight(q.phase), inFlight(p); {
	case now && !was:
		e.m.Sessions.WithLabelValues(string(e.cfg.Role)).Inc()
	case was && !now:
		e.m.Sessions.WithLabelValues(string(e.cfg.Role)).Dec()
	}
	q.phase = p
}

// shutdown fails what is left and waits for fetches and leases, up to
// ReleaseGrace, before freeing their resources anyway.
func (e *Scheduler) shutdown() {
	close(e.quit)
	e.mu.Lock()
	e.stopped = true
	queued := e.queue
	e.queue = nil
	e.mu.Unlock()
	for _, q := range queued {
		e.finish(q, ErrClosed)
	}
	var running []*request
	for _, r := range e.ranks {
		running = append(running, r.held...)
	}
	for _, q := range running {
		switch q.phase {
		case PhaseContext, PhaseGenerate:
			e.end(q, ErrClosed) // a prefill job waits for its holder, as a lease does
		case PhaseAwaitCache:
			// The fetch ends with its context; it then fails with
			// ErrClosed, like every other phase.
			q.cancel(ErrClosed)
		}
	}
	timer := time.NewTimer(e.cfg.ReleaseGrace)
	defer timer.Stop()
wait:
	for {
		e.applyInbox()
		held := 0
		for _, r := range e.ranks {
			held += len(r.held)
		}
		if held == 0 {
			break
		}
		select {
		case <-e.wake:
		case <-timer.C:
			for _, r := range e.ranks {
				for _, q := range append([]*request(nil), r.held...) {
					q.log.Warn("freeing resources of a request still in transfer at shutdown", "phase", q.phase.String())
					e.finish(q, ErrClosed)
				}
			}
			break wait
		}
	}
	e.fetches.Wait()
	e.applyInbox()
	e.publish()
}
