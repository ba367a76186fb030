package hybrid

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/prefix"
)

func cacheConfig(mbs, blocks, cks int, adp bool) Config {
	c := testConfig(mbs, blocks, adp)
	c.Mamba.CheckpointRows = cks
	return c
}

var testRoot = prefix.Salt("hybrid-test")

func prompt(tokens ...int32) Prompt {
	return Prompt{Tokens: tokens, Root: testRoot, Chain: prefix.Chain(nil, testRoot, tokens, 4)}
}

func seq(from, n int) []int32 {
	s := make([]int32, n)
	for i := range s {
		s[i] = int32(from + i)
	}
	return s
}

// served leaves in m's cache what a request that computed prompt p
// leaves: its published blocks and a checkpoint at its end.
func served(t *testing.T, m *Manager, p Prompt, at int) {
	t.Helper()
	_, err := m.Prepare(1, len(p.Tokens))
	require.NoError(t, err)
	_, err = m.Publish(1, p)
	require.NoError(t, err)
	checkpointAt(t, m, p, at)
	require.NoError(t, m.Free(1))
}

// checkpointAt fills a checkpoint after tokens tokens of p, as a worker
// does at the end of a prompt.
func checkpointAt(t *testing.T, m *Manager, p Prompt, tokens int) Checkpoint {
	t.Helper()
	ck, err := m.BeginCheckpoint(tokens%4 != 0)
	require.NoError(t, err)
	require.NoError(t, m.EndCheckpoint(ck, p, tokens))
	return ck
}

func TestPrefixHitSharesBlocksAndCopiesTheRest(t *testing.T) {
	m := newManager(t, cacheConfig(2, 16, 2, false))
	p1 := prompt(seq(1, 10)...)
	res1, err := m.Prepare(1, 10)
	require.NoError(t, err)
	n, err := m.Publish(1, p1)
	require.NoError(t, err)
	require.Equal(t, 2, n, "the two full blocks are published, the partial third is not")
	ck := checkpointAt(t, m, p1, 10)
	require.True(t, ck.HasTail)
	require.True(t, m.Mamba().Config().IsCheckpointRow(ck.Row))
	require.False(t, m.Mamba().IsReserved(ck.Row))
	require.NoError(t, m.Free(1))

	p2 := prompt(append(seq(1, 10), seq(50, 5)...)...)
	h := m.Lookup(p2)
	require.Equal(t, Hit{Tokens: 10, Shared: 2, Unheld: 2, Row: ck.Row, Tail: ck.Tail, HasTail: true}, h)
	res2, err := m.PrepareHit(2, p2, 15, h, nil)
	require.NoError(t, err)
	b1 := blocksOf(res1.Runs)
	b2 := blocksOf(res2.Runs)
	require.Len(t, b2, 4)
	require.Equal(t, b1[:2], b2[:2], "the cached full blocks are shared")
	require.NotContains(t, b2[2:], ck.Tail, "the tail is copied into a block of the request's own")
	for _, b := range b2[2:] {
		require.False(t, m.KV().IsCached(b), "block %d is written by the request", b)
	}
	require.Equal(t, 1, m.Stats().Checkpoints.Pinned)
	m.HitCopied(2)
	require.Equal(t, 0, m.Stats().Checkpoints.Pinned)
	require.NoError(t, m.Free(2))
	s := m.Stats()
	require.Equal(t, 16, s.BlocksAvailable, "every block is free or evictable again")
	require.Equal(t, 2, s.RowsFree)
}

func TestPrefixPromptEqualToCachedPrefixComputesItsLastToken(t *testing.T) {
	m := newManager(t, cacheConfig(2, 16, 4, false))
	p := prompt(seq(1, 10)...)
	served(t, m, p, 10)
	// The state at 10 has absorbed token 10 and cannot give its logits:
	// the same prompt again is a miss while no earlier checkpoint exists.
	require.Equal(t, Hit{}, m.Lookup(p))
	ck8 := checkpointAt(t, m, p, 8)
	require.Equal(t, Hit{Tokens: 8, Shared: 2, Unheld: 2, Row: ck8.Row}, m.Lookup(p))
	ck9 := checkpointAt(t, m, p, 9)
	require.Equal(t, Hit{Tokens: 9, Shared: 2, Unheld: 2, Row: ck9.Row, Tail: ck9.Tail, HasTail: true}, m.Lookup(p))
	require.True(t, m.HasCheckpoint(p, 9))
	require.False(t, m.HasCheckpoint(p, 7))
}

