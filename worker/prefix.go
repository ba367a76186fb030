package worker

import (
	"errors"
	"fmt"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/prefix"
)

// The prefix cache in the scheduler (hybrid's Lookup, PrepareHit,
// Publish and checkpoints, driven per request).
//
// A request reuses the cache when it computes its prompt here (a prefill
// job, a decode request of an aggregated worker, or one that --prefill
// auto keeps here: reusesCache) on a rank whose
// executor resumes a prefill from a cached state (model.Chunked) and
// whose pool has checkpoint rows. Admission looks its prompt up on every
// rank and prefers the rank with the longest hit (PickRank); placement
// takes the hit (PrepareHit: the full blocks shared, the checkpoint
// pinned), and the request starts at the hit's length. Its first step
// copies the checkpoint row and tail block into its own (HitCopied) and
// computes the rest. Once the prompt is computed, its full blocks are
// published and a checkpoint is taken at its end (and, with
// CheckpointInterval, at every multiple of it the prompt passes, where
// its chunks then end); a decode request that finishes also leaves its
// blocks and a checkpoint at the last token it absorbed, for the next turn
// of its conversation. Every copy is made in the request's step, on the
// goroutine stepping its rank, between two allocations of the rank's
// manager, as BeginCheckpoint asks.
//
// Admission stays exact, and counts a shared block once: a request is
// promised the blocks its life may take as its own (not those it
// shares), plus one for the pinned tail of its hit until it ends (a
// pinned tail is the only cached block no allocation can evict). A shared
// block is in its publisher's promise while the publisher holds it, and
// in the rank's shared-only count (hybrid.Stats.BlocksSharedOnly) once
// only sharers hold it; a rank has room for promised + shared-only <=
// budget. So a request that shares blocks held already needs room only
// for its own, and one that shares unheld (evictable) cached blocks also
// for those, which its sharing makes shared-only (hitRoom). A request
// that a Router may still send remote, taking no hit, is admitted for its
// whole promise, which a local hit then lowers.

// prefixRoot is the root of a rank's block names: everything that changes
// what its blocks and rows hold.
func prefixRoot(r *Rank) prefix.Hash {
	k, m := r.kvCfg, r.mCfg
	return prefix.Salt(fmt.Sprintf("%s|kv %d layers %d heads %d dim %d bytes %d tokens|mamba %d layers %d heads %d groups",
		r.exec.Spec().Fingerprint(), k.Layers, k.KVHeads, k.HeadDim, k.ElemSize, k.TokensPerBlock, m.Layers, m.Heads, m.NGroups))
}

// reusesCache reports whether q may compute its prompt here with the
// prefix cache: a prefill job, or a decode request of a worker without a
// cache source or with a Router (--prefill auto), which prefills here
// what its rank's cache makes short (local continuation: the next turn
// of a conversation on the rank that served the last one moves nothing).
func (s *Scheduler) reusesCache(q *request) bool {
	return s.cfg.PrefixCache && (q.prefillOnly || s.cfg.Source == nil || s.cfg.Router != nil)
}

// lookup fills hits with q's longest hit on each rank (zero where the rank
// keeps no cache).
func (s *Scheduler) lookup(q *request, hits []hybrid.Hit) {
	clear(hits)
	if s.deltaHandoff(q) {
		s.lookupBlocks(q, hits)
		return
	}
	if !s.reusesCache(q) {
		return
	}
	for i, r := range s.ranks {
		if r.prefix {
			hits[i] = r.mgr.Lookup(q.cachePrompt(r))
		}
	}
}

// hitRoom is what taking hit h saves of a request's promise, as admission
// sees it: the shared blocks that are held already, less the pinned tail.
func hitRoom(h hybrid.Hit) int {
	n := h.Shared - h.Unheld
	if h.HasTail {
		n--
	}
	return n
}

// hitPromise is what taking hit h changes in a request's promise once
// placed: its shared blocks are no longer its own, and its pinned tail is.
func hitPromise(h hybrid.Hit) int {
	n := -h.Shared
	if h.HasTail {
		n++
	}
	return n
}

// cachePrompt names q's tokens (the prompt, and while it generates the
// tokens it absorbed) for r's cache, once: every rank of a worker has the
// same root.
func (q *request) cachePrompt(r *Rank) hybrid.Prompt {
	if q.seq == nil {
		q.seq = q.prompt[:len(q.prompt):len(q.prompt)]
	}
	tpb := r.kvCfg.TokensPerBlock
	if want := len(q.seq) / tpb; len(q.chain) < want {
		parent := prefix.Parent(r.root, q.chain, len(q.chain))
		q.chain = prefix.Chain(q.chain, parent, q.seq[len(q.chain)*tpb:], tpb)
	}
	return hybrid.Prompt{Tokens: q.seq, Root: r.root, Chain: q.chain}
}

