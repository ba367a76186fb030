package worker

import (
	"context"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/model"
)

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

	// The prefix cache (prefix.go).
	hit    hybrid.Hit          // taken at placement, until its first step copied it
	skip   int                 // leading blocks shared from the cache for a delta handoff (delta.go)
	cached int                 // prompt tokens the cache served
	seq    []int32             // the tokens its cache holds: the prompt, then those it absorbed
	chain  []kvcache.BlockHash // the names of seq's full blocks, as far as computed

	cacheKey string // GenerateRequest.CacheKey

	// State both ways (state.go).
	prefilledBy string      // decode role: the instance that prefilled the prompt remotely
	adopt       bool        // an adoption (Adopt): fetches a held state and keeps it
	holder      string      // the adoption's holder
	awaiting    bool        // waited at the head of the queue for an adoption (awaitsAdoption)
	adopted     func(error) // AdoptRequest.Done
	heldAlready bool        // the adoption found the state in the cache
	fromCache   bool        // a prefill job from the cache (PrefillJob.FromCache)

	// Speculative decoding (spec.go), decode role with it on.
	spec    bool
	hist    []int32           // the drafting context: prompt and generated tokens
	draft   []int32           // scratch: this step's drafts
	fed     []int32           // scratch: the tokens a verification feeds
	targets []int32           // scratch: the model's token after each fed token
	lps     []*model.Logprobs // scratch: their logprobs
	shipped []int32           // drafts the prefill worker shipped: the first step verifies them
	// draftAsk (prefill role) is how many drafts the job asked for.
	draftAsk int
}

// chunk is the span q's next prefill step computes: from where its hit
// or earlier chunks left it to the end of the prompt, or of a chunk of
// chunk tokens (0: none), ending early at a checkpoint (ckAt).
func (q *request) chunk(chunk, ckAt int) model.Span {
	to := len(q.prompt)
	if chunk > 0 {
		to = min(to, q.pos+chunk)
	}
	if ckAt > q.pos {
		to = min(to, ckAt)
	}
	return model.Span{From: q.pos, To: to}
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
	q.remember(tok)
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
