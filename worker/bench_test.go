package worker

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

func BenchmarkPlanStep(b *testing.B) {
	ls := loads(ph(PhaseGenerate, PhaseAwaitCache), nil, ph(PhasePush), ph(PhaseContext, PhaseGenerate, PhaseGenerate))
	b.ReportAllocs()
	for range b.N {
		_ = PlanStep(ls, true)
	}
}

// BenchmarkSchedulerGenerate measures generated tokens through the scheduler's
// loop (local prefill, tiny-hybrid), 2 ranks of 4 requests: ns/op is per
// token, so the loop's own overhead shows against the model's compute.
func BenchmarkSchedulerGenerate(b *testing.B) {
	ranks := newRanks(b, rankOpts{ranks: 2, batch: 4, adp: true})
	sched := newScheduler(b, Config{AttentionDP: true}, ranks)
	prompt := model.Encode("benchmark the lockstep loop")
	const perRequest = 32
	b.ReportAllocs()
	b.ResetTimer()
	for done := 0; done < b.N; {
		var streams []*Stream
		for range 8 {
			s, err := sched.Generate(context.Background(), GenerateRequest{Prompt: prompt, MaxTokens: perRequest, Sampling: Sampling{Temperature: 0.5, Seed: uint64(done)}})
			require.NoError(b, err)
			streams = append(streams, s)
		}
		for _, s := range streams {
			toks, ev := drainStream(b, s)
			require.NoError(b, ev.Err)
			done += len(toks)
		}
	}
}
