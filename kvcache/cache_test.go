package kvcache

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/prefix"
)

func chainOf(tokens []int32, tpb int) []BlockHash {
	return prefix.Chain(nil, prefix.Salt("test"), tokens, tpb)
}

func TestCacheHitSharesPublishedBlocks(t *testing.T) {
	p := newPool(t, 8) // 4 tokens per block
	prompt := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9}
	chain := chainOf(prompt, 4)
	require.NoError(t, p.Allocate(1, len(prompt)))
	n, err := p.Publish(1, chain, prompt)
	require.NoError(t, err)
	require.Equal(t, 2, n, "two full blocks; the partial third is not named")
	mine, _ := p.Blocks(1, nil)

	require.Equal(t, 2, p.Match(chain, prompt))
	require.NoError(t, p.AllocateShared(2, chain, prompt, 2, 10, 0))
	theirs, _ := p.Blocks(2, nil)
	require.Equal(t, mine[:2], theirs[:2], "the shared blocks are the first of the runs")
	require.NotContains(t, mine, theirs[2], "the rest is the request's own")
	require.False(t, p.IsCached(theirs[2]))
	require.NoError(t, p.checkInvariants())

	require.NoError(t, p.Free(1))
	require.NoError(t, p.Free(2))
	require.Equal(t, 2, p.CachedBlocks(), "cached blocks outlive their requests")
	require.Equal(t, 2, p.EvictableBlocks())
	require.Equal(t, 8, p.AvailableBlocks())
	require.NoError(t, p.checkInvariants())
}

func TestCacheMatchComparesTokensNotOnlyNames(t *testing.T) {
	p := newPool(t, 4)
	a := []int32{1, 2, 3, 4}
	require.NoError(t, p.Allocate(1, 4))
	_, err := p.Publish(1, chainOf(a, 4), a)
	require.NoError(t, err)
	// A forged chain: the name of a's block, other tokens (what a collision
	// would look like).
	require.Equal(t, 0, p.Match(chainOf(a, 4), []int32{9, 9, 9, 9}))
	require.Equal(t, 1, p.Match(chainOf(a, 4), a))
	// A block cached under another parent is not a continuation.
	b := []int32{1, 2, 3, 4, 5, 6, 7, 8}
	cb := chainOf(b, 4)
	require.NoError(t, p.Allocate(2, 8))
	_, err = p.Publish(2, []BlockHash{cb[1], cb[0]}, []int32{5, 6, 7, 8, 1, 2, 3, 4})
	require.NoError(t, err)
	require.Equal(t, 1, p.Match(cb, b), "a block published first under no parent is not b's second block")
}

func TestCacheEvictsBeforeRefusing(t *testing.T) {
	p := newPool(t, 4)
	a := []int32{1, 2, 3, 4, 5, 6, 7, 8}
	require.NoError(t, p.Allocate(1, 8))
	_, err := p.Publish(1, chainOf(a, 4), a)
	require.NoError(t, err)
	require.NoError(t, p.Free(1))
	require.Equal(t, 2, p.FreeBlocks())
	require.NoError(t, p.Allocate(2, 16), "a pool full of unheld cached blocks evicts, never refuses")
	require.Equal(t, uint64(2), p.Evictions())
	require.Equal(t, 0, p.CachedBlocks())
	require.Equal(t, 0, p.Match(chainOf(a, 4), a))
	require.NoError(t, p.checkInvariants())
	require.ErrorIs(t, p.Allocate(3, 1), ErrNoFreeBlocks)
}

