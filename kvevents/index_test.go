package kvevents

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/prefix"
)

var root = prefix.Salt("kvevents-test")

// storedPrompt returns the events of a rank that cached tokens' full
// blocks (block size 4) and a state after all of them.
func storedPrompt(tokens []int32) []Event {
	chain := prefix.Chain(nil, root, tokens, 4)
	var evs []Event
	parent, has := Hash{}, false
	for i, h := range chain {
		evs = append(evs, Event{Kind: BlockStored, Hashes: []Hash{h}, Parent: parent, HasParent: has,
			Tokens: tokens[i*4 : i*4+4], BlockSize: 4})
		parent, has = h, true
	}
	full := len(chain)
	p := root
	if full > 0 {
		p = chain[full-1]
	}
	return append(evs, Event{Kind: StateStored, Parent: p, HasParent: true, Tokens: tokens[full*4:], NumTokens: len(tokens)})
}

func TestIndexSequence(t *testing.T) {
	x := NewIndex(1000, 1000)
	conv := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	next := append(slices.Clone(conv), 11, 12)
	batch := func(seq uint64, snapshot bool, evs ...Event) *Batch {
		return &Batch{Instance: "a", Seq: seq, Root: root, Snapshot: snapshot, Events: evs}
	}
	_, ok := x.Longest("a", next)
	require.False(t, ok, "an unknown instance cannot be told")

	v, want := x.Apply(batch(1, false, storedPrompt(conv)...))
	require.Equal(t, Gap, v, "a stream starts with a snapshot")
	require.Equal(t, uint64(1), want)
	_, ok = x.Longest("a", next)
	require.False(t, ok)

	v, _ = x.Apply(batch(3, true, storedPrompt(conv)...))
	require.Equal(t, Applied, v)
	L, ok := x.Longest("a", next)
	require.True(t, ok)
	require.Equal(t, 10, L)
	L, _ = x.Longest("a", conv)
	require.Equal(t, 0, L, "a prompt equal to the state's prefix must compute its last token")

	v, _ = x.Apply(batch(3, false))
	require.Equal(t, Stale, v, "a repeat")
	v, _ = x.Apply(batch(2, true))
	require.Equal(t, Stale, v, "an older snapshot")
	L, _ = x.Longest("a", next)
	require.Equal(t, 10, L, "a stale batch changes nothing")

	chain := prefix.Chain(nil, root, conv, 4)
	v, _ = x.Apply(batch(4, false, Event{Kind: BlockRemoved, Hashes: chain[1:2]}))
	require.Equal(t, Applied, v)
	L, ok = x.Longest("a", next)
	require.True(t, ok)
	require.Equal(t, 0, L, "a state whose blocks are gone is no hit")

	v, want = x.Apply(batch(6, false, storedPrompt(conv)...))
	require.Equal(t, Gap, v)
	require.Equal(t, uint64(5), want)
	_, ok = x.Longest("a", next)
	require.False(t, ok, "out of sync: load only")
	v, _ = x.Apply(batch(5, false, storedPrompt(conv)...))
	require.Equal(t, Gap, v, "only a snapshot brings a stream back")

	v, _ = x.Apply(batch(6, true, storedPrompt(conv)...))
	require.Equal(t, Applied, v)
	v, _ = x.Apply(&Batch{Instance: "a", Seq: 7, Root: Hash{1}})
	require.Equal(t, Gap, v, "a root that changed (a restart with another layout)")

	x.Forget("a")
	_, ok = x.Longest("a", next)
	require.False(t, ok)
}

func TestIndexBoundsAFlood(t *testing.T) {
	x := NewIndex(2, 1000)
	v, _ := x.Apply(&Batch{Instance: "a", Seq: 1, Root: root, Snapshot: true, Events: storedPrompt(make([]int32, 13))})
	require.Equal(t, Overflow, v)
	_, ok := x.Longest("a", make([]int32, 20))
	require.False(t, ok, "an instance over its bounds is routed by load alone")
	v, _ = x.Apply(&Batch{Instance: "a", Seq: 2, Root: root, Snapshot: true, Events: storedPrompt(make([]int32, 5))})
	require.Equal(t, Applied, v, "a snapshot that fits brings it back")
	L, ok := x.Longest("a", make([]int32, 20))
	require.True(t, ok)
	require.Equal(t, 5, L)
}

