package worker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/model"
)

// Conversation state both ways: a decode worker returns the end-of-turn
// state it holds to a prefill worker's cache.
//
// A decode request whose prompt was prefilled remotely leaves, when it
// finishes, its blocks and a state checkpoint after the last token it
// absorbed (prefix.go's keep), and the scheduler offers that state to the
// instance that prefilled it (Config.Offers). That instance adopts it
// (Adopt): a request that generates nothing, shares the leading blocks its
// rank holds already (a delta, as delta.go's), fetches the rest and the
// state row from the holder through Config.StateSource (a handoff with the
// roles swapped, on a subject prefix of its own), and keeps them in its cache as a
// checkpoint at exactly the offered tokens. The next turn's prefill there
// then starts at the end of the previous reply instead of the end of the
// previous prompt.
//
// The holder serves the fetch with a prefill job from its cache
// (PrefillJob.FromCache): it is placed only on a hit at exactly the
// offered tokens (else it fails with ErrNotCached: the state was evicted
// meanwhile), copies the checkpoint into a real row of its own (a
// checkpoint row never travels) and lends it, computing nothing.
//
// Both are best effort (bestEffort): admitted only at once, with room and
// nobody queued, else dropped. A state not returned costs the next turn a
// recompute of the reply, never a wrong answer, while a request that waited
// for one would cost its user time.

// A turn sent the moment the last reply arrived (an agent loop, no think
// time) reaches the prefill worker while the adoption of that reply's
// state is still in flight. Its prompt then waits for it (awaitsAdoption:
// pull on demand, on top of the push at the end of the turn): an adoption
// in flight whose tokens the prompt extends, longer than anything the
// cache holds for it now, holds the head of the queue for at most
// adoptWait after the prompt arrived. A pull moves the reply's blocks and
// one row, a few milliseconds; the bound keeps a slow or dead holder
// from costing more than a recompute of the reply would.
var adoptWait = 100 * time.Millisecond // a variable for the tests

// errBusy: a returned state found the worker busy (others queued, or no
// room): it is dropped rather than queued (wrapped in ErrQueueFull).
var errBusy = errors.New("busy: a returned state does not wait for room")

// bestEffort reports whether q moves a returned state (an adoption, or a
// prefill job from the cache): it is admitted only at once, with room and
// nobody waiting, never queued behind or ahead of requests.
func (q *request) bestEffort() bool { return q.adopt || q.fromCache }

// ErrNotCached: a prefill job from the cache (PrefillJob.FromCache) found
// no state at exactly its tokens.
var ErrNotCached = errors.New("worker: no cached state at the tokens asked")

// StateOffers is where a decode scheduler announces the states it holds.
type StateOffers interface {
	// Offer says that this worker holds the state after tokens, whose
	// prompt instance prefilled. It is called on a rank's step goroutine
	// and must not block; tokens are the caller's to keep.
	Offer(instance string, tokens []int32)
}

// AdoptRequest asks a prefill scheduler to take a conversation's state
// from the instance that holds it into its own prefix cache.
type AdoptRequest struct {
	// Tokens are the state's: it is the state after all of them.
	Tokens []int32
	// Holder is the instance to fetch it from (FetchRequest.Holder).
	Holder string
	LogID  string
	// Done, when set, is called once with the outcome of an adoption Adopt
	// queued (not when Adopt returns an error): nil when the state is in
	// the cache (adopted, or held already). It runs on the scheduler's
	// goroutine and must not block.
	Done func(error)
}

// Adopt queues a. It returns at once: ErrWrongRole without a StateSource
// or prefix cache, else Generate's errors; ErrQueueFull too while any
// request waits: an adoption is admitted only when there is room at once
// (else it ends with ErrQueueFull), so it never delays a request. Ending
// ctx ends it.
func (s *Scheduler) Adopt(ctx context.Context, a AdoptRequest) error {
	if s.cfg.StateSource == nil || !s.cfg.PrefixCache {
		return ErrWrongRole
	}
	if a.Holder == "" {
		return fmt.Errorf("%w: a state without its holder", ErrInvalidRequest)
	}
	if err := s.check(a.Tokens, 1, Sampling{}); err != nil {
		return err
	}
	q := s.newRequest(ctx, a.LogID, slices.Clone(a.Tokens), 1, Sampling{}, len(a.Tokens))
	q.adopt, q.holder, q.adopted = true, a.Holder, a.Done
	return s.enqueue(q)
}

// awaitsAdoption reports whether q, at the head of the queue with hits in
// the ranks' caches, waits for an adoption in flight that will hold more
// of its prompt; a timer wakes the loop when its wait is over.
func (s *Scheduler) awaitsAdoption(q *request, hits []hybrid.Hit) bool {
	if s.cfg.StateSource == nil || q.bestEffort() {
		return false
	}
	left := adoptWait - time.Since(q.accepted)
	if left <= 0 {
		return false
	}
	best := 0
	for _, h := range hits {
		best = max(best, h.Tokens)
	}
	for _, r := range s.ranks {
		for _, a := range r.held {
			if a.adopt && len(a.prompt) > best && len(a.prompt) < len(q.prompt) && slices.Equal(a.prompt, q.prompt[:len(a.prompt)]) {
				if !q.awaiting {
					q.awaiting = true
					q.log.Debug("waiting for the state of the last reply", "state_tokens", len(a.prompt), "cached_tokens", best, "holder", a.holder)
					time.AfterFunc(left, s.kick)
				}
				return true
			}
		}
	}
	return false
}