// Eviction takes a cached prefix from its end: what is left of it still
// matches, and the prompt computed again publishes the evicted blocks
// again. (Taken from the start, the rest stayed cached but unreachable.)
func TestCacheEvictsAPrefixFromItsEnd(t *testing.T) {
	p := newPool(t, 6) // 4 tokens per block
	a := make([]int32, 16)
	for i := range a {
		a[i] = int32(i + 1)
	}
	chain := chainOf(a, 4)
	require.NoError(t, p.Allocate(1, len(a)))
	_, err := p.Publish(1, chain, a)
	require.NoError(t, err)
	require.NoError(t, p.Free(1))
	require.NoError(t, p.Allocate(2, 12), "3 blocks: 2 free, 1 evicted")
	require.Equal(t, uint64(1), p.Evictions())
	require.Equal(t, 3, p.Match(chain, a), "the prefix lost its last block, not its first")
	require.NoError(t, p.Free(2))
	require.NoError(t, p.AllocateShared(3, chain, a, 3, len(a), 0))
	n, err := p.Publish(3, chain, a)
	require.NoError(t, err)
	require.Equal(t, 4, n)
	require.Equal(t, 4, p.Match(chain, a), "the evicted block is published again")
	require.NoError(t, p.checkInvariants())
}

// The same: a prompt computed by two requests at once, the second's chain
// continuing the first's copy of the prefix (which it never held), the
// first let go first. Its copy of the prefix would be evicted from its end,
// leaving the second's blocks after it unreachable.
func TestCacheEvictsATwiceComputedPrefixFromItsEnd(t *testing.T) {
	p := newPool(t, 10) // 4 tokens per block
	a := make([]int32, 24)
	for i := range a {
		a[i] = int32(i + 1)
	}
	chain := chainOf(a, 4)
	require.NoError(t, p.Allocate(1, 16))
	require.NoError(t, p.Allocate(2, 24))
	n, err := p.Publish(1, chain[:4], a[:16])
	require.NoError(t, err)
	require.Equal(t, 4, n)
	n, err = p.Publish(2, chain, a)
	require.NoError(t, err)
	require.Equal(t, 6, n, "its first four continue request 1's copies")
	require.NoError(t, p.Free(1))
	require.NoError(t, p.Free(2))
	require.Equal(t, 6, p.CachedBlocks())
	require.NoError(t, p.Allocate(3, 20), "5 blocks: 4 free, 1 evicted")
	require.Equal(t, uint64(1), p.Evictions())
	require.Equal(t, 5, p.Match(chain, a), "the chain lost its last block")
	require.NoError(t, p.checkInvariants())
}

func TestCacheHeldBlocksAreNeverEvicted(t *testing.T) {
	p := newPool(t, 4)
	a := []int32{1, 2, 3, 4, 5, 6, 7, 8}
	require.NoError(t, p.Allocate(1, 8))
	_, err := p.Publish(1, chainOf(a, 4), a)
	require.NoError(t, err)
	require.NoError(t, p.Free(1))
	require.NoError(t, p.AllocateShared(2, chainOf(a, 4), a, 2, 8, 0))
	require.ErrorIs(t, p.Allocate(3, 12), ErrNoFreeBlocks, "held cached blocks are not room")
	require.NoError(t, p.Allocate(3, 8))
	require.Equal(t, 2, p.Match(chainOf(a, 4), a))
	require.NoError(t, p.checkInvariants())
}

func TestCacheAllocateSharedFailsWhenTheHitWasEvicted(t *testing.T) {
	p := newPool(t, 4)
	a := []int32{1, 2, 3, 4}
	require.NoError(t, p.Allocate(1, 4))
	_, err := p.Publish(1, chainOf(a, 4), a)
	require.NoError(t, err)
	require.NoError(t, p.Free(1))
	k := p.Match(chainOf(a, 4), a)
	require.Equal(t, 1, k)
	require.NoError(t, p.Allocate(2, 16)) // evicts it between lookup and use
	require.ErrorIs(t, p.AllocateShared(3, chainOf(a, 4), a, k, 8, 0), ErrNoFreeBlocks)
	require.NoError(t, p.Free(2))
	require.NoError(t, p.checkInvariants())
	require.Equal(t, 4, p.FreeBlocks())
}

