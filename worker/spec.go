package worker

import (
	"fmt"
	"slices"

	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
)

// Speculative decoding methods (Speculation.Method).
const (
	SpecOff   = "off"
	SpecNgram = "ngram" // model.NgramDrafter: prompt lookup, no weights
	SpecMTP   = "mtp"   // the model's draft head (model.Draft): a model looked up with ?mtp=1
)

// MaxSpeculativeTokens bounds Speculation.Tokens: a verification runs K+1
// positions, and beyond a few the acceptance of a draft's tail is too low
// to pay for them.
const MaxSpeculativeTokens = 16

// Speculation configures speculative decoding on a decode scheduler.
//
// Each decode step of a request drafts up to k tokens (k from Schedule by
// the step's batch size, at most Tokens), and one verification runs the
// request's last token and the drafts through the model: K+1 positions,
// each of which advances the Mamba state once. Draft i is kept while the
// token the model picks after the drafts before it (greedy, or sampled
// with the request's seed at that step) equals it (model.Accepted), so the
// request's tokens are exactly those it gets without speculation. Before
// the verification the request's row is copied to its scratch row
// (mambacache.Config.ScratchRow); when not every position was consumed
// (a draft rejected, or the request ended inside the step) the row is
// restored from scratch and the consumed tokens replayed, so the row
// always holds exactly the state after the tokens the request has
// absorbed. The scratch row is the request's only on this worker and the
// data plane refuses to transfer it.
type Speculation struct {
	// Method is "", SpecOff, SpecNgram or SpecMTP. MTP drafts with the
	// model's draft head (model.Draft), whose KV is the pool's last layer:
	// the ranks' model must have one.
	Method string
	// Tokens is the most draft tokens a step verifies (K, >= 1 when on).
	Tokens int
	// Schedule, when set, picks a step's draft length by its batch size
	// (the most decode requests any rank runs in the step).
	Schedule mambacache.DraftSchedule
	// GateWindow and GateThreshold are the acceptance-rate gate
	// (TensorRT-LLM's acceptance_rate_window_size and
	// acceptance_rate_threshold; gate.go): when fewer than GateThreshold
	// of the drafts of the last GateWindow verifications were accepted,
	// steps stop drafting, but for one probe step in every GateWindow.
	// 0, 0: no gate. The pools must reserve the zero-length padding row
	// for it (mambacache.Config.AcceptanceGating).
	GateWindow    int
	GateThreshold float64
	// Drafter overrides the Method's drafter (tests).
	Drafter model.Drafter
}

// On reports whether speculation is on.
func (c Speculation) On() bool { return c.Method != "" && c.Method != SpecOff }

// validate refuses a speculation the ranks' pools cannot run: an unknown
// or unbuilt method, pools built without it (no scratch rows), a schedule
// step whose draft length has no padding row, or an executor that cannot
// copy a state row.
func (c *Speculation) validate(ranks []*Rank) error {
	if !c.On() {
		return nil
	}
	switch c.Method {
	case SpecNgram:
		if c.Drafter == nil {
			c.Drafter = model.DefaultNgram
		}
	case SpecMTP:
		for _, r := range ranks {
			if !model.HasDraftHead(r.exec) {
				return fmt.Errorf("%w: speculative method %q: model %s has no draft head (look it up with ?mtp=1)",
					ErrInvalidConfig, c.Method, r.exec.Spec().Name)
			}
		}
	default:
		return fmt.Errorf("%w: speculative method %q (want off, ngram or mtp)", ErrInvalidConfig, c.Method)
	}
	if c.Tokens < 1 || c.Tokens > MaxSpeculativeTokens {
		return fmt.Errorf("%w: %d speculative tokens, want 1..%d", ErrInvalidConfig, c.Tokens, MaxSpeculativeTokens)
	}
	if c.GateWindow < 0 || (c.GateWindow > 0) != (c.GateThreshold > 0) || !(c.GateThreshold >= 0 && c.GateThreshold <= 1) {
		return fmt.Errorf("%w: acceptance gate window %d, threshold %v: want both 0, or a window >= 1 and a threshold in (0, 1]",
			ErrInvalidConfig, c.GateWindow, c.GateThreshold)
	}
	for _, r := range ranks {
		m := r.mCfg
		if m.AcceptanceGating != (c.GateWindow > 0) {
			return fmt.Errorf("%w: rank %d's pool reserves a zero-length padding row for an acceptance gate: %v; the gate is on: %v",
				ErrInvalidConfig, r.index, m.AcceptanceGating, c.GateWindow > 0)
		}
		if m.DraftTokens != c.Tokens || m.DraftLenSchedule != c.Schedule {
			return fmt.Errorf("%w: rank %d's pool was built for %d draft tokens, schedule %q; speculation wants %d, %q",
				ErrInvalidConfig, r.index, m.DraftTokens, m.DraftLenSchedule, c.Tokens, c.Schedule)
		}
		for b := 1; b <= m.MaxBatchSize; b++ {
			dl := c.Schedule.DraftLen(b, c.Tokens)
			if _, ok := m.PaddingRowFor(dl); !ok {
				return fmt.Errorf("%w: rank %d: batch size %d drafts %d tokens, and the pool has no padding row for that length",
					ErrInvalidConfig, r.index, b, dl)
			}
		}
		scratch, _ := m.ScratchRow(0)
		mc := model.Cache{KVArena: r.kvArena, KV: r.kvCfg, MambaArena: r.mambaArena, Mamba: m}
		if err := model.CopyState(r.exec, mc, model.StateCopy{FromRow: scratch, ToRow: scratch}); err != nil {
			return fmt.Errorf("%w: rank %d cannot keep a scratch state: %w", ErrInvalidConfig, r.index, err)
		}
	}
	return nil
}