// placeAdopted checks an adoption about to be placed on r: it reports false
// (and finishes it) when r keeps no cache, or holds the state already.
func (s *Scheduler) placeAdopted(q *request, r *Rank) bool {
	if !r.prefix {
		s.finish(q, fmt.Errorf("%w: rank %d keeps no prefix cache", ErrWrongRole, r.index))
		return false
	}
	if r.mgr.HasCheckpoint(q.cachePrompt(r), len(q.prompt)) {
		q.heldAlready = true
		s.finish(q, nil)
		return false
	}
	return true
}

// adoptFetched applies a finished fetch of an adoption: its next step keeps
// what arrived (keepAdopted).
func (s *Scheduler) adoptFetched(q *request, res FetchResult, err error) {
	if err != nil {
		if cause := context.Cause(q.ctx); cause != nil && !errors.Is(err, cause) {
			err = fmt.Errorf("%w: %w", cause, err)
		}
		s.finish(q, fmt.Errorf("worker: adopt state from %s: %w", q.holder, err))
		return
	}
	role := string(s.cfg.Role)
	s.m.StateReturnBytes.WithLabelValues(role, "kv").Add(float64(res.KVBytes))
	s.m.StateReturnBytes.WithLabelValues(role, "mamba").Add(float64(res.MambaBytes))
	q.pos = len(q.prompt)
	s.setPhase(q, PhaseGenerate)
}

// keepAdopted keeps an adopted state in r's cache (in its step, as
// checkpoints are taken) and finishes the request.
//
// The state supersedes the one the conversation's last prompt left here
// (the longest below it), which is made the next to go: the adopted state
// takes its row when no row is free. It never evicts another
// conversation's state: with no row free and none of its own to replace,
// the adoption is dropped (busy). A checkpoint at an interval point may be
// a shared prefix's (a system prompt's) and is not taken for its own.
func (s *Scheduler) keepAdopted(r *Rank, q *request) {
	c, err := r.cache(q.id, q.blocks)
	if err != nil {
		q.stepErr = err
		return
	}
	q.blocks = c.Blocks
	h := r.mgr.Lookup(q.cachePrompt(r))
	k := s.cfg.CheckpointInterval
	demoted := false
	if own := h.Tokens > 0 && (k == 0 || h.Tokens%k != 0); own {
		// Pinned (the conversation's next turn is copying it), it is
		// not demoted, and not replaced.
		demoted, _ = r.mgr.Mamba().DemoteCheckpoint(h.Row)
	}
	if !demoted && r.mgr.Mamba().Checkpoints().Free == 0 {
		q.stepErr = fmt.Errorf("%w: %w: no free checkpoint row, and no state of its own to replace", ErrQueueFull, errBusy)
		return
	}
	if !s.keep(r, q, c, q.pos) {
		q.stepErr = fmt.Errorf("worker: adopted state from %s not kept: no free checkpoint row", q.holder)
		return
	}
	q.finished = true
}

// lendFromCache lends a prefill job from the cache (PrefillJob.FromCache)
// whose hit was just copied into its own row and blocks c: the state after
// every token of the job but the sentinel, with the blocks that hold them.
func (s *Scheduler) lendFromCache(r *Rank, q *request, c model.Cache) {
	n := len(q.prompt) - 1
	if q.cached != n || n == 0 {
		// The hit went stale before placement (prepare fell back to a
		// fresh row): the row holds no state, and is never lent.
		q.stepErr = fmt.Errorf("%w: %d tokens", ErrNotCached, n)
		return
	}
	runs, err := r.mgr.KV().Runs(q.id, nil)
	if err != nil {
		q.stepErr = err
		return
	}
	q.pos = n
	s.lend(r, q, hybrid.Resources{Row: c.Row, Runs: headRuns(runs, r.kvCfg.BlocksFor(n))}, 0, nil, nil)
}

// headRuns cuts runs to their first k blocks.
func headRuns(runs []kvcache.Run, k int) []kvcache.Run {
	for i, r := range runs {
		if k <= int(r.Len) {
			if k == 0 {
				return runs[:i]
			}
			runs[i].Len = uint32(k)
			return runs[:i+1]
		}
		k -= int(r.Len)
	}
	return runs
}

// offerState offers the state q left in r's cache after its last absorbed
// token to the instance that prefilled its prompt.
func (s *Scheduler) offerState(q *request) {
	if s.cfg.Offers == nil || q.prefilledBy == "" {
		return
	}
	s.cfg.Offers.Offer(q.prefilledBy, q.seq[:q.pos:q.pos])
	s.m.StateReturns.WithLabelValues(string(s.cfg.Role), "offered").Inc()
}

// countStateReturn counts the end of an adoption or of a prefill job from
// the cache (or its refusal at the queue).
func (s *Scheduler) countStateReturn(q *request, err error) {
	var result string
	switch {
	case q.fromCache && errors.Is(err, ErrNotCached):
		result = "refused"
	case errors.Is(err, errBusy):
		result = "busy"
	case q.fromCache:
		return // the state server counts it served or failed (its Prefiller's stats)
	case err == nil && q.heldAlready:
		result = "held"
	case err == nil:
		result = "adopted"
	default:
		result = "failed"
	}
	s.m.StateReturns.WithLabelValues(string(s.cfg.Role), result).Inc()
}