// TestCacheProperty drives the cache with random requests over prompts
// that share prefixes, against a model of every block's bytes: a request
// writes its own blocks (never a shared one), and every hit must name
// blocks holding exactly the prompt's tokens. After everything is freed
// the pool holds only unheld cached blocks, and evicting them restores the
// idle pool.
func TestCacheProperty(t *testing.T) {
	const blocks, tpb = 48, 4
	ops := 100_000
	if testing.Short() {
		ops = 20_000
	}
	p := newPool(t, blocks)
	rng := rand.New(rand.NewPCG(7, 11))
	bases := make([][]int32, 4)
	for i := range bases {
		bases[i] = make([]int32, 40)
		for j := range bases[i] {
			bases[i][j] = int32(rng.IntN(3)) // few tokens: prefixes collide often
		}
	}
	content := make([][]int32, blocks) // what each block holds, by the model
	type held struct {
		prompt []int32
		shared int
	}
	live := map[uint64]held{}
	hits, evictedBefore := 0, p.Evictions()
	check := func(prompt []int32, k int) {
		chain := chainOf(prompt, tpb)
		p.mu.Lock()
		got, bs := p.match(chain, prompt, nil)
		p.mu.Unlock()
		require.Equal(t, k, got)
		for i, b := range bs {
			require.Equal(t, prompt[i*tpb:(i+1)*tpb], content[b], "a hit names a block that holds other tokens")
		}
	}
	for op := range ops {
		id := uint64(rng.IntN(10) + 1)
		switch h, ok := live[id]; {
		case !ok:
			base := bases[rng.IntN(len(bases))]
			prompt := slices.Clone(base[:1+rng.IntN(len(base))])
			if rng.IntN(3) == 0 { // diverge somewhere
				prompt[rng.IntN(len(prompt))] = 3
			}
			chain := chainOf(prompt, tpb)
			k := p.Match(chain, prompt)
			check(prompt, k)
			shared := rng.IntN(k + 1)
			if shared*tpb >= len(prompt) { // at least one token is computed
				shared = (len(prompt) - 1) / tpb
			}
			total := len(prompt) + rng.IntN(8)
			if err := p.AllocateShared(id, chain, prompt, shared, total, 0); err != nil {
				require.ErrorIs(t, err, ErrNoFreeBlocks)
				require.Less(t, p.AvailableBlocks(), p.cfg.BlocksFor(total), "refused with room")
				break
			}
			bs, _ := p.Blocks(id, nil)
			for i, b := range bs {
				if i < shared {
					require.True(t, p.IsCached(b))
					continue
				}
				require.False(t, p.IsCached(b), "op %d: a request's own block %d is cached", op, i)
				lo, hi := min(i*tpb, len(prompt)), min((i+1)*tpb, len(prompt))
				content[b] = slices.Clone(prompt[lo:hi]) // compute
			}
			live[id] = held{prompt, shared}
			if shared > 0 {
				hits++
			}
		case rng.IntN(3) == 0:
			n, err := p.Publish(id, chainOf(h.prompt, tpb), h.prompt)
			require.NoError(t, err)
			require.GreaterOrEqual(t, n, h.shared)
		case rng.IntN(4) == 0:
			tok, _ := p.Tokens(id)
			if err := p.Grow(id, tok+rng.IntN(6)); err != nil {
				require.ErrorIs(t, err, ErrNoFreeBlocks)
			}
		default:
			require.NoError(t, p.Free(id))
			delete(live, id)
		}
		if op%97 == 0 {
			require.NoError(t, p.checkInvariants(), "op %d", op)
		}
	}
	require.Greater(t, hits, ops/50, "the workload must hit")
	require.Greater(t, p.Evictions()-evictedBefore, uint64(ops/100), "the workload must evict")
	for id := range live {
		require.NoError(t, p.Free(id))
	}
	require.NoError(t, p.checkInvariants())
	require.Equal(t, blocks, p.AvailableBlocks())
	require.Equal(t, p.CachedBlocks(), p.EvictableBlocks())
	require.NoError(t, p.Allocate(99, blocks*tpb))
	require.NoError(t, p.Free(99))
	require.Equal(t, blocks, p.FreeBlocks())
	require.Equal(t, 1, p.FreeExtents())
	require.NoError(t, p.checkInvariants())
}

