package transfer

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/kvcache"
)

func TestSkipBlocks(t *testing.T) {
	res := hybrid.Resources{Row: 3, Runs: []kvcache.Run{{Start: 10, Len: 2}, {Start: 20, Len: 3}, {Start: 40, Len: 1}}}
	for _, tc := range []struct {
		k    int
		want []kvcache.Run
	}{
		{0, res.Runs},
		{1, []kvcache.Run{{Start: 11, Len: 1}, {Start: 20, Len: 3}, {Start: 40, Len: 1}}},
		{2, []kvcache.Run{{Start: 20, Len: 3}, {Start: 40, Len: 1}}},
		{4, []kvcache.Run{{Start: 22, Len: 1}, {Start: 40, Len: 1}}},
		{5, []kvcache.Run{{Start: 40, Len: 1}}},
	} {
		got, err := SkipBlocks(res, tc.k)
		require.NoError(t, err, "skip %d", tc.k)
		require.Equal(t, hybrid.Resources{Row: 3, Runs: tc.want}, got, "skip %d", tc.k)
	}
	for _, k := range []int{6, 7} {
		_, err := SkipBlocks(res, k)
		require.ErrorIs(t, err, ErrLayoutMismatch, "skip %d: the last block always travels", k)
	}
}
