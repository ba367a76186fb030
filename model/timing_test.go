package model

import (
	"errors"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func h200(t *testing.T, name string) Timing {
	t.Helper()
	e, err := Lookup(name + "?gpu=h200")
	require.NoError(t, err)
	tm, ok := e.(timed)
	require.True(t, ok, "%T", e)
	return tm.Timing
}

func TestLookupGPU(t *testing.T) {
	plain, err := Lookup(NemotronH8B)
	require.NoError(t, err)
	e, err := Lookup(NemotronH8B + "?gpu=h200&mfu=0.4&mbu=0.8")
	require.NoError(t, err)
	st, ok := e.(StepTimer)
	require.True(t, ok, "a ?gpu= executor is a StepTimer")
	require.Equal(t, plain.Spec(), e.Spec())
	require.Equal(t, plain.Spec().Fingerprint(), e.Spec().Fingerprint(), "the simulation is not part of the layout")
	require.Equal(t, 0.4, e.(timed).MFU)
	require.Equal(t, 0.8, e.(timed).MBU)
	require.Positive(t, st.StepTime([]Span{{0, 100}}, nil))
	_, isTimer := plain.(StepTimer)
	require.False(t, isTimer)

	require.IsType(t, plain, e.(timed).Executor, "the math is the preset's own")

	for _, bad := range []string{
		TinyHybrid + "?gpu=h200",            // no compute figures
		NemotronH8B + "?gpu=a100",           // unknown GPU
		NemotronH8B + "?gpu=h200&delay=1ms", // two simulations
		NemotronH8B + "?gpu=h200&mfu=0",     // not a fraction
		NemotronH8B + "?gpu=h200&mbu=1.5",   // not a fraction
		NemotronH8B + "?gpu=h200&mfu=fast",  // not a number
	} {
		_, err := Lookup(bad)
		require.True(t, errors.Is(err, ErrInvalidOption), "%s: %v", bad, err)
	}
}

// The figures follow from the sources named in timing.go; these are the
// formula's values worked by hand.
func TestTimingValues(t *testing.T) {
	n := h200(t, NemotronH8B)
	row := float64(n.rowBytes)
	require.InDelta(t, 49.0, row/(1<<20), 1, "Nemotron-H-8B's Mamba row is about 49 MiB")
	require.InDelta(t, 16384, n.kvToken, 0, "4 layers x K,V x 8 heads x 128 x bf16")
	for _, tc := range []struct {
		name string
		got  time.Duration
		want float64 // seconds
	}{
		// 2·8e9·1024 + 2·(4·32·128)·1024² FLOPs at 0.5 × 989 TFLOPS
		{"prefill 1024", n.PrefillTime(1024), (2*8e9*1024 + 2*16384*1024*1024) / (0.5 * 989e12)},
		// one token is bound by reading the 16 GB of weights at 0.7 × 4.8 TB/s
		{"prefill 1", n.PrefillTime(1), 16e9 / (0.7 * 4.8e12)},
		{"decode 1 at 0", n.DecodeStepTime([]int{0}), (16e9 + 2*row) / (0.7 * 4.8e12)},
		{"decode 2 at 1000", n.DecodeStepTime([]int{1000, 1000}), (16e9 + 2*(1000*16384+2*row)) / (0.7 * 4.8e12)},
	} {
		require.InDelta(t, tc.want, tc.got.Seconds(), 1e-9, tc.name)
	}
	q := h200(t, Qwen3Next80B)
	require.InDelta(t, 3e9, q.weightRead(1), 1e6, "one token reads the 3B active parameters, FP8")
	require.InDelta(t, 80e9, q.weightRead(100000), 1e6, "a huge batch touches every expert")
}

func TestTimingShape(t *testing.T) {
	for _, name := range []string{NemotronH8B, Qwen3Next80B} {
		tm := h200(t, name)
		// attention's quadratic part: 8× the prompt costs more than 8× the time
		require.Greater(t, tm.PrefillTime(65536), 8*tm.PrefillTime(8192), name)
		require.Greater(t, tm.PrefillTime(16384), tm.PrefillTime(8192), name)
		require.GreaterOrEqual(t, tm.PrefillTime(2048), tm.PrefillTime(1024), name) // an MoE prefill of 1-2k tokens reads every expert: weight-bound
		// a decode step grows with batch and context, and batching amortizes the weights
		one := tm.DecodeStepTime([]int{1024})
		batch := make([]int, 64)
		for i := range batch {
			batch[i] = 1024
		}
		require.Greater(t, tm.DecodeStepTime(batch), one, name)
		require.Less(t, tm.DecodeStepTime(batch), 64*one/2, name) // an MoE batch touches more experts: less amortized
		require.Greater(t, tm.DecodeStepTime([]int{8192}), tm.DecodeStepTime([]int{0}), name)
		require.Zero(t, tm.DecodeStepTime(nil))
		require.Zero(t, tm.PrefillTime(0))
		// a mixed step (aggregated serving) costs its prefills and its decode step
		require.Equal(t, tm.PrefillTime(500)+tm.PrefillTime(700)+tm.DecodeStepTime(batch),
			tm.StepTime([]Span{{0, 500}, {0, 700}}, batch), name)
		require.False(t, math.IsNaN(tm.PrefillTime(1).Seconds()))
	}
	// Nemotron-H-8B at batch 1: a few milliseconds per token, tens for a 1k prompt.
	n := h200(t, NemotronH8B)
	require.InDelta(t, 5e-3, n.DecodeStepTime([]int{512}).Seconds(), 1e-3)
	require.InDelta(t, 33e-3, n.PrefillTime(1024).Seconds(), 2e-3)
}
