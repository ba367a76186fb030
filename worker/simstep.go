package worker

import (
	"context"
	"time"

	"github.com/handoff-io/handoff/model"
)

// simulateStep starts the simulated compute time of the step a rank is
// about to run, when its executor simulates a GPU (model.StepTimer, a model
// looked up with "?gpu=h200"), and returns the wait that ends it: the
// prompt of each request the step prefills and the context of each it
// decodes go to StepTime, and the returned func sleeps (never spins) until
// that long after the call, or until ctx ends. Called before the step and
// waited after it, the step lasts the simulated time, or the executor's
// own work where that is longer (then the CPU, not the simulated GPU, is
// the bottleneck). A dummy-only step (ADP padding) costs one decode at
// context 0. Prefill sharing a step with decodes makes the step, and so
// every decode in it, longer, as on a GPU that runs them together.
func simulateStep(ctx context.Context, st model.StepTimer, held []*request, dummy bool) (wait func()) {
	var prefills, decodes []int
	if dummy {
		decodes = append(decodes, 0)
	}
	for _, q := range held {
		switch q.phase {
		case PhaseContext:
			prefills = append(prefills, len(q.prompt))
		case PhaseGenerate:
			decodes = append(decodes, q.pos)
		}
	}
	deadline := time.Now().Add(st.StepTime(prefills, decodes))
	return func() {
		d := time.Until(deadline)
		if d <= 0 {
			return
		}
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-ctx.Done():
		case <-t.C:
		}
	}
}
