package serving

import (
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// vLLM's convention: [floor(L(1-r)), ceil(L(1+r))], never below 1.
func TestLengthRange(t *testing.T) {
	for _, tc := range []struct {
		l      int
		r      float64
		lo, hi int
	}{
		{1024, 0, 1024, 1024},
		{1024, 0.5, 512, 1536},
		{128, 0.1, 115, 141}, // 115.2 down, 140.8 up
		{10, 0.25, 7, 13},
		{1, 0.99, 1, 2},
		{3, 0.9, 1, 6}, // floor(0.3) = 0, raised to 1
	} {
		lo, hi := LengthRange(tc.l, tc.r)
		require.Equal(t, [2]int{tc.lo, tc.hi}, [2]int{lo, hi}, "L=%d r=%v", tc.l, tc.r)
	}
}

func TestRandomRequests(t *testing.T) {
	const n = 2000
	for _, unit := range []Unit{UnitBytes, UnitWords} {
		reqs := RandomRequests(n, 100, 20, 0.5, unit, rand.New(rand.NewPCG(1, 1)))
		require.Len(t, reqs, n)
		seenIn, seenOut := map[int]bool{}, map[int]bool{}
		for _, r := range reqs {
			require.GreaterOrEqual(t, r.PromptLen, 50)
			require.LessOrEqual(t, r.PromptLen, 150)
			require.GreaterOrEqual(t, r.OutputLen, 10)
			require.LessOrEqual(t, r.OutputLen, 30)
			seenIn[r.PromptLen], seenOut[r.OutputLen] = true, true
			switch unit {
			case UnitBytes:
				require.Len(t, r.Prompt, r.PromptLen)
			case UnitWords:
				require.Len(t, strings.Fields(r.Prompt), r.PromptLen)
			}
		}
		require.True(t, seenIn[50] && seenIn[150] && seenOut[10] && seenOut[30], "both ends of the ranges are drawn")
		again := RandomRequests(n, 100, 20, 0.5, unit, rand.New(rand.NewPCG(1, 1)))
		require.Equal(t, reqs, again, "the seed fixes the dataset")
	}
	fixed := RandomRequests(10, 64, 8, 0, UnitBytes, rand.New(rand.NewPCG(2, 2)))
	for _, r := range fixed {
		require.Equal(t, 64, r.PromptLen)
		require.Equal(t, 8, r.OutputLen)
	}
}

func TestPromptIsPrintableASCII(t *testing.T) {
	p := Prompt(UnitBytes, 5000, rand.New(rand.NewPCG(5, 5)))
	for i := range len(p) {
		require.True(t, p[i] == ' ' || (p[i] >= 'a' && p[i] <= 'z'), "byte %d is %q", i, p[i])
	}
	require.Len(t, Prompt(UnitBytes, 1, rand.New(rand.NewPCG(5, 5))), 1)
}

func TestParseUnit(t *testing.T) {
	u, err := ParseUnit("bytes")
	require.NoError(t, err)
	require.Equal(t, UnitBytes, u)
	_, err = ParseUnit("tokens")
	require.Error(t, err)
}
