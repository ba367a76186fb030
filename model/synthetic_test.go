package model_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
)

// Shapes from the TensorRT-LLM reference (section 6): conv and SSM bytes per
// layer, whole-row bytes, KV bytes per token.
func TestPresetShapes(t *testing.T) {
	const KiB, MiB = 1 << 10, 1 << 20
	cases := []struct {
		name                string
		mamba, attn         int
		convDim             int
		convLayer, ssmLayer int64
		kvPerToken          int64
		layout              mambacache.ConvLayout
	}{
		{model.NemotronH8B, 24, 4, 10240, 60 * KiB, 2 * MiB, 16 * KiB, mambacache.ConvXBC},
		{model.NemotronH8B + "?ssm_dtype=fp32", 24, 4, 10240, 60 * KiB, 4 * MiB, 16 * KiB, mambacache.ConvXBC},
		{model.Qwen3Next80B, 36, 12, 8192, 48 * KiB, 1 * MiB, 24 * KiB, mambacache.ConvQKV},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			spec := lookup(t, tc.name).Spec()
			require.Equal(t, tc.mamba, spec.Mamba.Layers)
			require.Equal(t, tc.attn, spec.KV.Layers)
			require.Equal(t, tc.layout, spec.Mamba.ConvLayout)
			require.Len(t, spec.LayerPattern, tc.mamba+tc.attn+countMLP(spec.LayerPattern))
			m := spec.Mamba
			m.MaxBatchSize = 1
			require.Equal(t, tc.convDim, m.ConvDim())
			var conv int64
			for s := range 3 {
				conv += m.ConvExtent(0, 0, mambacache.Section(s)).Length
			}
			require.Equal(t, tc.convLayer, conv)
			require.Equal(t, tc.ssmLayer, m.SSMExtent(0, 0).Length)
			require.Equal(t, int64(tc.mamba)*(tc.convLayer+tc.ssmLayer), m.RowBytes())
			kv := spec.KV
			kv.Blocks = 1
			require.Equal(t, tc.kvPerToken*int64(kv.TokensPerBlock), kv.BlockBytes())
		})
	}
}

func countMLP(p string) int {
	n := 0
	for _, c := range p {
		if c == '-' {
			n++
		}
	}
	return n
}

// Synthetic prefill writes every byte of the row and of the prompt's K/V, and
// is deterministic; decode is deterministic given the cache bytes.
func TestSyntheticFillsState(t *testing.T) {
	for _, e := range smallExecutors(t)[1:] {
		t.Run(e.Spec().Name, func(t *testing.T) { checkFillsState(t, e) })
	}
}

func checkFillsState(t *testing.T, e model.Executor) {
	spec := e.Spec()
	n := spec.KV.TokensPerBlock*2 + 3
	toks := prompt(n, 3)
	var states [][]byte
	var logits [][]float32
	for _, garbage := range []byte{0x00, 0xff} {
		a := newArenas(t, spec, 3, 1)
		a.fill(garbage)
		c := a.cache(0, 2, 0, 1)
		l, err := e.Prefill(c, toks)
		require.NoError(t, err)
		l2, err := e.Decode(c, 'q', n)
		require.NoError(t, err)
		states = append(states, state(c, n+1))
		logits = append(logits, l, l2)
	}
	require.Equal(t, states[0], states[1], "state independent of previous contents")
	require.Equal(t, bits(logits[0]), bits(logits[2]))
	require.Equal(t, bits(logits[1]), bits(logits[3]))
	require.NotEqual(t, bits(logits[0]), bits(logits[1]))

	// Another prompt gives another state and other logits.
	a := newArenas(t, spec, 3, 1)
	c := a.cache(0, 2, 0, 1)
	l, err := e.Prefill(c, prompt(n, 4))
	require.NoError(t, err)
	require.NotEqual(t, bits(logits[0]), bits(l))
	require.NotEqual(t, states[0][:n], state(c, n)[:n])
}

// With a decode touch, a decode step depends on the head of each state
// section and on nothing beyond it, rewrites only that head, and prefill
// still writes the whole row.
func TestSyntheticDecodeTouchHead(t *testing.T) {
	spec := touchSpec
	const touch = touchBytes
	e, err := model.NewSyntheticTouch("synthetic-touch", spec, touch)
	require.NoError(t, err)
	n := 11
	run := func(mutate func(a *arenas)) (decoded []uint32, row []byte) {
		a := newArenas(t, e.Spec(), 4, 1)
		c := a.cache(0, 0, 1)
		_, err := e.Prefill(c, prompt(n, 5))
		require.NoError(t, err)
		ext := a.mamba.RowExtent(0)
		require.False(t, all(a.mMem[ext.Offset:ext.End()], 0), "prefill writes the row")
		if mutate != nil {
			mutate(a)
		}
		l, err := e.Decode(c, 'q', n)
		require.NoError(t, err)
		return bits(l), append([]byte(nil), a.mMem[ext.Offset:ext.End()]...)
	}
	base, row := run(nil)
	ssm := func(a *arenas) mambacache.Extent { return a.mamba.SSMExtent(0, 0) }
	tail, tailRow := run(func(a *arenas) { a.mMem[ssm(a).End()-1] ^= 0xff })
	require.Equal(t, base, tail, "a byte beyond the head is not read")
	require.NotEqual(t, row, tailRow, "nor rewritten: it keeps the flipped value")
	headLogits, _ := run(func(a *arenas) { a.mMem[ssm(a).Offset+touch-1] ^= 0xff })
	require.NotEqual(t, base, headLogits, "a byte of the head is read")

	full, err := model.NewSynthetic("synthetic-touch", spec)
	require.NoError(t, err)
	a := newArenas(t, full.Spec(), 4, 1)
	c := a.cache(0, 0, 1)
	_, err = full.Prefill(c, prompt(n, 5))
	require.NoError(t, err)
	ext := a.mamba.RowExtent(0)
	_, rowAfterPrefill := run(func(b *arenas) {
		require.Equal(t, a.mMem[ext.Offset:ext.End()], b.mMem[ext.Offset:ext.End()], "prefill is the same with and without a touch")
	})
	require.NotNil(t, rowAfterPrefill)
}