// TestIndexAgreesWithTheCache is the index's oracle: a rank's prefix
// cache under a random workload of prompts, publishes, checkpoints and
// evictions, its events taken at random points (sometimes through a
// journal that overflows, then a snapshot) and applied to an index; after
// each take, the index's longest state for a random prompt is exactly the
// cache's own hit.
func TestIndexAgreesWithTheCache(t *testing.T) {
	const tpb = 4
	m, err := hybrid.New(hybrid.Config{
		KV: kvcache.Config{Layers: 1, KVHeads: 1, HeadDim: 2, ElemSize: 2, TokensPerBlock: tpb, Blocks: 40},
		Mamba: mambacache.Config{Layers: 1, DState: 2, DConv: 2, Heads: 1, HeadDim: 2, NGroups: 1,
			ConvElemSize: 2, SSMElemSize: 4, MaxBatchSize: 4, CheckpointRows: 6},
	})
	require.NoError(t, err)
	m.RecordEvents(12)
	rng := rand.New(rand.NewPCG(1, 2))
	bases := make([][]int32, 3)
	for i := range bases {
		bases[i] = make([]int32, 30)
		for j := range bases[i] {
			bases[i][j] = int32(rng.IntN(3))
		}
	}
	randomPrompt := func() hybrid.Prompt {
		b := bases[rng.IntN(len(bases))]
		toks := slices.Clone(b[:2+rng.IntN(len(b)-2)])
		if rng.IntN(4) == 0 {
			toks[rng.IntN(len(toks))] = 7
		}
		return hybrid.Prompt{Tokens: toks, Root: root, Chain: prefix.Chain(nil, root, toks, tpb)}
	}
	x := NewIndex(1<<20, 1<<20)
	var e hybrid.Events
	seq := uint64(1)
	m.Snapshot(&e)
	v, _ := x.Apply(&Batch{Instance: "a", Seq: seq, Root: root, Snapshot: true, Events: FromCache(nil, &e, tpb, MediumGPU, true)})
	require.Equal(t, Applied, v)
	hits, snapshots := 0, 0
	for op := range 5000 {
		p := randomPrompt()
		if h := m.Lookup(p); h.Tokens > 0 {
			res, err := m.PrepareHit(1, p, len(p.Tokens), h, nil)
			require.NoError(t, err)
			_ = res
			m.HitCopied(1)
		} else if _, err := m.Prepare(1, len(p.Tokens)); err != nil {
			continue
		}
		_, err := m.Publish(1, p)
		require.NoError(t, err)
		at := 1 + rng.IntN(len(p.Tokens))
		if ck, err := m.BeginCheckpoint(at%tpb != 0); err == nil {
			require.NoError(t, m.EndCheckpoint(ck, p, at))
		}
		require.NoError(t, m.Free(1))

		if rng.IntN(3) != 0 {
			continue
		}
		m.TakeEvents(&e)
		seq++
		b := Batch{Instance: "a", Seq: seq, Root: root}
		if e.Overflow {
			m.Snapshot(&e)
			b.Snapshot = true
			snapshots++
		}
		b.Events = FromCache(nil, &e, tpb, MediumGPU, b.Snapshot)
		// Through the wire, as a router gets it.
		data, err := Encode(&b)
		require.NoError(t, err)
		got, err := Decode(data)
		require.NoError(t, err)
		v, _ := x.Apply(&got)
		require.Equal(t, Applied, v)
		for range 4 {
			q := randomPrompt()
			L, ok := x.Longest("a", q.Tokens)
			require.True(t, ok)
			want := m.Lookup(q).Tokens
			require.Equal(t, want, L, "op %d: prompt %v", op, q.Tokens)
			if want > 0 {
				hits++
			}
		}
	}
	require.Greater(t, hits, 500, "the workload must hit")
	require.Greater(t, snapshots, 5, "the journal must overflow now and then")
}

// TestIndexHitsEveryInstanceItCanTell: Hits answers for each instance in
// sync, its best rank, and leaves out one with a stream out of sync.
func TestIndexHitsEveryInstanceItCanTell(t *testing.T) {
	x := NewIndex(1000, 1000)
	conv := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	apply := func(inst string, rank int, seq uint64, snapshot bool, evs []Event) {
		t.Helper()
		v, _ := x.Apply(&Batch{Instance: inst, Rank: rank, Seq: seq, Root: root, Snapshot: snapshot, Events: evs})
		require.Equal(t, Applied, v)
	}
	apply("a", 0, 1, true, storedPrompt(conv[:5]))
	apply("a", 1, 1, true, storedPrompt(conv[:9]))
	apply("b", 0, 1, true, nil)
	apply("c", 0, 1, true, storedPrompt(conv))
	v, _ := x.Apply(&Batch{Instance: "c", Rank: 1, Seq: 3, Root: root})
	require.Equal(t, Gap, v)
	require.Equal(t, map[string]int{"a": 9, "b": 0}, x.Hits(append(slices.Clone(conv), 11)))
}
