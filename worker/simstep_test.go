package worker

import (
	"context"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/model"
)

// stepRecorder is a StepTimer that records what each step held.
type stepRecorder struct {
	model.Executor
	prefill, decode time.Duration // per prefill, per decode step

	mu    sync.Mutex
	steps [][2][]int
}

// StepTime records a prefill span as its end when it starts at 0 (a whole
// prompt of 100 is 100) and as -(From<<16 | To) otherwise.
func (s *stepRecorder) StepTime(prefills []model.Span, decodes []int) time.Duration {
	var ps []int
	for _, sp := range prefills {
		if sp.From == 0 {
			ps = append(ps, sp.To)
		} else {
			ps = append(ps, -(sp.From<<16 | sp.To))
		}
	}
	s.mu.Lock()
	s.steps = append(s.steps, [2][]int{ps, append([]int(nil), decodes...)})
	s.mu.Unlock()
	d := time.Duration(len(prefills)) * s.prefill
	if len(decodes) > 0 {
		d += s.decode
	}
	return d
}

func wholePrompt(q *request) model.Span { return q.chunk(0, 0) }

// A step costs what the StepTimer says for the requests it runs (their
// prompts for those in prefill, their positions for those decoding, a
// context-0 decode for the ADP dummy): the prefills are slept before the
// step's work, the decodes overlap it (the longer of the two counts); a
// cancelled context cuts the waits short.
func TestSimulateStep(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := &stepRecorder{prefill: 30 * time.Millisecond, decode: 5 * time.Millisecond}
		held := []*request{
			{phase: PhaseContext, prompt: make([]int32, 100)},
			{phase: PhaseGenerate, pos: 42},
			{phase: PhaseAwaitCache, prompt: make([]int32, 7)}, // not in the step
			{phase: PhaseGenerate, pos: 9},
			{phase: PhaseContext, prompt: make([]int32, 50), fromCache: true}, // a state served: a copy
			{phase: PhaseGenerate, pos: 300, adopt: true},                     // a state adopted: a copy
		}
		start := time.Now()
		wait := simulateStep(t.Context(), st, held, false, wholePrompt)
		require.Equal(t, 30*time.Millisecond, time.Since(start), "the prefill is done before the step runs")
		time.Sleep(3 * time.Millisecond) // the step's own work, shorter than its decode
		wait()
		require.Equal(t, 35*time.Millisecond, time.Since(start))
		require.Equal(t, [][2][]int{{{100}, nil}, {nil, {42, 9}}}, st.steps)

		start = time.Now()
		wait = simulateStep(t.Context(), st, held, false, wholePrompt)
		time.Sleep(50 * time.Millisecond) // work longer than the simulated decode
		wait()
		require.Equal(t, 80*time.Millisecond, time.Since(start))

		st.steps = nil
		start = time.Now()
		simulateStep(t.Context(), st, nil, true, wholePrompt)()
		require.Equal(t, 5*time.Millisecond, time.Since(start))
		require.Equal(t, [][2][]int{{nil, {0}}}, st.steps, "the ADP dummy: one decode at context 0")

		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Millisecond)
		defer cancel()
		start = time.Now()
		simulateStep(ctx, st, held, false, wholePrompt)()
		require.Equal(t, 10*time.Millisecond, time.Since(start), "the waits end with the context")
	})
}

// The scheduler asks a simulating executor for every step's time: one prefill
// of the prompt, then one decode step per further token, at growing
// positions; the request takes at least their sum.
func TestSchedulerSleepsSimulatedSteps(t *testing.T) {
	exec, err := model.Lookup(model.TinyHybrid)
	require.NoError(t, err)
	st := &stepRecorder{Executor: exec, prefill: 40 * time.Millisecond, decode: 10 * time.Millisecond}
	cfg, err := PoolConfig(exec.Spec(), PoolParams{MaxBatchSize: 1})
	require.NoError(t, err)
	m, err := hybrid.New(cfg)
	require.NoError(t, err)
	r, err := NewRank(0, m, st, make([]byte, cfg.KV.ArenaBytes()), make([]byte, cfg.Mamba.ArenaBytes()))
	require.NoError(t, err)
	sched := newScheduler(t, Config{}, []*Rank{r})

	start := time.Now()
	s, err := sched.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("hello, timing"), MaxTokens: 4,
		Sampling: Sampling{Temperature: 0}})
	require.NoError(t, err)
	toks, ev := drainStream(t, s)
	require.NoError(t, ev.Err)
	elapsed := time.Since(start)

	st.mu.Lock()
	defer st.mu.Unlock()
	require.NotEmpty(t, st.steps)
	require.Equal(t, [2][]int{{13}, nil}, st.steps[0], "the first step prefills the 13-byte prompt")
	for i, step := range st.steps[1:] {
		require.Empty(t, step[0])
		require.Equal(t, []int{13 + i}, step[1], "decode step %d", i)
	}
	require.Len(t, st.steps, len(toks), "one prefill, then a decode step per further token")
	require.GreaterOrEqual(t, elapsed, 40*time.Millisecond+time.Duration(len(toks)-1)*10*time.Millisecond)
}

// verifyRecorder is a stepRecorder that also prices verification steps.
type verifyRecorder struct {
	stepRecorder
	verify time.Duration
	tokens [][]int
}

func (v *verifyRecorder) VerifyStepTime(contexts, tokens []int) time.Duration {
	v.mu.Lock()
	v.tokens = append(v.tokens, append([]int(nil), tokens...))
	v.mu.Unlock()
	return v.verify
}

// A step in which some request verifies drafts is priced as one
// verification (its positions per request, the dummy's 1); a step with
// none is a plain decode step, so speculation with no drafts costs as
// much as none.
func TestSimulateVerifyStep(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := &verifyRecorder{stepRecorder: stepRecorder{decode: 5 * time.Millisecond}, verify: 6 * time.Millisecond}
		held := []*request{
			{phase: PhaseGenerate, pos: 42, draft: []int32{1, 2, 3}},
			{phase: PhaseGenerate, pos: 9},
		}
		start := time.Now()
		simulateStep(t.Context(), st, held, true, wholePrompt)()
		require.Equal(t, 6*time.Millisecond, time.Since(start))
		require.Equal(t, [][]int{{1, 4, 1}}, st.tokens)
		require.Empty(t, st.steps)

		held[0].draft = held[0].draft[:0]
		start = time.Now()
		simulateStep(t.Context(), st, held, false, wholePrompt)()
		require.Equal(t, 5*time.Millisecond, time.Since(start))
		require.Len(t, st.tokens, 1, "no drafts: a decode step")
	})
}
