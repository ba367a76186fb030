package model_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
)

func TestNames(t *testing.T) {
	names := model.Names()
	require.IsIncreasing(t, names)
	for _, want := range []string{model.TinyHybrid, model.NemotronH8B, model.Qwen3Next80B} {
		require.Contains(t, names, want)
		e, err := model.Lookup(want)
		require.NoError(t, err)
		require.Equal(t, want, e.Spec().Name)
		require.Equal(t, model.ByteVocab, e.Spec().Vocab)
	}
}

func TestLookup(t *testing.T) {
	cases := []struct {
		name    string
		in      string
		err     error
		ssm     int // expected SSM element size, 0 to skip
		delayed bool
	}{
		{name: "tiny", in: "tiny-hybrid"},
		{name: "spaces trimmed", in: "  tiny-hybrid "},
		{name: "unknown", in: "gpt-5", err: model.ErrUnknownModel},
		{name: "empty", in: "", err: model.ErrUnknownModel},
		{name: "case matters", in: "Tiny-Hybrid", err: model.ErrUnknownModel},
		{name: "delay", in: "nemotron-h-8b?delay=2ms", ssm: 2, delayed: true},
		{name: "split delays", in: "qwen3-next-80b?prefill_delay=1ms&decode_delay=0s", delayed: true},
		{name: "fp32 ssm", in: "nemotron-h-8b?ssm_dtype=fp32", ssm: 4},
		{name: "tiny delay", in: "tiny-hybrid?decode_delay=1us", delayed: true},
		{name: "tiny refuses bf16 ssm", in: "tiny-hybrid?ssm_dtype=bf16", err: model.ErrInvalidOption},
		{name: "bad dtype", in: "nemotron-h-8b?ssm_dtype=fp8", err: model.ErrInvalidOption},
		{name: "touch head", in: "nemotron-h-8b?gpu=h200&touch=head", ssm: 2},
		{name: "touch full", in: "qwen3-next-80b?touch=full"},
		{name: "bad touch", in: "nemotron-h-8b?touch=tail", err: model.ErrInvalidOption},
		{name: "tiny refuses touch", in: "tiny-hybrid?touch=head", err: model.ErrInvalidOption},
		{name: "bad duration", in: "nemotron-h-8b?delay=fast", err: model.ErrInvalidOption},
		{name: "negative delay", in: "nemotron-h-8b?delay=-1ms", err: model.ErrInvalidOption},
		{name: "huge delay", in: "nemotron-h-8b?delay=2h", err: model.ErrInvalidOption},
		{name: "unknown option", in: "nemotron-h-8b?tp=2", err: model.ErrInvalidOption},
		{name: "repeated option", in: "nemotron-h-8b?delay=1ms&delay=2ms", err: model.ErrInvalidOption},
		{name: "bad query", in: "nemotron-h-8b?delay=%zz", err: model.ErrInvalidOption},
		{name: "unknown with options", in: "nope?delay=1ms", err: model.ErrUnknownModel},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e, err := model.Lookup(tc.in)
			if tc.err != nil {
				require.ErrorIs(t, err, tc.err)
				require.Nil(t, e)
				return
			}
			require.NoError(t, err)
			if tc.ssm != 0 {
				require.Equal(t, tc.ssm, e.Spec().Mamba.SSMElemSize)
			}
			_, isCtx := e.(model.ContextExecutor)
			require.Equal(t, tc.delayed, isCtx)
		})
	}
}