func TestPrefixCheckpointNeedsItsKV(t *testing.T) {
	// 4 blocks: the checkpoint's own tail plus 2 published blocks, and a
	// request that needs every block evicts them.
	m := newManager(t, cacheConfig(2, 4, 2, false))
	p := prompt(seq(1, 10)...)
	_, err := m.Prepare(1, 10)
	require.NoError(t, err)
	_, err = m.Publish(1, p)
	require.NoError(t, err)
	require.NoError(t, m.Free(1))
	// A checkpoint at 6 (one full block and two tokens) of another prompt
	// continuing the first block.
	q := prompt(append(seq(1, 4), 90, 91, 92, 93, 94)...)
	ck := checkpointAt(t, m, q, 6)
	require.Equal(t, 6, m.Lookup(q).Tokens)
	// Evict the cached blocks: a request takes 3 blocks, the pool has 1 free.
	_, err = m.Prepare(2, 12)
	require.NoError(t, err)
	require.Zero(t, m.Stats().BlocksCached)
	require.Equal(t, Hit{}, m.Lookup(q), "a checkpoint whose full blocks are gone is no hit")
	_ = ck
}

func TestPrefixStaleHitRefused(t *testing.T) {
	m := newManager(t, cacheConfig(2, 16, 1, false))
	p := prompt(seq(1, 6)...)
	served(t, m, p, 6)
	p2 := prompt(append(seq(1, 6), 7, 8)...)
	h := m.Lookup(p2)
	require.Equal(t, 6, h.Tokens)
	// Another checkpoint takes the only checkpoint row between the lookup
	// and its use.
	checkpointAt(t, m, prompt(seq(100, 3)...), 3)
	before := m.Stats()
	_, err := m.PrepareHit(2, p2, 8, h, nil)
	require.ErrorIs(t, err, ErrStaleHit)
	require.Equal(t, before, m.Stats(), "a refused hit changes nothing")
	res, err := m.Prepare(2, 8)
	require.NoError(t, err, "the request goes on as a miss")
	require.NotZero(t, len(res.Runs))
}

func TestPrefixCancelWhileCopyingUnpins(t *testing.T) {
	m := newManager(t, cacheConfig(2, 16, 1, false))
	p := prompt(seq(1, 6)...)
	served(t, m, p, 6)
	p2 := prompt(append(seq(1, 6), 7)...)
	_, err := m.PrepareHit(2, p2, 7, m.Lookup(p2), nil)
	require.NoError(t, err)
	// Pinned: the only checkpoint row cannot be taken.
	_, err = m.BeginCheckpoint(false)
	require.ErrorIs(t, err, mambacache.ErrNoCheckpointRow)
	require.NoError(t, m.Free(2)) // cancelled before HitCopied
	s := m.Stats()
	require.Equal(t, 0, s.Checkpoints.Pinned)
	require.Equal(t, 1, s.Checkpoints.Ready)
	ck, err := m.BeginCheckpoint(false)
	require.NoError(t, err, "unpinned, it can be evicted again")
	m.AbortCheckpoint(ck)
}

func TestPrefixFullPoolEvictsRatherThanRefuses(t *testing.T) {
	m := newManager(t, cacheConfig(1, 6, 2, true))
	for i := range 2 {
		p := prompt(seq(10*i+1, 7)...)
		served(t, m, p, 7)
	}
	s := m.Stats()
	require.Equal(t, 4, s.BlocksCached+s.Checkpoints.Ready, "two cached blocks and two tails")
	require.True(t, m.CanAdmit(20), "5 blocks (one is the ADP dummy's) are free or evictable")
	_, err := m.Prepare(2, 20)
	require.NoError(t, err)
	require.NoError(t, m.AddDummy(mambacache.ADPDummyID), "the ADP headroom survives")
	require.NoError(t, m.Free(mambacache.ADPDummyID))
	require.NoError(t, m.Free(2))
	require.Equal(t, 6, m.Stats().BlocksAvailable)
}

