package worker

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

// cacheRanks builds ranks with a prefix cache of cks checkpoint rows.
func cacheRanks(t testing.TB, o rankOpts, cks int) []*Rank {
	t.Helper()
	o.checkpoints = cks
	return newRanks(t, o)
}

// runCached runs sched's loop until the test ends and checks that every
// row and block is free again, or cached and evictable.
func runCached(t testing.TB, cfg Config, ranks []*Rank) *Scheduler {
	t.Helper()
	cfg.Role = RoleDecode
	return runCachedRole(t, cfg, ranks)
}

func runCachedRole(t testing.TB, cfg Config, ranks []*Rank) *Scheduler {
	t.Helper()
	sched, err := NewScheduler(cfg, ranks)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sched.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		for i, r := range ranks {
			s := r.mgr.Stats()
			require.Equal(t, r.kvCfg.NumBlocks(), s.BlocksAvailable, "rank %d: blocks held after the end", i)
			require.Equal(t, r.mCfg.RealRows(), s.RowsFree, "rank %d", i)
			require.Zero(t, s.Checkpoints.Pinned+s.Checkpoints.Filling, "rank %d", i)
		}
	})
	return sched
}

// turn is one request of a conversation script.
type turn struct {
	conv   string // conversation name
	base   string // "" starts from the system prompt; else the turn whose prompt+reply it continues
	user   string
	resend string // the exact prompt of this earlier turn again
}

// The script: two conversations sharing a system prompt, each continued
// for several turns, a branch (two continuations of one turn), and a
// prompt equal to an earlier one.
var convScript = []turn{
	{conv: "a1", user: "Tell me about hybrid models."},
	{conv: "b1", user: "What is a Mamba layer?"},
	{conv: "a2", base: "a1", user: "More, please."},
	{conv: "a3", base: "a2", user: "And the KV cache?"},
	{conv: "b2", base: "b1", user: "Why a state row?"},
	{conv: "a4", base: "a3", user: "Thanks."},
	{conv: "a3x", base: "a2", user: "Another branch."},
	{conv: "b3", base: "b2", user: "ok"},
	{conv: "a3again", resend: "a3"},
	{conv: "a5", base: "a4", user: "Go on."},
	{conv: "b4", base: "b3", user: "Last one for b, a longer message this time."},
	{conv: "a6", base: "a5", user: "bye"},
}

const systemPrompt = "<|system|>You are a helpful assistant that answers briefly.\n"

// runScript runs convScript one request after another and returns each
// turn's tokens and its final event.
func runScript(t *testing.T, sched *Scheduler, maxTokens int) (map[string][]int32, map[string]Output) {
	prompts := map[string][]int32{}
	toks := map[string][]int32{}
	outs := map[string]Output{}
	for _, tr := range convScript {
		var p []int32
		switch {
		case tr.resend != "":
			p = prompts[tr.resend]
		case tr.base == "":
			p = model.Encode(systemPrompt + "<|user|>" + tr.user + "\n<|assistant|>")
		default:
			p = slices.Concat(prompts[tr.base], toks[tr.base], model.Encode("\n<|user|>"+tr.user+"\n<|assistant|>"))
		}
		prompts[tr.conv] = p
		s, err := sched.Generate(context.Background(), GenerateRequest{Prompt: p, MaxTokens: maxTokens})
		require.NoError(t, err)
		toks[tr.conv], outs[tr.conv] = drainStream(t, s)
		require.NoError(t, outs[tr.conv].Err, tr.conv)
	}
	return toks, outs
}