func TestFingerprint(t *testing.T) {
	base := lookup(t, model.TinyHybrid).Spec()
	fp := base.Fingerprint()
	require.Len(t, fp, 16)
	require.Equal(t, fp, lookup(t, model.TinyHybrid).Spec().Fingerprint(), "stable")

	// Pool sizing and limits are not part of it.
	same := base
	same.KV.Blocks = 100
	same.KV.ByteBudget = 1 << 20
	same.Mamba.MaxBatchSize = 8
	same.Mamba.PPSize = 2
	same.Mamba.AttentionDP = true
	same.Mamba.MaxDraftTokens = 3
	same.MaxContext = 7
	require.Equal(t, fp, same.Fingerprint())

	mutations := map[string]func(*model.Spec){
		"name":             func(s *model.Spec) { s.Name = "tiny-hybrid2" },
		"revision":         func(s *model.Spec) { s.Revision += "+1" },
		"pattern":          func(s *model.Spec) { s.LayerPattern = "M*M-M-*" },
		"vocab":            func(s *model.Spec) { s.Vocab++ },
		"kv layers":        func(s *model.Spec) { s.KV.Layers++ },
		"kv heads":         func(s *model.Spec) { s.KV.KVHeads++ },
		"kv head dim":      func(s *model.Spec) { s.KV.HeadDim++ },
		"kv elem":          func(s *model.Spec) { s.KV.ElemSize = 2 },
		"tokens per block": func(s *model.Spec) { s.KV.TokensPerBlock = 32 },
		"mamba layers":     func(s *model.Spec) { s.Mamba.Layers++ },
		"d state":          func(s *model.Spec) { s.Mamba.DState++ },
		"d conv":           func(s *model.Spec) { s.Mamba.DConv++ },
		"heads":            func(s *model.Spec) { s.Mamba.Heads++ },
		"head dim":         func(s *model.Spec) { s.Mamba.HeadDim++ },
		"groups":           func(s *model.Spec) { s.Mamba.NGroups++ },
		"conv elem":        func(s *model.Spec) { s.Mamba.ConvElemSize = 2 },
		"ssm elem":         func(s *model.Spec) { s.Mamba.SSMElemSize = 2 },
		"conv layout":      func(s *model.Spec) { s.Mamba.ConvLayout = mambacache.ConvQKV },
	}
	seen := map[string]string{fp: "base"}
	for name, mutate := range mutations {
		s := base
		mutate(&s)
		got := s.Fingerprint()
		prev, dup := seen[got]
		require.False(t, dup, "%s collides with %s", name, prev)
		seen[got] = name
	}

	// Presets differ from each other and with their SSM dtype.
	for _, name := range []string{model.NemotronH8B, model.Qwen3Next80B, model.NemotronH8B + "?ssm_dtype=fp32"} {
		got := lookup(t, name).Spec().Fingerprint()
		_, dup := seen[got]
		require.False(t, dup, name)
		seen[got] = name
	}
	// A delay is not part of the layout.
	require.Equal(t, lookup(t, model.NemotronH8B).Spec().Fingerprint(),
		lookup(t, model.NemotronH8B+"?delay=1ms").Spec().Fingerprint())
}

// Bad calls return the right sentinel and leave the cache as it was.
func TestInvalidCalls(t *testing.T) {
	for _, e := range smallExecutors(t) {
		t.Run(e.Spec().Name, func(t *testing.T) { checkInvalidCalls(t, e) })
	}
}