func blocksOf(runs []kvcache.Run) []kvcache.BlockID {
	var bs []kvcache.BlockID
	for _, r := range runs {
		for b := r.Start; b < r.End(); b++ {
			bs = append(bs, b)
		}
	}
	return bs
}

// TestPrefixProperty runs random requests over a few conversation trees
// against a model of what every block and row holds: a block holds the
// tokens written into its slots, a row the prefix whose state it is. A hit
// must find exactly the tokens and state its prompt needs, a request may
// write only blocks of its own (never a cached one), and after any
// sequence of hits, misses, checkpoints, evictions and cancels every block
// and row is free or evictable again.
func TestPrefixProperty(t *testing.T) {
	ops := 100_000
	if testing.Short() {
		ops = 10_000
	}
	const tpb = 4
	rng := rand.New(rand.NewPCG(7, 30))
	for _, adp := range []bool{false, true} {
		cfg := cacheConfig(3, 24, 4, adp)
		m := newManager(t, cfg)
		blockTok := map[kvcache.BlockID][]int32{}
		rowState := map[mambacache.Row]string{}
		state := func(tokens []int32) string { return fmt.Sprint(tokens) }
		type live struct {
			id     uint64
			tokens []int32 // the tokens its cache holds
		}
		var reqs []*live
		var nextID uint64 = 1
		hits, tailHits := 0, 0
		// A few conversations that grow: prompts extend earlier ones.
		convs := [][]int32{seq(1, 3), seq(40, 9)}
		pick := func() []int32 {
			c := convs[rng.IntN(len(convs))]
			out := slices.Clone(c[:rng.IntN(len(c))+1])
			for range rng.IntN(6) {
				out = append(out, int32(rng.IntN(5)))
			}
			if rng.IntN(4) == 0 && len(out) < 40 {
				convs = append(convs, out)
				if len(convs) > 12 {
					convs = convs[1:]
				}
			}
			return out
		}
		blocks := func(id uint64) []kvcache.BlockID {
			bs, err := m.KV().Blocks(id, nil)
			require.NoError(t, err)
			return bs
		}
		write := func(l *live, from, to int) {
			bs := blocks(l.id)
			for pos := from; pos < to; pos++ {
				b := bs[pos/tpb]
				require.False(t, m.KV().IsCached(b), "request %d writes cached block %d", l.id, b)
				slot := blockTok[b]
				if len(slot) > pos%tpb {
					slot = slot[:pos%tpb]
				}
				require.Len(t, slot, pos%tpb, "block %d slot %d written out of order", b, pos%tpb)
				blockTok[b] = append(slot, l.tokens[pos])
			}
			row, _ := m.Mamba().Row(l.id)
			rowState[row] = state(l.tokens[:to])
		}
		check := func(l *live, n int) {
			bs := blocks(l.id)
			for pos := range n {
				require.Equal(t, l.tokens[pos], blockTok[bs[pos/tpb]][pos%tpb], "request %d position %d", l.id, pos)
			}
		}
		for op := range ops {
			switch k := rng.IntN(10); {
			case k < 4 && len(reqs) < 3: // a new request, hit or miss
				toks := pick()
				if len(toks)+4 > 40 {
					continue
				}
				p := prompt(toks...)
				l := &live{id: nextID, tokens: toks}
				nextID++
				h := m.Lookup(p)
				var err error
				if h.Tokens > 0 {
					hits++
					if h.HasTail {
						tailHits++
					}
					require.Less(t, h.Tokens, len(toks))
					require.Equal(t, state(toks[:h.Tokens]), rowState[h.Row], "op %d: the checkpoint is the state of the hit's prefix", op)
					if h.HasTail {
						require.Equal(t, toks[h.Shared*tpb:h.Tokens], blockTok[h.Tail], "op %d: the tail holds the hit's partial block", op)
					}
					_, err = m.PrepareHit(l.id, p, len(toks)+4, h, nil)
				} else {
					_, err = m.Prepare(l.id, len(toks)+4)
				}
				if err != nil {
					require.ErrorIs(t, err, kvcache.ErrNoFreeBlocks, "op %d", op)
					continue
				}
				if h.Tokens > 0 {
					check(l, h.Shared*tpb)
					if rng.IntN(8) == 0 { // cancelled while copying
						require.NoError(t, m.Free(l.id))
						continue
					}
					row, _ := m.Mamba().Row(l.id)
					rowState[row] = rowState[h.Row]
					if h.HasTail {
						blockTok[blocks(l.id)[h.Shared]] = slices.Clone(blockTok[h.Tail])
					}
					m.HitCopied(l.id)
				}
				write(l, h.Tokens, len(toks))
				check(l, len(toks))
				reqs = append(reqs, l)
			case k < 6 && len(reqs) > 0: // publish and checkpoint where it stands
				l := reqs[rng.IntN(len(reqs))]
				p := prompt(l.tokens...)
				_, err := m.Publish(l.id, p)
				require.NoError(t, err)
				n := len(l.tokens)
				if m.HasCheckpoint(p, n) {
					continue
				}
				ck, err := m.BeginCheckpoint(n%tpb != 0)
				if err != nil {
					continue
				}
				require.True(t, cfg.Mamba.IsCheckpointRow(ck.Row))
				row, _ := m.Mamba().Row(l.id)
				rowState[ck.Row] = rowState[row]
				if ck.HasTail {
					blockTok[ck.Tail] = slices.Clone(blockTok[blocks(l.id)[n/tpb]])
				}
				require.NoError(t, m.EndCheckpoint(ck, p, n))
			case k < 8 && len(reqs) > 0: // generate a token
				l := reqs[rng.IntN(len(reqs))]
				n := len(l.tokens)
				if err := m.Grow(l.id, n+1); err != nil {
					require.ErrorIs(t, err, kvcache.ErrNoFreeBlocks)
					continue
				}
				l.tokens = append(l.tokens, int32(rng.IntN(5)))
				write(l, n, n+1)
			case len(reqs) > 0: // finish
				i := rng.IntN(len(reqs))
				require.NoError(t, m.Free(reqs[i].id))
				reqs = slices.Delete(reqs, i, i+1)
			}
		}
		for _, l := range reqs {
			require.NoError(t, m.Free(l.id))
		}
		s := m.Stats()
		require.Equal(t, cfg.KV.NumBlocks(), s.BlocksAvailable, "adp=%v: every block free or evictable", adp)
		require.Equal(t, cfg.Mamba.RealRows(), s.RowsFree)
		require.Zero(t, s.Checkpoints.Pinned+s.Checkpoints.Filling)
		require.Zero(t, s.Requests)
		require.NotZero(t, s.BlocksEvicted, "the run evicted blocks")
		require.NotZero(t, s.CheckpointsEvicted, "the run evicted checkpoints")
		require.Greater(t, tailHits, ops/200, "adp=%v: %d hits, %d through a tail", adp, hits, tailHits)
		t.Logf("adp=%v: %d hits (%d through a tail), %d blocks and %d checkpoints evicted", adp, hits, tailHits, s.BlocksEvicted, s.CheckpointsEvicted)
	}
}