// TestPrefixCacheMatchesCacheOff: multi-turn conversations, a shared
// system prompt, a branch and a resent prompt give, with the prefix cache,
// exactly the tokens they give without it, whatever the chunking, the
// checkpoint interval, the ranks or a pool so small that it evicts; and
// with room the later turns are mostly served from the cache.
func TestPrefixCacheMatchesCacheOff(t *testing.T) {
	cases := []struct {
		name     string
		o        rankOpts
		cks      int
		chunk    int
		interval int
		hits     bool // later turns must hit
	}{
		{name: "roomy", o: rankOpts{ranks: 1, batch: 2}, cks: 16, hits: true},
		{name: "chunked", o: rankOpts{ranks: 1, batch: 2}, cks: 16, chunk: 7, hits: true},
		{name: "interval", o: rankOpts{ranks: 1, batch: 2}, cks: 16, interval: 16, hits: true},
		{name: "adp", o: rankOpts{ranks: 2, batch: 1, adp: true}, cks: 24, chunk: 13, interval: 32, hits: true},
		{name: "tiny pools", o: rankOpts{ranks: 1, batch: 1, blocks: 24}, cks: 2, interval: 8},
		{name: "synthetic", o: rankOpts{ranks: 1, batch: 2, model: model.NemotronH8B + "?touch=head", blocks: 64}, cks: 4},
	}
	// The cache-off replies depend on the model only (not on ranks, pools
	// or chunking): one oracle run per model.
	oracles := map[string]map[string][]int32{}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			want, ok := oracles[c.o.model]
			if !ok {
				off := runCached(t, Config{}, cacheRanks(t, rankOpts{ranks: 1, batch: 2, blocks: 64, model: c.o.model}, 0))
				want, _ = runScript(t, off, 10)
				oracles[c.o.model] = want
			}
			on := runCached(t, Config{AttentionDP: c.o.adp, PrefillChunkTokens: c.chunk, PrefixCache: true, CheckpointInterval: c.interval},
				cacheRanks(t, c.o, c.cks))
			got, outs := runScript(t, on, 10)
			for _, tr := range convScript {
				if c.o.model != "" && tr.base != "" {
					// The synthetic presets' decode hashes the cache
					// (fake math), so a continued conversation's
					// text is no oracle there; its first turns are.
					continue
				}
				require.Equal(t, want[tr.conv], got[tr.conv], "turn %s", tr.conv)
			}
			cached := 0
			for _, tr := range convScript {
				cached += outs[tr.conv].Cached
				if c.hits && tr.base != "" {
					require.Positive(t, outs[tr.conv].Cached, "turn %s computed its whole prompt", tr.conv)
				}
			}
			if c.hits {
				require.Positive(t, outs["a3again"].Cached, "a resent prompt hits")
				if c.interval > 0 {
					require.Positive(t, outs["b1"].Cached, "b's first turn shares the system prompt")
				}
			}
			for _, tr := range convScript {
				t.Logf("%s: %d cached, %d generated", tr.conv, outs[tr.conv].Cached, len(got[tr.conv]))
			}
			t.Logf("%d prompt tokens served from the cache", cached)
		})
	}
}

// TestPrefixCacheConcurrentMatchesCacheOff: the same conversations all at
// once, each turn sent when its base ended, on two ADP ranks with small
// pools: hits, misses, evictions and pins interleave, and the tokens are
// still those of the cache-off run.
func TestPrefixCacheConcurrentMatchesCacheOff(t *testing.T) {
	o := rankOpts{ranks: 2, batch: 2, adp: true, blocks: 40}
	off := runCached(t, Config{AttentionDP: true}, cacheRanks(t, o, 3))
	want, _ := runScript(t, off, 10)
	on := runCached(t, Config{AttentionDP: true, PrefixCache: true, PrefillChunkTokens: 9, CheckpointInterval: 16}, cacheRanks(t, o, 3))
	var mu sync.Mutex
	prompts, toks := map[string][]int32{}, map[string][]int32{}
	ended := map[string]chan struct{}{}
	for _, tr := range convScript {
		ended[tr.conv] = make(chan struct{})
	}
	var wg sync.WaitGroup
	for _, tr := range convScript {
		wg.Go(func() {
			defer close(ended[tr.conv])
			var p []int32
			switch {
			case tr.resend != "":
				<-ended[tr.resend]
				mu.Lock()
				p = prompts[tr.resend]
				mu.Unlock()
			case tr.base == "":
				p = model.Encode(systemPrompt + "<|user|>" + tr.user + "\n<|assistant|>")
			default:
				<-ended[tr.base]
				mu.Lock()
				p = slices.Concat(prompts[tr.base], toks[tr.base], model.Encode("\n<|user|>"+tr.user+"\n<|assistant|>"))
				mu.Unlock()
			}
			s, err := on.Generate(context.Background(), GenerateRequest{Prompt: p, MaxTokens: 10})
			if !assertNoErr(t, err) {
				return
			}
			got, ev := drainStream(t, s)
			assertNoErr(t, ev.Err)
			mu.Lock()
			prompts[tr.conv], toks[tr.conv] = p, got
			mu.Unlock()
		})
	}
	wg.Wait()
	for _, tr := range convScript {
		require.Equal(t, want[tr.conv], toks[tr.conv], "turn %s", tr.conv)
	}
}

func assertNoErr(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Error(err)
		return false
	}
	return true
}