// TestCachePublishContinuesAComputedTwicePrefix: a request that computed a
// prefix someone else cached (it could not share it: no state to resume
// from) keeps its copy as its own, and its later blocks are cached as the
// continuation of the cached prefix, so the next turn of its conversation
// matches them all.
func TestCachePublishContinuesAComputedTwicePrefix(t *testing.T) {
	p := newPool(t, 8)
	a := []int32{1, 2, 3, 4, 5, 6}
	require.NoError(t, p.Allocate(1, len(a)))
	_, err := p.Publish(1, chainOf(a, 4), a)
	require.NoError(t, err)
	b := []int32{1, 2, 3, 4, 9, 9, 9, 9, 7}
	require.NoError(t, p.Allocate(2, len(b)))
	n, err := p.Publish(2, chainOf(b, 4), b)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	mine, _ := p.Blocks(2, nil)
	require.False(t, p.IsCached(mine[0]), "the second copy of a cached block stays the request's own")
	require.True(t, p.IsCached(mine[1]))
	require.Equal(t, 2, p.Match(chainOf(b, 4), b))
	require.NoError(t, p.checkInvariants())
	require.NoError(t, p.Free(1))
	require.NoError(t, p.Free(2))
	require.NoError(t, p.checkInvariants())
	require.Equal(t, 8, p.AvailableBlocks())
}

// A block whose parent was evicted is an orphan: unreachable, though it
// keeps its name until evicted. The same prefix computed again takes it
// back under the new parent, whether the orphan is the publishing
// request's own block or another's; else the orphan would stop the prefix
// from being cached past it for as long as it stays.
func TestCacheOrphanRelinkedWhenItsPrefixIsComputedAgain(t *testing.T) {
	a := make([]int32, 24)
	for i := range a {
		a[i] = int32(i + 1)
	}
	chain := chainOf(a, 4)
	// Request 1 caches the first four blocks; request 2 computes the whole
	// prompt, its last two blocks continuing 1's copies; 1's copies are
	// evicted while 2 runs (3 takes the room).
	orphaned := func(t *testing.T) *Pool {
		p := newPool(t, 12) // 4 tokens per block
		require.NoError(t, p.Allocate(1, 16))
		n, err := p.Publish(1, chain[:4], a[:16])
		require.NoError(t, err)
		require.Equal(t, 4, n)
		require.NoError(t, p.Free(1))
		require.NoError(t, p.Allocate(2, 24))
		n, err = p.Publish(2, chain, a)
		require.NoError(t, err)
		require.Equal(t, 6, n)
		require.NoError(t, p.Allocate(3, 24), "6 blocks: 2 free, 4 evicted")
		require.Equal(t, uint64(4), p.Evictions())
		require.Equal(t, 0, p.Match(chain, a))
		require.NoError(t, p.Free(3))
		return p
	}

	t.Run("its own", func(t *testing.T) {
		p := orphaned(t)
		n, err := p.Publish(2, chain, a) // at its end: its own copies of the prefix now
		require.NoError(t, err)
		require.Equal(t, 6, n)
		require.NoError(t, p.Free(2))
		require.Equal(t, 6, p.Match(chain, a))
		require.NoError(t, p.checkInvariants())
	})
	t.Run("another's", func(t *testing.T) {
		p := orphaned(t)
		require.NoError(t, p.Free(2)) // its last two blocks stay, orphans
		require.Equal(t, 0, p.Match(chain, a))
		require.NoError(t, p.Allocate(4, 24))
		n, err := p.Publish(4, chain, a)
		require.NoError(t, err)
		require.Equal(t, 6, n)
		require.NoError(t, p.Free(4))
		require.Equal(t, 6, p.Match(chain, a))
		require.NoError(t, p.checkInvariants())
	})
}
