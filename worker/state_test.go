package worker

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/model"
)

// instanceSource is a gateSource that names the instance serving it.
type instanceSource struct {
	gateSource
	name string
}

func (s *instanceSource) Fetch(ctx context.Context, f FetchRequest) (FetchResult, error) {
	res, err := s.gateSource.Fetch(ctx, f)
	res.Instance = s.name
	return res, err
}

// holderSource fetches adopted states from a holder scheduler's cache,
// as a prefill worker pulls them from a decode worker (FromCache jobs),
// copying the bytes as loopbackFetch does.
type holderSource struct {
	holders map[string]*Scheduler
	dst     []*Rank
	delay   time.Duration // before each fetch, as a network would take
	mu      sync.Mutex
	skips   []int
}

func (s *holderSource) Fetch(ctx context.Context, f FetchRequest) (FetchResult, error) {
	time.Sleep(s.delay)
	h := s.holders[f.Holder]
	if h == nil {
		return FetchResult{}, fmt.Errorf("%w: no holder %q", ErrTransferRefused, f.Holder)
	}
	s.mu.Lock()
	s.skips = append(s.skips, f.Skip)
	s.mu.Unlock()
	return loopbackJob(ctx, h, s.dst, f, PrefillJob{Prompt: f.Prompt, LogID: f.LogID, FromCache: true})
}

// offerAdopter adopts every offer on pre at once, as the prefill worker's
// offer subscription does, and reports each outcome.
type offerAdopter struct {
	pre  *Scheduler
	from string
	done chan error
	// offered are the tokens of each offer.
	mu      sync.Mutex
	offered [][]int32
}

func (o *offerAdopter) Offer(instance string, tokens []int32) {
	o.mu.Lock()
	o.offered = append(o.offered, slices.Clone(tokens))
	o.mu.Unlock()
	if instance != "p1" {
		o.done <- fmt.Errorf("offered to %q", instance)
		return
	}
	err := o.pre.Adopt(context.Background(), AdoptRequest{Tokens: tokens, Holder: o.from, Done: func(err error) { o.done <- err }})
	if err != nil {
		o.done <- err
	}
}

func (o *offerAdopter) wait(t *testing.T) {
	t.Helper()
	select {
	case err := <-o.done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("no adoption")
	}
}