// TestPrefixCacheCancelWhileCopying: a request cancelled after its hit was
// placed, before its first step copied the checkpoint, lets go of the pin
// (runCached checks none is left), and the next request still hits.
func TestPrefixCacheCancelWhileCopying(t *testing.T) {
	ranks := cacheRanks(t, rankOpts{ranks: 1, batch: 2, model: model.TinyHybrid + "?prefill_delay=2ms"}, 4)
	sched := runCached(t, Config{PrefixCache: true}, ranks)
	p := model.Encode(systemPrompt + "<|user|>hello\n<|assistant|>")
	s, err := sched.Generate(context.Background(), GenerateRequest{Prompt: p, MaxTokens: 1})
	require.NoError(t, err)
	_, ev := drainStream(t, s)
	require.NoError(t, ev.Err)
	p2 := append(slices.Clone(p), model.Encode(" more text that takes a while")...)
	for range 5 {
		ctx, cancel := context.WithCancel(context.Background())
		s, err = sched.Generate(ctx, GenerateRequest{Prompt: p2, MaxTokens: 4})
		require.NoError(t, err)
		time.Sleep(time.Millisecond)
		cancel()
		_, ev = drainStream(t, s)
	}
	s, err = sched.Generate(context.Background(), GenerateRequest{Prompt: p2, MaxTokens: 4})
	require.NoError(t, err)
	_, ev = drainStream(t, s)
	require.NoError(t, ev.Err)
	require.Equal(t, len(p), ev.Cached, "the checkpoint at the end of the first prompt serves it")
	rs := ranks[0].mgr.Stats()
	require.Zero(t, rs.Checkpoints.Pinned, "no pin outlives its request")
}

// TestPrefixCacheOffIsUnchanged: with PrefixCache off nothing is looked
// up, published or checkpointed, even on ranks that have checkpoint rows.
func TestPrefixCacheOffIsUnchanged(t *testing.T) {
	ranks := cacheRanks(t, rankOpts{ranks: 1, batch: 1}, 4)
	sched := runCached(t, Config{}, ranks)
	for i := range 3 {
		s, err := sched.Generate(context.Background(), GenerateRequest{Prompt: model.Encode(fmt.Sprintf("%s%d", systemPrompt, i)), MaxTokens: 3})
		require.NoError(t, err)
		_, ev := drainStream(t, s)
		require.NoError(t, ev.Err)
		require.Zero(t, ev.Cached)
	}
	st := ranks[0].mgr.Stats()
	require.Zero(t, st.BlocksCached)
	require.Equal(t, 4, st.Checkpoints.Free)
}

// TestPrefixCacheLocalContinuation: with --prefill auto, a conversation's
// first turn (a long prompt) is prefilled remotely, and its decode keeps
// the state at the end of the reply; the next turn, as long but nearly all
// cached on that rank, is prefilled here from the cached state with no
// transfer at all, and every reply is the cache-off one. The prefill
// worker's own hits reach the decode's cached_tokens when a turn does go
// remote.
func TestPrefixCacheLocalContinuation(t *testing.T) {
	o := rankOpts{ranks: 1, batch: 2}
	pre := runCachedRole(t, Config{Role: RolePrefill, PrefixCache: true, CheckpointInterval: 32}, cacheRanks(t, o, 8))
	dranks := cacheRanks(t, o, 8)
	src := &countingSource{gateSource: gateSource{pre: pre, dst: dranks}}
	router := AutoRouter{
		Policy: AutoPolicy{MinRemoteTokens: 64, MaxPrefillQueue: 100},
		Load:   func() PrefillLoad { return PrefillLoad{Instances: 1, Rows: 2} },
	}
	dec := runCached(t, Config{Source: src, Router: router, PrefixCache: true}, dranks)
	off := runCached(t, Config{}, cacheRanks(t, o, 8))

	p := model.Encode(systemPrompt + "<|user|>Tell me a long story about caches.\n<|assistant|>")
	var fetches []int32
	for turn := range 4 {
		want, _ := generate(t, off, p)
		got, ev := generate(t, dec, p)
		require.Equal(t, want, got, "turn %d", turn+1)
		fetches = append(fetches, src.fetches.Load())
		if turn > 0 {
			require.Greater(t, ev.Cached, len(p)-64, "turn %d: the rank's cached state serves all but the new message", turn+1)
			require.Zero(t, ev.Timing.Handoff, "turn %d was prefilled here", turn+1)
		}
		p = slices.Concat(p, got, model.Encode(fmt.Sprintf("\n<|user|>go on %d\n<|assistant|>", turn)))
	}
	require.Equal(t, []int32{1, 1, 1, 1}, fetches, "only the first turn was fetched")

	// Another conversation under the same system prompt goes remote, and
	// the prefill worker's hit on the system prompt travels back.
	_, ev := generate(t, dec, model.Encode(systemPrompt+"<|user|>Something else entirely, and at some length.\n<|assistant|>"))
	require.Equal(t, int32(2), src.fetches.Load())
	require.Positive(t, ev.Cached, "the prefill worker's hit on the system prompt")
	require.Positive(t, ev.Timing.Handoff)
}

