package worker

import (
	"context"
	"time"

	"github.com/handoff-io/handoff/model"
)

// simulateStep runs the simulated compute of the step a rank is about to
// run, when its executor simulates a GPU (model.StepTimer, a model looked up
// with "?gpu=h200"). The prompt of each request the step prefills and the
// context of each it decodes go to StepTime, in two parts (a prefill
// counts the positions its step computes, span: from where a prefix-cache
// hit or its earlier chunks left it to the end of its prompt or chunk):
//
//   - the prefills' time is slept (never spun) here, before the step: a
//     prefill's result (its first token, or the lease a remote decode
//     waits for) leaves during the step, so it must not leave before its
//     compute is done; the executor's own CPU work comes on top;
//   - the decodes' time ends at a deadline that the returned func waits
//     for after the step: the step's own work overlaps it, so decode steps
//     follow each other at the simulated pace, or at the executor's where
//     that is slower (then the CPU, not the simulated GPU, is the
//     bottleneck).
//
// A step that holds both takes their sum, so prefill stalls the decodes
// that share its step, as on a GPU that runs them together. A dummy-only
// step (ADP padding) costs one decode at context 0. Both waits end early
// when ctx ends.
//
// With speculative decoding a request that verifies drafts this step
// (q.draft, drafted before the step) runs 1+len(q.draft) positions: the
// decode part is then priced by model.VerifyTimer when st has it (one
// forward pass: memory-bound at low batch, about one step).
//
// A state served from the cache or adopted (state.go) runs no forward
// pass and costs nothing here.
func simulateStep(ctx context.Context, st model.StepTimer, held []*request, dummy bool, span func(*request) model.Span) (wait func()) {
	var prefills []model.Span
	var decodes, tokens []int
	drafts := false
	if dummy {
		decodes, tokens = append(decodes, 0), append(tokens, 1)
	}
	for _, q := range held {
		if q.fromCache || q.adopt {
			// A returned state (state.go) computes nothing: a row copy,
			// microseconds on a GPU.
			continue
		}
		switch q.phase {
		case PhaseContext:
			prefills = append(prefills, span(q))
		case PhaseGenerate:
			decodes, tokens = append(decodes, q.pos), append(tokens, 1+len(q.draft))
			drafts = drafts || len(q.draft) > 0
		}
	}
	if len(prefills) > 0 {
		sleepUntil(ctx, time.Now().Add(st.StepTime(prefills, nil)))
	}
	deadline := time.Now()
	if vt, ok := st.(model.VerifyTimer); ok && drafts {
		deadline = deadline.Add(vt.VerifyStepTime(decodes, tokens))
	} else if len(decodes) > 0 {
		deadline = deadline.Add(st.StepTime(nil, decodes))
	}
	return func() { sleepUntil(ctx, deadline) }
}

// sleepUntil returns at t or when ctx ends.
func sleepUntil(ctx context.Context, t time.Time) {
	d := time.Until(t)
	if d <= 0 {
		return
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-ctx.Done():
	case <-tm.C:
	}
}