// TestStateReturnsToPrefill: a decode worker with a remote prefill keeps
// each turn's end state and offers it to the prefill worker that prefilled
// the turn; the prefill worker adopts it (moving only the blocks it lacks
// and the row), and the next turn's prefill starts after the last reply
// instead of after the last prompt. Every turn equals the reference, and
// without the return the prefill worker's hit stops at the last prompt.
func TestStateReturnsToPrefill(t *testing.T) {
	for _, tc := range []struct {
		ret, think bool
	}{{true, true}, {false, true}, {true, false}} {
		ret := tc.ret
		t.Run(fmt.Sprintf("return %v, think time %v", ret, tc.think), func(t *testing.T) {
			pranks := newRanks(t, rankOpts{ranks: 1, batch: 2, checkpoints: 8})
			dranks := newRanks(t, rankOpts{ranks: 1, batch: 2, checkpoints: 8})
			states := &holderSource{dst: pranks}
			if !tc.think {
				// Each pull takes 50 ms, so that the next turn, sent at
				// once, reaches the prefill worker while it is in flight;
				// the wait is bounded far above that, for slow machines.
				states.delay = 50 * time.Millisecond
				w := adoptWait
				t.Cleanup(func() { adoptWait = w }) // after the schedulers stopped
				adoptWait = 10 * time.Second
			}
			pcfg := Config{Role: RolePrefill, PrefixCache: true}
			if ret {
				pcfg.StateSource = states
			}
			pre := runCachedRole(t, pcfg, pranks)
			src := &instanceSource{gateSource: gateSource{pre: pre, dst: dranks}, name: "p1"}
			ad := &offerAdopter{pre: pre, from: "d1", done: make(chan error, 4)}
			dcfg := Config{PrefixCache: true, Source: src}
			if ret {
				dcfg.Offers = ad
			}
			dec := runCached(t, dcfg, dranks)
			states.holders = map[string]*Scheduler{"d1": dec}
			tpb := pranks[0].kvCfg.TokensPerBlock

			p := model.Encode(systemPrompt + "<|user|>Tell me about state rows.\n<|assistant|>")
			prevPrompt, prevAbsorbed := 0, 0
			for turn := range 3 {
				ref := reference(t, model.TinyHybrid, p, 12, 0, 0)
				got, out := generate(t, dec, p)
				require.Equal(t, ref, got, "turn %d", turn+1)
				absorbed := len(p) + len(got) - 1 // the last token is sampled, not absorbed
				if turn > 0 {
					want := prevAbsorbed // the last reply's end
					if !ret {
						want = prevPrompt // the last prompt's end
					}
					require.Equal(t, want, out.Cached, "turn %d: prompt tokens the prefill worker's cache served", turn+1)
				}
				if ret && tc.think {
					ad.wait(t)
					ad.mu.Lock()
					require.Equal(t, slices.Concat(p, got)[:absorbed], ad.offered[turn], "turn %d: the state offered", turn+1)
					ad.mu.Unlock()
					// The prefill worker held the full blocks of the prompt
					// it prefilled: the adoption moved the rest only.
					require.Equal(t, min(len(p)/tpb, (absorbed-1)/tpb), states.skips[turn], "turn %d: blocks the adoption skipped", turn+1)
				}
				prevPrompt, prevAbsorbed = len(p), absorbed
				p = slices.Concat(p, got, model.Encode(fmt.Sprintf("\n<|user|>go on %d\n<|assistant|>", turn)))
			}
			if ret && !tc.think {
				// No think time: each turn was sent the moment its reply
				// arrived, its adoption still in flight, and its prompt
				// waited for it (pull on demand): the hits above are the
				// last replies' ends all the same.
				for range 3 {
					ad.wait(t)
				}
			}
			if ret {
				st := pre.Metrics().StateReturns
				require.Equal(t, 3.0, counterValue(t, st.WithLabelValues("prefill", "adopted")))
				require.Equal(t, 3.0, counterValue(t, dec.Metrics().StateReturns.WithLabelValues("decode", "offered")))
			}
		})
	}
}

// TestStateFromCacheRefusesWhatIsGone: a prefill job from the cache is
// served only from a state at exactly its tokens; one the cache does not
// hold (evicted, or never there) fails with ErrNotCached and computes
// nothing, and an adoption of a state the cache holds already moves
// nothing.
func TestStateFromCacheRefusesWhatIsGone(t *testing.T) {
	ranks := newRanks(t, rankOpts{ranks: 1, batch: 2, checkpoints: 4})
	src := &holderSource{dst: ranks}
	pre := runCachedRole(t, Config{Role: RolePrefill, PrefixCache: true, StateSource: src}, ranks)
	src.holders = map[string]*Scheduler{"self": pre}
	p := model.Encode(systemPrompt + "<|user|>Never seen.\n<|assistant|>")

	_, err := pre.Prefill(context.Background(), PrefillJob{Prompt: p, FromCache: true})
	require.ErrorIs(t, err, ErrNotCached)
	_, err = pre.Prefill(context.Background(), PrefillJob{FromCache: true})
	require.ErrorIs(t, err, ErrInvalidRequest, "no tokens: no state to lend")
	require.Equal(t, 1.0, counterValue(t, pre.Metrics().StateReturns.WithLabelValues("prefill", "refused")))

	l, err := pre.Prefill(context.Background(), PrefillJob{Prompt: p}) // leaves a checkpoint at len(p)
	require.NoError(t, err)
	l.Release()
	l, err = pre.Prefill(context.Background(), PrefillJob{Prompt: p, FromCache: true})
	require.NoError(t, err)
	require.Equal(t, len(p), l.Tokens, "the state after exactly the job's tokens")
	require.Equal(t, ranks[0].kvCfg.BlocksFor(len(p)), runBlocks(l.Runs), "the blocks that hold them, no more")
	l.Release()

	done := make(chan error, 1)
	require.NoError(t, pre.Adopt(context.Background(), AdoptRequest{Tokens: p, Holder: "self", Done: func(err error) { done <- err }}))
	require.NoError(t, <-done)
	require.Equal(t, 1.0, counterValue(t, pre.Metrics().StateReturns.WithLabelValues("prefill", "held")))
	require.Empty(t, src.skips, "a state held already is not fetched")

	require.ErrorIs(t, newScheduler(t, Config{Role: RoleDecode}, newRanks(t, rankOpts{ranks: 1, batch: 1})).
		Adopt(context.Background(), AdoptRequest{Tokens: p, Holder: "x"}), ErrWrongRole)
}