func generate(t *testing.T, s *Scheduler, p []int32) ([]int32, Output) {
	t.Helper()
	st, err := s.Generate(context.Background(), GenerateRequest{Prompt: p, MaxTokens: 12})
	require.NoError(t, err)
	toks, ev := drainStream(t, st)
	require.NoError(t, ev.Err)
	return toks, ev
}

// TestPrefixCacheSharedBlocksCountOnce: a request that shares the blocks
// of a running request is admitted for its own blocks only. On a rank of
// 20 blocks, A (a 150-token prompt, 30 tokens to generate: 12 blocks) is
// running; B continues A's prompt (168 tokens: 11 blocks, 9 of them A's)
// and needs 3 of its own (2 and the pinned tail): it runs beside A, and
// ends first. Counting the shared blocks again (12 + 11 > 20) would hold
// B until A ended.
func TestPrefixCacheSharedBlocksCountOnce(t *testing.T) {
	o := rankOpts{ranks: 1, batch: 2, blocks: 20, model: model.TinyHybrid + "?decode_delay=20ms"}
	sched := runCached(t, Config{PrefixCache: true}, cacheRanks(t, o, 4))
	pa := model.Encode(strings.Repeat("shared prefix ", 11))[:150]
	a, err := sched.Generate(context.Background(), GenerateRequest{Prompt: pa, MaxTokens: 30})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	first, err := a.Next(ctx)
	require.NoError(t, err)
	require.False(t, first.Done)
	aDone := make(chan time.Time, 1)
	go func() {
		_, ev := drainStream(t, a)
		assertNoErr(t, ev.Err)
		aDone <- time.Now()
	}()
	pb := append(slices.Clone(pa), model.Encode(" and then")...)
	b, err := sched.Generate(context.Background(), GenerateRequest{Prompt: pb, MaxTokens: 8})
	require.NoError(t, err)
	_, ev := drainStream(t, b)
	require.NoError(t, ev.Err)
	bDone := time.Now()
	require.Equal(t, len(pa), ev.Cached)
	require.True(t, bDone.Before(<-aDone), "B waited for A: its shared blocks were counted twice")
}

// TestPrefixCacheRemoteRouteTakesNoHitRoom: with --prefill auto, a request
// whose hit would have saved room but which is routed remote (its rank is
// busy) takes no hit, so it must have been admitted for its whole
// promise: B, continuing running A's prompt on a 20-block rank, waits for
// room instead of being admitted on a hit it may not take and promised
// blocks the rank does not have; both end well (a Grow failed otherwise).
func TestPrefixCacheRemoteRouteTakesNoHitRoom(t *testing.T) {
	o := rankOpts{ranks: 1, batch: 2, blocks: 20, model: model.TinyHybrid + "?decode_delay=10ms"}
	pre := runCachedRole(t, Config{Role: RolePrefill}, newRanks(t, rankOpts{ranks: 1, batch: 2}))
	dranks := cacheRanks(t, o, 4)
	src := &countingSource{gateSource: gateSource{pre: pre, dst: dranks}}
	router := AutoRouter{
		Policy: AutoPolicy{MinRemoteTokens: 1000, MaxLocalRunning: 1, MaxPrefillQueue: 100},
		Load:   func() PrefillLoad { return PrefillLoad{Instances: 1, Rows: 2} },
	}
	m := NewMetrics(prometheus.NewRegistry())
	sched := runCached(t, Config{Source: src, Router: router, PrefixCache: true, Metrics: m}, dranks)
	pa := model.Encode(strings.Repeat("shared prefix ", 11))[:150]
	a, err := sched.Generate(context.Background(), GenerateRequest{Prompt: pa, MaxTokens: 30})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err = a.Next(ctx) // A runs here (a short prompt, an idle rank) and keeps its prompt's state
	require.NoError(t, err)
	b, err := sched.Generate(context.Background(), GenerateRequest{Prompt: append(slices.Clone(pa), model.Encode(" and then")...), MaxTokens: 8})
	require.NoError(t, err)
	_, ev := drainStream(t, b)
	require.NoError(t, ev.Err)
	_, ev = drainStream(t, a)
	require.NoError(t, ev.Err)
	t.Logf("B fetched: %v", src.fetches.Load() == 1)
	lookups := counterValue(t, m.PrefixLookups.WithLabelValues(string(RoleDecode), "0", "miss")) +
		counterValue(t, m.PrefixLookups.WithLabelValues(string(RoleDecode), "0", "hit"))
	require.Equal(t, float64(2-src.fetches.Load()), lookups, "only requests prefilled here count a lookup")
}
