package worker

import (
	"sync"
	"time"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/model"
)

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
	// CacheKey groups requests that share a prefix (OpenAI's
	// prompt_cache_key): a hint for sending the request's prefill where
	// an earlier one of the group was prefilled when its prompt alone
	// names no such place. Never part of what is cached.
	CacheKey string
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
	// Drafts, when > 0, asks for up to this many draft tokens after the
	// first token (Lease.Drafts), for a decode worker whose first step
	// verifies them (speculative decoding; at most MaxSpeculativeTokens).
	Drafts int
	// FromCache serves the job from a state the worker's prefix cache
	// holds, computing nothing: the state after exactly Prompt (a decode
	// worker returning a conversation's end-of-turn state, state.go). It
	// fails with ErrNotCached when the cache holds no such state; the
	// lease has no first token (First is 0) and no drafts. Any role. It
	// is admitted only at once, with room and no request waiting (else
	// ErrQueueFull): a returned state never delays a request.
	FromCache bool
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
	Cached int   // of them, those the prefix cache served (not computed)
	First  int32 // first token, sampled at step 0
	// FirstLogprobs are the first token's logprobs, when the job asked.
	FirstLogprobs *model.Logprobs
	Compute       time.Duration
	// Drafts are the draft tokens after First the job asked for
	// (PrefillJob.Drafts): the drafter run on the prompt and First.
	Drafts []int32

	s    *Scheduler
	q    *request
	once sync.Once
}

// Release frees the lease's resources. Idempotent; safe after the scheduler stopped.
func (l *Lease) Release() { l.once.Do(func() { l.s.post(inboxEvent{kind: evRelease, q: l.q}) }) }