// TestPrefixHitOnUnheldBlocksEvictsTails: a hit that shares cached blocks
// no one holds takes them out of the evictable ones, so PrepareHit must
// evict checkpoint tails for them too. 8 blocks: prompt a's 2 published
// blocks (unheld), three checkpoint tails, a request holding 2: one block
// is free, and a hit that shares a's 2 blocks and needs 2 of its own must
// evict two tails rather than fail.
func TestPrefixHitOnUnheldBlocksEvictsTails(t *testing.T) {
	m := newManager(t, cacheConfig(3, 8, 4, false))
	a := prompt(seq(1, 8)...)
	served(t, m, a, 8)
	for i := range 3 {
		checkpointAt(t, m, prompt(seq(100+10*i, 3)...), 3)
	}
	_, err := m.Prepare(9, 8)
	require.NoError(t, err)
	require.Equal(t, 1, m.KV().FreeBlocks())
	p := prompt(append(seq(1, 8), seq(50, 8)...)...)
	h := m.Lookup(p)
	require.Equal(t, Hit{Tokens: 8, Shared: 2, Unheld: 2, Row: h.Row}, h)
	_, err = m.PrepareHit(10, p, 16, h, nil)
	require.NoError(t, err, "evictable tails make the room")
	m.HitCopied(10)
	require.NoError(t, m.Free(10))
	require.NoError(t, m.Free(9))
}