func checkInvalidCalls(t *testing.T, e model.Executor) {
	spec := e.Spec()
	tpb := spec.KV.TokensPerBlock
	a := newArenas(t, spec, 2, 1)
	a.fill(0x33)
	good := a.cache(0, 0, 1)
	toks := prompt(tpb+1, 1)

	wrongKV := good
	wrongKV.KV.KVHeads++
	wrongMamba := good
	wrongMamba.Mamba.DState *= 2
	wrongLayout := good
	wrongLayout.Mamba.ConvLayout ^= 1
	zeroTPB := good
	zeroTPB.KV.TokensPerBlock = 0
	oneBlock := a.cache(0, 0)
	farBlock := a.cache(0, 0, 2) // the arena holds blocks 0 and 1
	farRow := a.cache(mambacache.Row(a.mamba.TotalRows()), 0, 1)
	shortKV := good
	shortKV.KVArena = a.kvMem[:len(a.kvMem)-1]
	shortMamba := good
	shortMamba.MambaArena = a.mMem[:len(a.mMem)-1]

	cases := []struct {
		name string
		call func() ([]float32, error)
		err  error
	}{
		{"empty prompt", func() ([]float32, error) { return e.Prefill(good, nil) }, model.ErrEmptyPrompt},
		{"token too big", func() ([]float32, error) { return e.Prefill(good, []int32{1, model.ByteVocab}) }, model.ErrInvalidToken},
		{"negative token", func() ([]float32, error) { return e.Prefill(good, []int32{-1}) }, model.ErrInvalidToken},
		{"decode bad token", func() ([]float32, error) { return e.Decode(good, 300, 0) }, model.ErrInvalidToken},
		{"decode negative pos", func() ([]float32, error) { return e.Decode(good, 1, -1) }, model.ErrContextTooLong},
		{"decode past context", func() ([]float32, error) { return e.Decode(good, 1, spec.MaxContext) }, model.ErrContextTooLong},
		{"prompt past context", func() ([]float32, error) { return e.Prefill(good, make([]int32, spec.MaxContext+1)) }, model.ErrContextTooLong},
		{"kv shape", func() ([]float32, error) { return e.Prefill(wrongKV, toks) }, model.ErrInvalidCache},
		{"mamba shape", func() ([]float32, error) { return e.Prefill(wrongMamba, toks) }, model.ErrInvalidCache},
		{"conv layout", func() ([]float32, error) { return e.Prefill(wrongLayout, toks) }, model.ErrInvalidCache},
		{"tokens per block", func() ([]float32, error) { return e.Prefill(zeroTPB, toks) }, model.ErrInvalidCache},
		{"too few blocks", func() ([]float32, error) { return e.Prefill(oneBlock, toks) }, model.ErrInvalidCache},
		{"decode too few blocks", func() ([]float32, error) { return e.Decode(oneBlock, 1, tpb) }, model.ErrInvalidCache},
		{"block outside arena", func() ([]float32, error) { return e.Prefill(farBlock, toks) }, model.ErrInvalidCache},
		{"row outside arena", func() ([]float32, error) { return e.Prefill(farRow, toks) }, model.ErrInvalidCache},
		{"short kv arena", func() ([]float32, error) { return e.Prefill(shortKV, toks) }, model.ErrInvalidCache},
		{"short mamba arena", func() ([]float32, error) { return e.Decode(shortMamba, 1, 0) }, model.ErrInvalidCache},
	}
	for _, tc := range cases {
		logits, err := tc.call()
		require.ErrorIs(t, err, tc.err, tc.name)
		require.Nil(t, logits, tc.name)
		require.True(t, all(a.kvMem, 0x33), "%s: kv arena written", tc.name)
		require.True(t, all(a.mMem, 0x33), "%s: mamba arena written", tc.name)
	}
}

func TestDelay(t *testing.T) {
	e := lookup(t, model.TinyHybrid+"?prefill_delay=50ms&decode_delay=50ms")
	a := newArenas(t, e.Spec(), 1, 1)
	a.fill(0x11)
	c := a.cache(0, 0)

	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	_, err := model.PrefillContext(ctx, e, c, prompt(4, 0))
	require.ErrorIs(t, err, context.DeadlineExceeded)
	_, err = model.DecodeContext(ctx, e, c, 1, 0)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.True(t, all(a.mMem, 0x11), "cancelled call wrote state")
	require.True(t, all(a.kvMem, 0x11), "cancelled call wrote state")

	// The delayed executor computes exactly what the plain one does.
	plain := lookup(t, model.TinyHybrid)
	want, err := plain.Prefill(c, prompt(4, 0))
	require.NoError(t, err)
	got, err := model.PrefillContext(context.Background(), e, c, prompt(4, 0))
	require.NoError(t, err)
	require.Equal(t, bits(want), bits(got))

	// A plain executor honours an already-cancelled context too.
	done, stop := context.WithCancel(context.Background())
	stop()
	_, err = model.PrefillContext(done, plain, c, prompt(4, 0))
	require.True(t, errors.Is(err, context.Canceled))
	_, err = model.DecodeContext(done, plain, c, 1, 0)
	require.True(t, errors.Is(err, context.Canceled))
}

// Lookup parses untrusted names (flags, HTTP "model" fields): it never panics
// and fails only with its sentinels.
func FuzzLookup(f *testing.F) {
	for _, s := range []string{"tiny-hybrid", "nemotron-h-8b?delay=2ms", "qwen3-next-80b?ssm_dtype=fp32&decode_delay=1ms",
		"x?%", "tiny-hybrid?delay=1ms&delay=2ms", "?", "nemotron-h-8b?prefill_delay=-5s"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		e, err := model.Lookup(name)
		if err != nil {
			require.True(t, errors.Is(err, model.ErrUnknownModel) || errors.Is(err, model.ErrInvalidOption), err)
			require.Nil(t, e)
			return
		}
		require.Contains(t, model.Names(), e.Spec().Name)
	})
}
