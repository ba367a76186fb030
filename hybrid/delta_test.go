package hybrid

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvcache"
)

// TestPrepareSharedSharesBlocksWithoutAState: a request that receives its
// state from elsewhere shares the cached leading blocks read-only, holds
// the rest and a row of its own, and pins no checkpoint.
func TestPrepareSharedSharesBlocksWithoutAState(t *testing.T) {
	m := newManager(t, cacheConfig(2, 16, 2, false))
	conv := prompt(seq(1, 10)...)
	res1, err := m.Prepare(1, 10)
	require.NoError(t, err)
	_, err = m.Publish(1, conv)
	require.NoError(t, err)
	require.NoError(t, m.Free(1))

	next := prompt(append(seq(1, 10), seq(50, 7)...)...)
	require.Zero(t, m.Lookup(next).Tokens, "no state cached: no prefix hit")
	h := m.LookupBlocks(next, 4)
	require.Equal(t, Hit{Shared: 2, Unheld: 2}, h, "the two full blocks of the earlier prompt")
	require.Equal(t, Hit{Shared: 1, Unheld: 1}, m.LookupBlocks(next, 1), "at most max")

	res2, err := m.PrepareShared(2, next, 17, h, nil)
	require.NoError(t, err)
	b1, b2 := blocksOf(res1.Runs), blocksOf(res2.Runs)
	require.Len(t, b2, 5)
	require.Equal(t, b1[:2], b2[:2], "the cached blocks are shared")
	for _, b := range b2[:2] {
		require.True(t, m.KV().IsCached(b))
	}
	for _, b := range b2[2:] {
		require.False(t, m.KV().IsCached(b), "the rest is the request's own")
	}
	require.Equal(t, 2, m.Stats().BlocksSharedOnly, "held only by a sharer")
	_, err = m.PrepareShared(3, next, 17, Hit{Shared: 3, Unheld: 3}, nil)
	require.ErrorIs(t, err, ErrStaleHit)
	_, err = m.PrepareShared(3, prompt(seq(1, 8)...), 8, Hit{Shared: 2, Unheld: 0}, nil)
	require.ErrorIs(t, err, kvcache.ErrInvalidTokens, "a request must receive at least its last block")
	require.NoError(t, m.Free(2))
	require.Zero(t, m.Stats().BlocksSharedOnly)
	require.Equal(t, 2, m.KV().EvictableBlocks(), "the shared blocks stay cached")
}
