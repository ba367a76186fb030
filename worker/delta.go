package worker

import (
	"errors"

	"github.com/handoff-io/handoff/hybrid"
)

// Delta handoffs (transfer.SkipBlocks): a decode worker whose prefill is
// remote keeps, with the prefix cache on, the KV blocks of the requests it
// finished (prompt and generated tokens, full blocks only: the state comes
// from the prefill worker, so it takes no checkpoints). A later request
// whose prompt starts with blocks its rank holds (a conversation's next
// turn on the decode that served the last) shares them read-only and asks
// the prefill worker for the rest only: the handoff moves the new tokens'
// blocks and the state row (FetchRequest.Skip). Admission counts the
// shared blocks as a hit's (hitRoom, hitPromise with no tail); the last
// block of the prompt always travels, so the row and the block holding
// the last token come from one prefill.

// deltaHandoff reports whether q's prefill is remote with no choice (no
// Router), or q adopts a state (state.go), and its rank's cache may serve
// its leading blocks.
func (s *Scheduler) deltaHandoff(q *request) bool {
	return s.cfg.PrefixCache && !q.prefillOnly && (q.adopt || s.cfg.Source != nil && s.cfg.Router == nil)
}

// lookupBlocks fills hits with the leading blocks each rank's cache holds
// of q's prompt, all but the one holding its last token at most.
func (s *Scheduler) lookupBlocks(q *request, hits []hybrid.Hit) {
	for i, r := range s.ranks {
		max := (len(q.prompt) - 1) / r.kvCfg.TokensPerBlock
		hits[i] = r.mgr.LookupBlocks(q.cachePrompt(r), max)
	}
}

// prepareDelta gives q its resources on r sharing the h.Shared leading
// blocks r's cache holds, or from nothing when they are gone.
func (s *Scheduler) prepareDelta(q *request, r *Rank, h hybrid.Hit) (hybrid.Resources, error) {
	res, err := r.mgr.PrepareShared(q.id, q.cachePrompt(r), len(q.prompt), h, nil)
	if err == nil {
		q.skip = h.Shared
		q.promise += hitPromise(h) // shared blocks counted once (see prefix.go)
		s.m.DeltaBlocks.WithLabelValues(string(s.cfg.Role)).Add(float64(h.Shared))
		return res, nil
	}
	if !errors.Is(err, hybrid.ErrStaleHit) {
		return hybrid.Resources{}, err
	}
	q.log.Debug("shared blocks gone before placement", "err", err)
	return r.mgr.Prepare(q.id, len(q.prompt))
}

// keepBlocks leaves the full blocks q's cache holds (its prompt and the
// tokens it absorbed) in r's cache, for the next turn of its conversation.
func (s *Scheduler) keepBlocks(r *Rank, q *request) {
	p := q.cachePrompt(r)
	p.Tokens = p.Tokens[:q.pos]
	p.Chain = p.Chain[:min(len(p.Chain), q.pos/r.kvCfg.TokensPerBlock)]
	if _, err := r.mgr.Publish(q.id, p); err != nil {
		q.log.Warn("prefix cache: blocks not published", "err", err)
	}
}
