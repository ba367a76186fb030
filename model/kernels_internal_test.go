package model

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestExp32(t *testing.T) {
	for x := float32(-103); x <= 88.5; x += 0.0137 {
		want := math.Exp(float64(x))
		got := float64(exp32(x))
		if want < 1e-37 { // float32 subnormals lose relative precision
			require.InDelta(t, want, got, 1e-44, "x=%v", x)
			continue
		}
		require.InEpsilon(t, want, got, 3e-7, "x=%v", x)
	}
	require.Equal(t, float32(1), exp32(0))
	require.Zero(t, exp32(-200))
	require.True(t, math.IsInf(float64(exp32(100)), 1))
	require.Zero(t, exp32(float32(math.Inf(-1))))
	require.True(t, math.IsNaN(float64(exp32(float32(math.NaN())))))
}

func TestFillPattern(t *testing.T) {
	for _, n := range []int{0, 1, 7, 8, 9, 1023, 1024, 1025, 5000} {
		a := make([]byte, n)
		b := make([]byte, n)
		for i := range b {
			b[i] = 0xff
		}
		fillPattern(a, 42)
		fillPattern(b, 42)
		require.Equal(t, a, b, "n=%d: every byte written, deterministically", n)
		if n >= 16 {
			c := make([]byte, n)
			fillPattern(c, 43)
			require.NotEqual(t, a, c, "seed matters")
		}
	}
}

func TestDot(t *testing.T) {
	for n := range 11 {
		a := make([]float32, n)
		b := make([]float32, n)
		var want float32
		for i := range a {
			a[i], b[i] = float32(i+1), float32(2*i-3)
			want += a[i] * b[i]
		}
		require.Equal(t, want, dot(a, b), "n=%d", n) // small integers: exact
	}
}