func runBlocks(runs []kvcache.Run) int {
	n := 0
	for _, r := range runs {
		n += int(r.Len)
	}
	return n
}

// TestStateReturnNeverWaits: an adoption finds room at once or is dropped
// (ErrQueueFull, counted busy): it neither waits for a row nor delays a
// request queued behind it.
func TestStateReturnNeverWaits(t *testing.T) {
	ranks := newRanks(t, rankOpts{ranks: 1, batch: 1, checkpoints: 4})
	src := &holderSource{dst: ranks}
	pre := runCachedRole(t, Config{Role: RolePrefill, PrefixCache: true, StateSource: src}, ranks)
	p := model.Encode(systemPrompt + "<|user|>Hold the row.\n<|assistant|>")
	// A prefill holds the only row until released.
	pend, err := pre.SubmitPrefill(context.Background(), PrefillJob{Prompt: p})
	require.NoError(t, err)
	l, err := pend.Wait(context.Background())
	require.NoError(t, err)

	done := make(chan error, 1)
	require.NoError(t, pre.Adopt(context.Background(), AdoptRequest{Tokens: append(slices.Clone(p), 'x'), Holder: "d1",
		Done: func(err error) { done <- err }}))
	select {
	case err := <-done:
		require.ErrorIs(t, err, ErrQueueFull, "no room: dropped, not queued")
	case <-time.After(5 * time.Second):
		t.Fatal("the adoption waits for a row")
	}
	require.Equal(t, 1.0, counterValue(t, pre.Metrics().StateReturns.WithLabelValues("prefill", "busy")))
	require.Empty(t, src.skips, "nothing fetched")
	l.Release()
}

// TestAdoptedStateReplacesItsOwn: on a rank of one checkpoint row, an
// adopted state never evicts another conversation's (it is dropped as
// busy), and replaces the state of its own conversation it supersedes.
func TestAdoptedStateReplacesItsOwn(t *testing.T) {
	ranks := newRanks(t, rankOpts{ranks: 1, batch: 2, checkpoints: 1})
	src := &holderSource{dst: ranks}
	pre := runCachedRole(t, Config{Role: RolePrefill, PrefixCache: true, StateSource: src}, ranks)
	holder := runCachedRole(t, Config{Role: RolePrefill, PrefixCache: true}, newRanks(t, rankOpts{ranks: 1, batch: 2, checkpoints: 4}))
	src.holders = map[string]*Scheduler{"h": holder}
	ctx := context.Background()
	prefill := func(s *Scheduler, p []int32) {
		l, err := s.Prefill(ctx, PrefillJob{Prompt: p})
		require.NoError(t, err)
		l.Release()
	}
	held := func(p []int32) error {
		l, err := pre.Prefill(ctx, PrefillJob{Prompt: p, FromCache: true})
		if err == nil {
			l.Release()
		}
		return err
	}
	adopt := func(p []int32) error {
		done := make(chan error, 1)
		require.NoError(t, pre.Adopt(ctx, AdoptRequest{Tokens: p, Holder: "h", Done: func(err error) { done <- err }}))
		return <-done
	}
	a := model.Encode("Alpha asks about the state rows of a hybrid model.")
	b := model.Encode("Beta wants to know nothing about them at all.")
	a2 := slices.Concat(a, model.Encode(" The reply, and more."))
	prefill(pre, a) // the rank's one checkpoint row: a's state
	prefill(holder, b)
	prefill(holder, a2)

	require.ErrorIs(t, adopt(b), ErrQueueFull, "no free row and no state of its own: dropped")
	require.NoError(t, held(a), "another conversation's state is not evicted for it")
	require.Equal(t, 1.0, counterValue(t, pre.Metrics().StateReturns.WithLabelValues("prefill", "busy")))

	require.NoError(t, adopt(a2))
	require.NoError(t, held(a2), "the adopted state is kept")
	require.ErrorIs(t, held(a), ErrNotCached, "in the row of the state it superseded")
}