// prepare gives q its resources on r: through its hit h when it has one
// still, else from nothing.
func (s *Scheduler) prepare(q *request, r *Rank, h hybrid.Hit) (hybrid.Resources, error) {
	if h.Tokens == 0 && h.Shared > 0 {
		return s.prepareDelta(q, r, h)
	}
	if h.Tokens > 0 {
		res, err := r.mgr.PrepareHit(q.id, q.cachePrompt(r), len(q.prompt), h, nil)
		if err == nil {
			q.hit, q.pos, q.cached = h, h.Tokens, h.Tokens
			return res, nil
		}
		if !errors.Is(err, hybrid.ErrStaleHit) {
			return hybrid.Resources{}, err
		}
		// The cache changed since admission looked (it cannot today:
		// both run on the loop goroutine with no step between them); the
		// request goes on as a miss.
		q.log.Debug("prefix hit gone before placement", "err", err)
	}
	return r.mgr.Prepare(q.id, len(q.prompt))
}

// countLookup counts the lookup of a request prefilled on r, which hit
// cached tokens (0: a miss).
func (s *Scheduler) countLookup(r *Rank, cached int) {
	role, rank := string(s.cfg.Role), rankLabel(r)
	if cached == 0 {
		s.m.PrefixLookups.WithLabelValues(role, rank, "miss").Inc()
		return
	}
	s.m.PrefixLookups.WithLabelValues(role, rank, "hit").Inc()
	s.m.PrefixHitTokens.WithLabelValues(role, rank).Add(float64(cached))
}

// copyHit copies q's hit (its checkpoint row, and its tail block into the
// request's block at the hit's first unshared position) into q's cache c,
// lets go of the checkpoint's pin, and reports the positions [0, hit) as
// finished parts to a layer-wise stream: they are final, and no chunk
// computes them.
func (s *Scheduler) copyHit(r *Rank, q *request, c model.Cache) error {
	h := q.hit
	cp := model.StateCopy{FromRow: h.Row, ToRow: c.Row}
	if h.HasTail {
		cp.Block, cp.FromBlock, cp.ToBlock = true, h.Tail, c.Blocks[h.Shared]
	}
	err := model.CopyState(r.exec, c, cp)
	r.mgr.HitCopied(q.id)
	q.hit = hybrid.Hit{}
	if err != nil {
		return err
	}
	if q.parts != nil {
		for _, p := range model.CachedParts(r.exec.Spec(), h.Tokens) {
			q.parts(Part{Rank: r.index, Blocks: c.Blocks, Row: c.Row, Part: p})
		}
	}
	return nil
}

// keep leaves what q's cache c holds after n tokens of q.seq in r's
// cache: its full blocks, and a checkpoint at n (its state row, and the
// block holding the tokens past the last full one) unless one exists, and
// reports whether the cache holds both now. A
// failure to keep is no failure of the request: the cache is an
// optimisation, and its rows and blocks may all be busy.
func (s *Scheduler) keep(r *Rank, q *request, c model.Cache, n int) bool {
	p := q.cachePrompt(r)
	p.Tokens = p.Tokens[:n]
	p.Chain = p.Chain[:min(len(p.Chain), n/r.kvCfg.TokensPerBlock)]
	if _, err := r.mgr.Publish(q.id, p); err != nil {
		q.log.Warn("prefix cache: blocks not published", "err", err)
		return false
	}
	if r.mgr.HasCheckpoint(p, n) {
		return true
	}
	tpb := r.kvCfg.TokensPerBlock
	ck, err := r.mgr.BeginCheckpoint(n%tpb != 0)
	if err != nil {
		q.log.Debug("prefix cache: no checkpoint taken", "tokens", n, "err", err)
		return false
	}
	cp := model.StateCopy{FromRow: c.Row, ToRow: ck.Row}
	if ck.HasTail {
		cp.Block, cp.FromBlock, cp.ToBlock = true, c.Blocks[n/tpb], ck.Tail
	}
	if err := model.CopyState(r.exec, c, cp); err != nil {
		r.mgr.AbortCheckpoint(ck)
		q.log.Warn("prefix cache: checkpoint copy", "err", err)
		return false
	}
	if err := r.mgr.EndCheckpoint(ck, p, n); err != nil {
		q.log.Warn("prefix cache: checkpoint", "err", err)
		return false
	}
	return true
}

// nextCheckpoint returns where q's chunk starting at from must end so
// that a checkpoint can be taken there: the next multiple of the interval
// before the prompt's end, or the prompt's end.
func (s *Scheduler) nextCheckpoint(r *Rank, q *request, from int) int {
	n := len(q.prompt)
	if k := s.cfg.CheckpointInterval; k > 0 && r.prefix && s.reusesCache(q) {
		if next := (from/k + 1) * k; next < n {
			return next
		}
	}
	return n
}

// keepGenerated is keep for a decode request that finished generating in
// its step on r, over its cache c: what the cache holds after the last
// token it absorbed, for the next turn.
//
// A decode request prefilled remotely keeps a checkpoint too where its rank
// has checkpoint rows (a worker that returns states, state.go), and offers
// it to the instance that prefilled it.
func (s *Scheduler) keepGenerated(r *Rank, q *request, c model.Cache) {
	if r.prefix && (s.reusesCache(q) || s.deltaHandoff(q)) {
		if s.keep(r, q, c, q.pos) {
			s.offerState(q)
		}
		return
	}
	if s.deltaHandoff(q) {
		s.keepBlocks(r, q)
	}
}
