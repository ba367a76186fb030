package kvcache

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCacheEventsReplayToTheCache: a consumer that applies every taken
// event to a set of names holds, after each take, every cached block a
// prompt can reach and nothing that is not cached, through publishes, hits
// and evictions (exactly the cached names until a snapshot, which leaves
// out orphans: their removal may come later); a stored block's parent is
// in the set when the block arrives; and after an overflow, the snapshot
// alone gives the set again.
func TestCacheEventsReplayToTheCache(t *testing.T) {
	const blocks, tpb = 32, 4
	p := newPool(t, blocks)
	rng := rand.New(rand.NewPCG(3, 5))
	base := make([]int32, 40)
	for i := range base {
		base[i] = int32(rng.IntN(3))
	}
	cached := func() map[BlockHash]bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		m := map[BlockHash]bool{}
		for h := range p.cache.byHash {
			m[h] = true
		}
		return m
	}
	reachable := func() map[BlockHash]bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		m := map[BlockHash]bool{}
		for h, b := range p.cache.byHash {
			ok := true
			for x := &p.cache.meta[b]; x.parent != noBlock; x = &p.cache.meta[x.parent] {
				if !p.cache.meta[x.parent].cached || !p.cache.linked(x, x.parent) {
					ok = false
					break
				}
			}
			if ok {
				m[h] = true
			}
		}
		return m
	}
	snapshotted := false
	replica := map[BlockHash]bool{}
	max := 1 << 20
	p.RecordEvents(max)
	var evs []CacheEvent
	live := map[uint64][]int32{}
	stored, removed, overflows := 0, 0, 0
	for op := range 20_000 {
		if op == 10_000 {
			max = 3 // from here on, takes overflow often
			p.RecordEvents(max)
			replica = map[BlockHash]bool{}
			for _, e := range p.Snapshot(nil) {
				replica[e.Hash] = true
			}
			snapshotted = true
		}
		id := uint64(rng.IntN(8) + 1)
		switch prompt, ok := live[id]; {
		case !ok:
			prompt = slices.Clone(base[:1+rng.IntN(len(base))])
			if rng.IntN(3) == 0 {
				prompt[rng.IntN(len(prompt))] = 3
			}
			chain := chainOf(prompt, tpb)
			k := p.Match(chain, prompt)
			shared := min(rng.IntN(k+1), (len(prompt)-1)/tpb)
			if err := p.AllocateShared(id, chain, prompt, shared, len(prompt), 0); err != nil {
				require.ErrorIs(t, err, ErrNoFreeBlocks)
				break
			}
			live[id] = prompt
		case rng.IntN(2) == 0:
			_, err := p.Publish(id, chainOf(prompt, tpb), prompt)
			require.NoError(t, err)
		default:
			require.NoError(t, p.Free(id))
			delete(live, id)
		}
		if rng.IntN(5) != 0 {
			continue
		}
		var overflow bool
		evs, overflow = p.TakeEvents(evs[:0])
		if overflow {
			require.Empty(t, evs)
			overflows++
			snapshotted = true
			replica = map[BlockHash]bool{}
			for _, e := range p.Snapshot(nil) {
				require.True(t, e.Stored)
				replica[e.Hash] = true
			}
		}
		for _, e := range evs {
			if e.Stored {
				require.False(t, replica[e.Hash], "op %d: stored twice", op)
				require.Len(t, e.Tokens, tpb)
				if e.HasParent {
					require.True(t, replica[e.Parent], "op %d: a block stored before its parent", op)
				}
				replica[e.Hash] = true
				stored++
			} else {
				require.True(t, snapshotted || replica[e.Hash], "op %d: removed a block never stored", op)
				delete(replica, e.Hash)
				removed++
			}
		}
		if !snapshotted {
			require.Equal(t, cached(), replica, "op %d", op)
			continue
		}
		all := cached()
		for h := range replica {
			require.True(t, all[h], "op %d: the consumer holds a block the pool evicted", op)
		}
		for h := range reachable() {
			require.True(t, replica[h], "op %d: the consumer misses a reachable block", op)
		}
	}
	require.Greater(t, stored, 1000)
	require.Greater(t, removed, 1000, "the workload must evict")
	require.Greater(t, overflows, 10, "the small journal must overflow")
}

func TestCacheEventsOffRecordsNothing(t *testing.T) {
	p := newPool(t, 8)
	prompt := []int32{1, 2, 3, 4, 5, 6, 7, 8}
	require.NoError(t, p.Allocate(1, 8))
	_, err := p.Publish(1, chainOf(prompt, 4), prompt)
	require.NoError(t, err)
	evs, overflow := p.TakeEvents(nil)
	require.Empty(t, evs)
	require.False(t, overflow)
	require.Len(t, p.Snapshot(nil), 2, "a snapshot needs no recording")
	require.NoError(t, p.Free(1))

	p.RecordEvents(8)
	require.NoError(t, p.Allocate(2, 8*4)) // evicts both cached blocks
	evs, _ = p.TakeEvents(nil)
	require.Len(t, evs, 2)
	for _, e := range evs {
		require.False(t, e.Stored)
	}
	chain := chainOf(prompt, 4)
	require.ElementsMatch(t, []BlockHash{chain[0], chain[1]}, []BlockHash{evs[0].Hash, evs[1].Hash})
}