// stepDraftLen is the draft length of the step about to run: the
// schedule's length for the largest decode batch of any rank (attention-DP
// ranks step in lockstep, so they run one graph shape), 0 with speculation
// off.
func (s *Scheduler) stepDraftLen() (dl, batch int) {
	spec := s.cfg.Speculation
	if !spec.On() {
		return 0, 0
	}
	for _, r := range s.ranks {
		n := 0
		for _, q := range r.held {
			if q.phase == PhaseGenerate {
				n++
			}
		}
		batch = max(batch, n)
	}
	// A step with no request generating verifies nothing: it does not ask
	// the gate, so that it spends none of a closed gate's probes.
	if s.gate != nil && batch > 0 {
		allow := s.gate.allow()
		s.m.SpecGated.WithLabelValues(string(s.cfg.Role)).Set(b2f(s.gate.isClosed()))
		if !allow {
			return 0, batch
		}
	}
	return spec.Schedule.DraftLen(max(batch, 1), spec.Tokens), batch
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// drafts sets q.draft to, and returns, the drafts q verifies this step:
// at most dl, and never
// more than the request may still generate less the token the
// verification itself yields, so that a verification writes no position a
// request without speculation would not.
func (s *Scheduler) drafts(r *Rank, q *request, dl int) []int32 {
	q.draft = q.draft[:0]
	shipped := q.shipped
	q.shipped = nil // only the first step verifies them
	k := min(dl, q.maxTokens-q.generated-1)
	if k <= 0 || q.hist == nil {
		return nil
	}
	if len(shipped) > 0 {
		q.draft = append(q.draft, shipped[:min(k, len(shipped))]...)
		s.m.SpecShipped.WithLabelValues(string(s.cfg.Role), s.cfg.Speculation.Method).Add(float64(len(q.draft)))
		return q.draft
	}
	if s.cfg.Speculation.Method == SpecMTP {
		// The draft head reads the request's positions [0, q.pos): its
		// blocks hold them already.
		c, err := r.cache(q.id, q.blocks)
		if err == nil {
			q.draft, err = model.Draft(q.ctx, r.exec, c, q.last, q.pos, k, q.draft[:0])
		}
		if err != nil {
			q.stepErr = fmt.Errorf("worker: request %d: draft head: %w", q.id, err)
			q.draft = q.draft[:0]
		}
		return q.draft
	}
	q.draft = s.cfg.Speculation.Drafter.Draft(q.draft[:0], q.hist, k)
	if len(q.draft) > k { // a drafter that overshoots is cut to its budget
		q.draft = q.draft[:k]
	}
	return q.draft
}

// verify runs one verification step of q on its row (c): q.last and
// drafts at positions q.pos.., then accepts the leading drafts the model
// confirms and the model's own next token, and leaves the row holding the
// state after exactly the tokens q consumed (see Speculation).
func (s *Scheduler) verify(r *Rank, q *request, c model.Cache, drafts []int32) error {
	scratch, ok := c.Mamba.ScratchRow(c.Row)
	if !ok {
		return fmt.Errorf("worker: request %d row %d has no scratch row: %w", q.id, c.Row, ErrInvalidConfig)
	}
	if err := model.CopyState(r.exec, c, model.StateCopy{FromRow: c.Row, ToRow: scratch}); err != nil {
		return err
	}
	fed := append(append(q.fed[:0], q.last), drafts...)
	q.fed = fed
	targets, lps := q.targets[:0], q.lps[:0]
	for i, tok := range fed {
		logits, err := model.DecodeContext(q.ctx, r.exec, c, tok, q.pos+i)
		if err != nil {
			return err
		}
		t, lp := q.sampleAt(logits, q.generated+i)
		targets, lps = append(targets, t), append(lps, lp)
	}
	q.targets, q.lps = targets, lps
	a := model.Accepted(drafts, targets)
	m := 0 // tokens consumed: each emitted token consumed the one fed before it
	for m <= a && !q.finished {
		q.finished = q.accept(targets[m], lps[m])
		m++
	}
	clear(q.lps) // no logprobs kept past the step
	if m < len(fed) {
		// The row ran past what the request consumed: roll back to the
		// state before the step and replay the consumed tokens.
		if err := model.CopyState(r.exec, c, model.StateCopy{FromRow: scratch, ToRow: c.Row}); err != nil {
			return err
		}
		for i, tok := range fed[:m] {
			if _, err := model.DecodeContext(q.ctx, r.exec, c, tok, q.pos+i); err != nil {
				return err
			}
		}
	}
	if q.seq != nil {
		q.seq = append(q.seq, fed[:m]...)
	}
	q.pos += m
	s.m.specObserve(s.cfg.Role, s.cfg.Speculation.Method, len(drafts), min(a, m-1))
	if s.gate != nil {
		s.gate.observe(len(drafts), a)
	}
	return nil
}

// sampleAt picks the token of generation step step from logits.
func (q *request) sampleAt(logits []float32, step int) (int32, *model.Logprobs) {
	g := q.generated
	q.generated = step
	tok, lp := q.sample(logits)
	q.generated = g
	return tok, lp
}

// remember appends tok to q's drafting context, started from its prompt.
func (q *request) remember(tok int32) {
	if !q.spec {
		return
	}
	if q.hist == nil {
		q.hist = slices.Grow(slices.Clone(q.prompt), q.maxTokens)
	}
	q.hist = append(q.hist, tok)
}

// prefillDrafts returns the drafts a prefill-only job asked for, after
// its first token tok: the n-gram drafter over the prompt and tok (the
// Speculation's drafter when one is set), as TensorRT-LLM's context server
// drafts on the prompt's last position and ships DisaggregatedParams'
// draft_tokens. None after EOS.
func (s *Scheduler) prefillDrafts(r *Rank, q *request, c model.Cache, tok int32) ([]int32, error) {
	if q.draftAsk <= 0 || tok == model.EOS {
		return nil, nil
	}
	if model.HasDraftHead(r.exec) {
		// A model with a draft head drafts with it, whatever the decode's
		// method: its prompt positions are all in c.
		out, err := model.Draft(q.ctx, r.exec, c, tok, len(q.prompt), q.draftAsk, nil)
		if err != nil {
			return nil, fmt.Errorf("worker: request %d: draft head: %w", q.id, err)
		}
		return out, nil
	}
	var d model.Drafter = model.DefaultNgram
	if s.cfg.Speculation.Drafter != nil {
		d = s.cfg.Speculation.Drafter
	}
	ctx := append(slices.Clip(q.prompt), tok)
	out := d.Draft(nil, ctx, q.draftAsk)
	return out[:min(len(out), q.draftAsk)], nil
}

// checkShipped refuses the drafts a source shipped with q's first token
// when they are more than q asked for or a token is outside the
// vocabulary (a peer with another model, or a broken one), and keeps them
// for q's first decode step otherwise. Without speculation they are
// ignored.
func (s *Scheduler) checkShipped(q *request, drafts []int32) error {
	if !q.spec || len(drafts) == 0 {
		return nil
	}
	if len(drafts) > s.cfg.Speculation.Tokens {
		return fmt.Errorf("%w: %d draft tokens shipped, %d asked for", ErrTransferFailed, len(drafts), s.cfg.Speculation.Tokens)
	}
	vocab := q.rank.exec.Spec().Vocab
	for i, t := range drafts {
		if t < 0 || int(t) >= vocab {
			return fmt.Errorf("%w: draft token %d is %d: %w (vocabulary of %d)", ErrTransferFailed, i, t, model.ErrInvalidToken, vocab)
		}
	}
	q.shipped = append(q.shipped[:0], drafts...)
	return nil
}
