package worker

import (
	"context"
	"time"

	"github.com/handoff-io/handoff/model"
)

// simulateStep sleeps the simulated compute time of the step a rank is
// about to run, when its executor simulates a GPU (model.StepTimer, a model
// looked up with "?gpu=h200"): the prompt of each request it prefills and
// the context of each it decodes go to StepTime, and the rank's step waits
// that long (slept, not spun) or until ctx ends. A dummy-only step (ADP
// padding) costs one decode at context 0. Prefill sharing a step with
// decodes makes the step, and so every decode in it, longer, as on a GPU
// that runs them together.
func simulateStep(ctx context.Context, st model.StepTimer, held []*request, dummy bool) {
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
	d := st.StepTime(prefills, decodes)
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
