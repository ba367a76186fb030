package worker

import (
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
)

// Part is a part of a prefilling request's cache that compute finished
// (model.Part), with where the request's cache lives: its rank, its blocks
// in token order and its Mamba row. Blocks is the scheduler's: read it
// during the call only.
type Part struct {
	Rank   int
	Blocks []kvcache.BlockID
	Row    mambacache.Row
	model.Part
}

// prefillChunk runs q's next chunk of prompt: what is left of it, or at
// most Config.PrefillChunkTokens tokens when the executor prefills in
// chunks. It returns the logits once the prompt is done, nil before, and
// reports each finished part of the cache to q.parts.
func (s *Scheduler) prefillChunk(r *Rank, q *request, c model.Cache) ([]float32, error) {
	sp := s.span(r, q)
	from, to := sp.From, sp.To
	var ready func(model.Part)
	if q.parts != nil {
		ready = func(p model.Part) { q.parts(Part{Rank: r.index, Blocks: c.Blocks, Row: c.Row, Part: p}) }
	}
	logits, err := model.PrefillChunk(q.ctx, r.exec, c, q.prompt, from, to, ready)
	if err != nil {
		return nil, err
	}
	s.m.PromptComputed.WithLabelValues(string(s.cfg.Role), rankLabel(r)).Add(float64(to - from))
	if to < len(q.prompt) {
		q.pos = to
		if to == s.nextCheckpoint(r, q, from) {
			s.keep(r, q, c, to) // an interval checkpoint
		}
		return nil, nil
	}
	return logits, nil
}

// span is the positions q's next prefill step on r computes.
func (s *Scheduler) span(r *Rank, q *request) model.Span {
	return q.chunk(s.chunkTokens(r), s.nextCheckpoint(r, q, q.pos))
}

// chunkTokens is the chunk size of r's prefills: PrefillChunkTokens where
// its executor prefills in chunks, 0 (whole prompts) otherwise.
func (s *Scheduler) chunkTokens(r *Rank) int {
	if model.Chunked(r.exec) {
		return s.cfg.PrefillChunkTokens
	}
	return 0
}
