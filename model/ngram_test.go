package model

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestNgramDraft(t *testing.T) {
	d := NgramDrafter{MinN: 1, MaxN: 3}
	tests := []struct {
		name    string
		context []int32
		k       int
		want    []int32
	}{
		{"empty", nil, 4, nil},
		{"one token", []int32{7}, 4, nil},
		{"no repeat", []int32{1, 2, 3, 4}, 4, nil},
		{"unigram", []int32{1, 2, 3, 1}, 4, []int32{2, 3, 1}},
		{"k caps", []int32{1, 2, 3, 1}, 2, []int32{2, 3}},
		{"k zero", []int32{1, 2, 3, 1}, 0, nil},
		{"longest n wins", []int32{5, 9, 1, 2, 8, 1, 2, 6, 5, 9, 1, 2}, 3, []int32{8, 1, 2}},
		{"latest occurrence", []int32{1, 7, 1, 8, 1}, 1, []int32{8}},
		{"period 2", []int32{3, 4, 3, 4, 3, 4}, 4, []int32{3, 4}},
		{"self overlap", []int32{9, 9, 9}, 2, []int32{9}},
		{"falls back to shorter n", []int32{1, 2, 3, 4, 9, 3, 4}, 2, []int32{9, 3}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := d.Draft(nil, tt.context, tt.k)
			require.Equal(t, tt.want, got)
		})
	}
}

// TestNgramDraftProperty checks every draft against a naive definition: the
// proposal continues an earlier occurrence of the context's last n tokens
// for the largest n in MinN..MaxN that has one, the latest such occurrence.
func TestNgramDraftProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		n := rng.IntN(40)
		ctx := make([]int32, n)
		for i := range ctx {
			ctx[i] = int32(rng.IntN(4))
		}
		d := NgramDrafter{MinN: 1 + rng.IntN(2), MaxN: 2 + rng.IntN(3)}
		k := rng.IntN(6)
		got := d.Draft([]int32{-1}, ctx, k)
		require.Equal(t, int32(-1), got[0], "dst is appended to")
		require.Equal(t, naiveNgram(d, ctx, k), got[1:], "ctx %v k %d d %+v", ctx, k, d)
	}
}

func naiveNgram(d NgramDrafter, ctx []int32, k int) []int32 {
	out := []int32{}
	if k == 0 {
		return out
	}
	for size := d.MaxN; size >= d.MinN; size-- {
		if size >= len(ctx) {
			continue
		}
		for i := len(ctx) - size - 1; i >= 0; i-- {
			match := true
			for j := range size {
				match = match && ctx[i+j] == ctx[len(ctx)-size+j]
			}
			if match {
				for j := i + size; j < len(ctx) && len(out) < k; j++ {
					out = append(out, ctx[j])
				}
				return out
			}
		}
	}
	return out
}

func TestNgramValidate(t *testing.T) {
	require.NoError(t, DefaultNgram.Validate())
	for _, d := range []NgramDrafter{{0, 1}, {2, 1}, {1, 65}} {
		require.ErrorIs(t, d.Validate(), ErrInvalidOption, "%+v", d)
	}
}

func BenchmarkNgramDraft(b *testing.B) {
	ctx := make([]int32, 2048)
	for i := range ctx {
		ctx[i] = int32(i*7919) % 97
	}
	dst := make([]int32, 0, 8)
	b.ReportAllocs()
	for b.Loop() {
		dst = DefaultNgram.Draft(dst[:0], ctx, 4)
	}
}

func TestAccepted(t *testing.T) {
	for _, tt := range []struct {
		drafts, targets []int32
		want            int
	}{
		{nil, []int32{5}, 0},
		{[]int32{1, 2, 3}, []int32{1, 2, 3, 4}, 3},
		{[]int32{1, 2, 3}, []int32{1, 9, 3, 4}, 1},
		{[]int32{1, 2, 3}, []int32{7, 2, 3, 4}, 0},
	} {
		require.Equal(t, tt.want, Accepted(tt.drafts, tt.targets), "%v vs %v", tt.drafts, tt.targets)
	}
}
