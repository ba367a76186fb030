package worker

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
)

type rankOpts struct {
	ranks, batch int
	adp          bool
	blocks       int
	model        string
	checkpoints  int // state checkpoint rows per rank (the prefix cache)
	draft        int // speculative decoding: draft tokens (0: off)
	sched        string
	gating       bool
}

func newRanks(t testing.TB, o rankOpts) []*Rank {
	t.Helper()
	if o.model == "" {
		o.model = model.TinyHybrid
	}
	exec, err := model.Lookup(o.model)
	require.NoError(t, err)
	sched, err := mambacache.ParseDraftSchedule(o.sched)
	require.NoError(t, err)
	cfg, err := PoolConfig(exec.Spec(), PoolParams{MaxBatchSize: o.batch, AttentionDP: o.adp, KVBlocks: o.blocks,
		StateCheckpoints: o.checkpoints, DraftTokens: o.draft, DraftLenSchedule: sched, AcceptanceGating: o.gating})
	require.NoError(t, err)
	out := make([]*Rank, o.ranks)
	for i := range out {
		m, err := hybrid.New(cfg)
		require.NoError(t, err)
		r, err := NewRank(i, m, exec, make([]byte, cfg.KV.ArenaBytes()), make([]byte, cfg.Mamba.ArenaBytes()))
		require.NoError(t, err)
		out[i] = r
	}
	return out
}

// startScheduler runs sched's loop until the test ends and checks that it stopped
// and left every pool at its idle counts.
func startScheduler(t testing.TB, sched *Scheduler) {
	t.Helper()
	idle := make([]hybrid.Stats, len(sched.ranks))
	for i, r := range sched.ranks {
		idle[i] = r.mgr.Stats()
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sched.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		for i, r := range sched.ranks {
			require.Equal(t, idle[i], r.mgr.Stats(), "rank %d pools not back to idle", i)
		}
	})
}

func newScheduler(t testing.TB, cfg Config, ranks []*Rank) *Scheduler {
	t.Helper()
	if cfg.Role == "" {
		cfg.Role = RoleDecode
	}
	sched, err := NewScheduler(cfg, ranks)
	require.NoError(t, err)
	startScheduler(t, sched)
	return sched
}

// drainStream reads a stream to its final event.
func drainStream(t testing.TB, s *Stream) ([]int32, Output) {
	t.Helper()
	var toks []int32
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		ev, err := s.Next(ctx)
		cancel()
		require.NoError(t, err, "stream did not end")
		if ev.Done {
			return toks, ev
		}
		toks = append(toks, ev.Token)
	}
}

// reference generates with the executor directly on a private pool: the
// oracle every scheduler mode must match token for token.
func reference(t testing.TB, name string, prompt []int32, maxTokens int, temp float64, seed uint64) []int32 {
	t.Helper()
	exec, err := model.Lookup(name)
	require.NoError(t, err)
	cfg, err := PoolConfig(exec.Spec(), PoolParams{MaxBatchSize: 1})
	require.NoError(t, err)
	m, err := hybrid.New(cfg)
	require.NoError(t, err)
	kv, mb := make([]byte, cfg.KV.ArenaBytes()), make([]byte, cfg.Mamba.ArenaBytes())
	r, err := NewRank(0, m, exec, kv, mb)
	require.NoError(t, err)
	_, err = m.Prepare(1, len(prompt))
	require.NoError(t, err)
	c, err := r.cache(1, nil)
	require.NoError(t, err)
	logits, err := exec.Prefill(c, prompt)
	require.NoError(t, err)
	var out []int32
	pos := len(prompt)
	for step := 0; ; step++ {
		tok := model.Sample(logits, temp, seed, step)
		if tok == model.EOS {
			return out
		}
		out = append(out, tok)
		if len(out) == maxTokens {
			return out
		}
		require.NoError(t, m.Grow(1, pos+1))
		c, err = r.cache(1, nil)
		require.NoError(t, err)
		logits, err = exec.Decode(c, tok, pos)
		require.NoError(t, err)
		pos++
	}
}

var testPrompts = []string{
	"Hello, world",
	"The quick brown fox jumps over the lazy dog.",
	"a",
	"0123456789abcdef0123",
}

func TestSchedulerLocalMatchesReference(t *testing.T) {
	ranks := newRanks(t, rankOpts{ranks: 2, batch: 2, adp: true})
	sched := newScheduler(t, Config{AttentionDP: true}, ranks)
	type job struct {
		prompt []int32
		temp   float64
		seed   uint64
		stream *Stream
	}
	var jobs []*job
	for i, p := range testPrompts[:3] {
		for _, temp := range []float64{0, 0.8} {
			j := &job{prompt: model.Encode(p), temp: temp, seed: uint64(i + 7)}
			s, err := sched.Generate(context.Background(), GenerateRequest{
				Prompt: j.prompt, MaxTokens: 8, Sampling: Sampling{Temperature: j.temp, Seed: j.seed},
			})
			require.NoError(t, err)
			j.stream = s
			jobs = append(jobs, j)
		}
	}
	for _, j := range jobs {
		toks, ev := drainStream(t, j.stream)
		require.NoError(t, ev.Err)
		require.Equal(t, reference(t, model.TinyHybrid, j.prompt, 8, j.temp, j.seed), toks)
		require.Contains(t, []string{"length", "stop"}, ev.Finish)
	}
}

func TestSchedulerDeterministic(t *testing.T) {
	run := func() [][]int32 {
		ranks := newRanks(t, rankOpts{ranks: 1, batch: 4})
		sched, err := NewScheduler(Config{Role: RoleDecode}, ranks)
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() { _ = sched.Run(ctx) }()
		var out [][]int32
		for i, p := range testPrompts {
			s, err := sched.Generate(ctx, GenerateRequest{Prompt: model.Encode(p), MaxTokens: 6, Sampling: Sampling{Temperature: 0.7, Seed: uint64(i)}})
			require.NoError(t, err)
			toks, ev := drainStream(t, s)
			require.NoError(t, ev.Err)
			out = append(out, toks)
		}
		return out
	}
	require.Equal(t, run(), run())
}

func TestSchedulerValidation(t *testing.T) {
	ranks := newRanks(t, rankOpts{ranks: 1, batch: 1, blocks: 4})
	sched := newScheduler(t, Config{}, ranks)
	max := sched.MaxContext()
	require.Equal(t, 4*ranks[0].kvCfg.TokensPerBlock, max)
	tests := []struct {
		name string
		g    GenerateRequest
		want error
	}{
		{"empty prompt", GenerateRequest{MaxTokens: 1}, ErrInvalidRequest},
		{"zero max tokens", GenerateRequest{Prompt: []int32{1}}, ErrInvalidRequest},
		{"negative max tokens", GenerateRequest{Prompt: []int32{1}, MaxTokens: -3}, ErrInvalidRequest},
		{"negative temperature", GenerateRequest{Prompt: []int32{1}, MaxTokens: 1, Sampling: Sampling{Temperature: -1}}, ErrInvalidRequest},
		{"too long", GenerateRequest{Prompt: make([]int32, max), MaxTokens: 1}, ErrTooLong},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := sched.Generate(context.Background(), tt.g)
			require.ErrorIs(t, err, tt.want)
		})
	}
	_, err := sched.Prefill(context.Background(), PrefillJob{Prompt: []int32{1}})
	require.ErrorIs(t, err, ErrWrongRole)
	// The longest request that fits runs.
	s, err := sched.Generate(context.Background(), GenerateRequest{Prompt: make([]int32, max-2), MaxTokens: 2})
	require.NoError(t, err)
	_, ev := drainStream(t, s)
	require.NoError(t, ev.Err)
}

// gateSource is a CacheSource that holds each fetch until released, then
// fills the destination through a prefill scheduler (a loopback transfer).
type gateSource struct {
	pre     *Scheduler
	dst     []*Rank
	gate    chan struct{}
	started chan uint64
}

func (g *gateSource) Fetch(ctx context.Context, f FetchRequest) (FetchResult, error) {
	if g.started != nil {
		g.started <- f.ID
	}
	if g.gate != nil {
		select {
		case <-g.gate:
		case <-ctx.Done():
			return FetchResult{}, ctx.Err()
		}
	}
	return loopbackFetch(ctx, g.pre, g.dst, f)
}

// loopbackFetch prefills f on pre and copies the cache into f's destination.
func loopbackFetch(ctx context.Context, pre *Scheduler, dst []*Rank, f FetchRequest) (FetchResult, error) {
	return loopbackJob(ctx, pre, dst, f, PrefillJob{Prompt: f.Prompt, Sampling: f.Sampling, LogID: f.LogID, Drafts: f.Drafts})
}

// loopbackJob runs job on pre and copies its cache into f's destination.
func loopbackJob(ctx context.Context, pre *Scheduler, dst []*Rank, f FetchRequest, job PrefillJob) (FetchResult, error) {
	l, err := pre.Prefill(ctx, job)
	if err != nil {
		return FetchResult{}, err
	}
	defer l.Release()
	src, d := pre.ranks[l.Rank], dst[f.Rank]
	var kvBytes int64
	var srcKV, dstKV []byte
	// A delta handoff moves the blocks after the first f.Skip only, as
	// transfer.SkipBlocks cuts both sides.
	from, err := skipRuns(l.Runs, f.Skip)
	if err != nil {
		return FetchResult{}, err
	}
	to, err := skipRuns(f.Runs, f.Skip)
	if err != nil {
		return FetchResult{}, err
	}
	for _, run := range from {
		x := src.kvCfg.RunExtent(run)
		srcKV = append(srcKV, src.kvArena[x.Offset:x.Offset+x.Length]...)
	}
	for _, run := range to {
		x := d.kvCfg.RunExtent(run)
		dstKV = d.kvArena[x.Offset : x.Offset+x.Length]
		n := copy(dstKV, srcKV)
		srcKV = srcKV[n:]
		kvBytes += int64(n)
	}
	if len(srcKV) != 0 {
		return FetchResult{}, errors.New("loopback: destination shorter than source")
	}
	sx, dx := src.mCfg.RowExtent(l.Row), d.mCfg.RowExtent(f.Row)
	copy(d.mambaArena[dx.Offset:dx.Offset+dx.Length], src.mambaArena[sx.Offset:sx.Offset+sx.Length])
	return FetchResult{First: l.First, FirstLogprobs: l.FirstLogprobs, Cached: l.Cached, Compute: l.Compute, KVBytes: kvBytes, MambaBytes: dx.Length,
		Drafts: l.Drafts}, nil
}

// skipRuns is runs less their first k blocks.
func skipRuns(runs []kvcache.Run, k int) ([]kvcache.Run, error) {
	var out []kvcache.Run
	for _, r := range runs {
		switch {
		case k >= int(r.Len):
			k -= int(r.Len)
		case k > 0:
			out = append(out, kvcache.Run{Start: r.Start + kvcache.BlockID(k), Len: r.Len - uint32(k)})
			k = 0
		default:
			out = append(out, r)
		}
	}
	if k > 0 || len(out) == 0 {
		return nil, errors.New("loopback: skip of every block")
	}
	return out, nil
}

func TestSchedulerRemoteMatchesLocal(t *testing.T) {
	pre := newScheduler(t, Config{Role: RolePrefill, AttentionDP: true}, newRanks(t, rankOpts{ranks: 2, batch: 1, adp: true}))
	dranks := newRanks(t, rankOpts{ranks: 2, batch: 1, adp: true})
	dec := newScheduler(t, Config{AttentionDP: true, Source: &gateSource{pre: pre, dst: dranks}}, dranks)
	var streams []*Stream
	for i, p := range testPrompts {
		s, err := dec.Generate(context.Background(), GenerateRequest{Prompt: model.Encode(p), MaxTokens: 6, Sampling: Sampling{Temperature: float64(i%2) * 0.9, Seed: uint64(i)}})
		require.NoError(t, err)
		streams = append(streams, s)
	}
	for i, s := range streams {
		toks, ev := drainStream(t, s)
		require.NoError(t, ev.Err)
		require.Equal(t, reference(t, model.TinyHybrid, model.Encode(testPrompts[i]), 6, float64(i%2)*0.9, uint64(i)), toks)
		require.Greater(t, ev.Timing.Handoff, time.Duration(0))
	}
}

// TestSchedulerSeedScenario is the case the reserved ADP row exists for:
// dp-size 2, max-batch-size 1, a request whose cache is in flight holds
// rank 0's only real row while rank 1 generates, so rank 0 looks idle and
// must pad the dummy every iteration.
func TestSchedulerSeedScenario(t *testing.T) {
	pre := newScheduler(t, Config{Role: RolePrefill, AttentionDP: true}, newRanks(t, rankOpts{ranks: 2, batch: 1, adp: true}))
	dranks := newRanks(t, rankOpts{ranks: 2, batch: 1, adp: true})
	gate := make(chan struct{})
	src := &gateSource{pre: pre, dst: dranks, gate: gate, started: make(chan uint64, 4)}
	dec := newScheduler(t, Config{AttentionDP: true, Source: src}, dranks)

	// Request A: admitted on rank 0, its fetch held at the gate.
	sa, err := dec.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("held in transfer"), MaxTokens: 4})
	require.NoError(t, err)
	<-src.started
	// Request B: rank 1; its fetch is held too until we open the gate for it.
	sb, err := dec.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("generating"), MaxTokens: 30})
	require.NoError(t, err)
	<-src.started
	// Both real rows are held by transfers: a third request waits in the queue.
	sc, err := dec.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("queued"), MaxTokens: 2})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return dec.Live() == 3 }, 5*time.Second, time.Millisecond)
	for _, r := range dranks {
		s := r.mgr.Stats()
		require.Equal(t, 0, s.RowsFree)
		require.Equal(t, 1, s.RowsUsed)
		require.Equal(t, 2, s.RowsReserved, "padding row and ADP row")
	}
	dummies := counterValue(t, dec.m.Dummies.WithLabelValues("decode"))
	require.Zero(t, dummies, "no rank has schedulable work yet: nobody pads")

	// Release both fetches; whichever generates while the other is still
	// being served pads; the third request then runs.
	close(gate)
	for _, s := range []*Stream{sa, sb, sc} {
		_, ev := drainStream(t, s)
		require.NoError(t, ev.Err)
	}
	require.Greater(t, counterValue(t, dec.m.Dummies.WithLabelValues("decode")), 0.0)
	require.Equal(t, 3.0, counterValue(t, dec.m.Transfers.WithLabelValues("decode", "ok")))
}

// TestSchedulerSeedScenarioDirect pins the exact state: rank 0's only row held
// by a fetch, rank 1 generating: rank 0 pads while rank 1 steps.
func TestSchedulerSeedScenarioDirect(t *testing.T) {
	pre := newScheduler(t, Config{Role: RolePrefill, AttentionDP: true}, newRanks(t, rankOpts{ranks: 2, batch: 1, adp: true}))
	dranks := newRanks(t, rankOpts{ranks: 2, batch: 1, adp: true})
	gate := make(chan struct{})
	src := &gateSource{pre: pre, dst: dranks, started: make(chan uint64, 4)}
	first := true
	var mu sync.Mutex
	held := &holdFirst{gateSource: src, gate: gate, first: &first, mu: &mu}
	dec := newScheduler(t, Config{AttentionDP: true, Source: held}, dranks)

	sa, err := dec.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("held"), MaxTokens: 2})
	require.NoError(t, err)
	<-src.started
	sb, err := dec.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("runs now"), MaxTokens: 20})
	require.NoError(t, err)
	toks, ev := drainStream(t, sb)
	require.NoError(t, ev.Err)
	require.NotEmpty(t, toks)
	// Rank 0 padded on every iteration rank 1 stepped: one per token
	// sampled on decode (the first came with the cache; an EOS is sampled
	// but not emitted).
	steps := len(toks) - 1
	if ev.Finish == "stop" {
		steps++
	}
	require.Equal(t, float64(steps), counterValue(t, dec.m.Dummies.WithLabelValues("decode")))
	s0 := dranks[0].mgr.Stats()
	require.Equal(t, 0, s0.RowsFree, "the transfer still holds rank 0's only real row")
	close(gate)
	_, ev = drainStream(t, sa)
	require.NoError(t, ev.Err)
}

type holdFirst struct {
	*gateSource
	gate  chan struct{}
	first *bool
	mu    *sync.Mutex
}

func (h *holdFirst) Fetch(ctx context.Context, f FetchRequest) (FetchResult, error) {
	h.mu.Lock()
	hold := *h.first
	*h.first = false
	h.mu.Unlock()
	h.started <- f.ID
	if hold {
		select {
		case <-h.gate:
		case <-ctx.Done():
			return FetchResult{}, ctx.Err()
		}
	}
	return loopbackFetch(ctx, h.pre, h.dst, f)
}

func TestSchedulerPrefillPadsWhilePushing(t *testing.T) {
	ranks := newRanks(t, rankOpts{ranks: 2, batch: 1, adp: true})
	pre := newScheduler(t, Config{Role: RolePrefill, AttentionDP: true}, ranks)
	l, err := pre.Prefill(context.Background(), PrefillJob{Prompt: model.Encode("pushing")})
	require.NoError(t, err)
	// The lease holds a real row while "pushing"; the other rank prefills
	// and the pushing rank pads.
	l2, err := pre.Prefill(context.Background(), PrefillJob{Prompt: model.Encode("second")})
	require.NoError(t, err)
	require.NotEqual(t, l.Rank, l2.Rank)
	// Two iterations, each with one idle rank: the first while the other
	// rank was empty, the second while it held the pushing lease. The
	// second lease may arrive while the idle rank still pads (ranks step
	// concurrently), so the count is awaited; no rank has work after it.
	require.Eventually(t, func() bool {
		return counterValue(t, pre.m.Dummies.WithLabelValues("prefill")) == 2
	}, 5*time.Second, time.Millisecond)
	require.Eventually(t, func() bool {
		return gaugeValue(t, pre.m.Sessions.WithLabelValues("prefill")) == 2
	}, 5*time.Second, time.Millisecond)
	l.Release()
	l2.Release()
	l.Release() // idempotent
	require.Eventually(t, func() bool { return pre.Live() == 0 }, 5*time.Second, time.Millisecond)
}

func TestSchedulerQueueFullAndDrain(t *testing.T) {
	ranks := newRanks(t, rankOpts{ranks: 1, batch: 1})
	pre := newScheduler(t, Config{Role: RolePrefill}, newRanks(t, rankOpts{ranks: 1, batch: 4}))
	gate := make(chan struct{})
	src := &gateSource{pre: pre, dst: ranks, gate: gate, started: make(chan uint64, 8)}
	sched := newScheduler(t, Config{QueueSize: 2, Source: src}, ranks)
	gen := func() (*Stream, error) {
		return sched.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("x"), MaxTokens: 3})
	}
	s1, err := gen() // admitted, fetch held
	require.NoError(t, err)
	<-src.started
	s2, err := gen() // queued
	require.NoError(t, err)
	s3, err := gen() // queued
	require.NoError(t, err)
	_, err = gen()
	require.ErrorIs(t, err, ErrQueueFull)

	drained := make(chan error, 1)
	go func() { drained <- sched.Drain(context.Background()) }()
	require.Eventually(t, sched.Draining, 5*time.Second, time.Millisecond)
	_, err = gen()
	require.ErrorIs(t, err, ErrDraining)
	select {
	case <-drained:
		t.Fatal("drain returned with requests in flight")
	case <-time.After(20 * time.Millisecond):
	}
	close(gate)
	for _, s := range []*Stream{s1, s2, s3} {
		toks, ev := drainStream(t, s)
		require.NoError(t, ev.Err)
		require.NotEmpty(t, toks)
	}
	require.NoError(t, <-drained)
	require.Equal(t, 2.0, counterValue(t, sched.m.Requests.WithLabelValues("decode", "rejected")))
}

func TestSchedulerCancel(t *testing.T) {
	ranks := newRanks(t, rankOpts{ranks: 1, batch: 1})
	pre := newScheduler(t, Config{Role: RolePrefill}, newRanks(t, rankOpts{ranks: 1, batch: 1}))
	gate := make(chan struct{})
	src := &gateSource{pre: pre, dst: ranks, gate: gate, started: make(chan uint64, 8)}
	sched := newScheduler(t, Config{Source: src}, ranks)
	idle := ranks[0].mgr.Stats()

	// Cancelled while its cache is in flight.
	ctx1, cancel1 := context.WithCancel(context.Background())
	s1, err := sched.Generate(ctx1, GenerateRequest{Prompt: model.Encode("in flight"), MaxTokens: 3})
	require.NoError(t, err)
	<-src.started
	// Cancelled while queued behind it.
	ctx2, cancel2 := context.WithCancel(context.Background())
	s2, err := sched.Generate(ctx2, GenerateRequest{Prompt: model.Encode("queued"), MaxTokens: 3})
	require.NoError(t, err)
	cancel2()
	_, ev := drainStream(t, s2)
	require.ErrorIs(t, ev.Err, context.Canceled)
	cancel1()
	_, ev = drainStream(t, s1)
	require.ErrorIs(t, ev.Err, context.Canceled)
	require.Eventually(t, func() bool { return sched.Live() == 0 }, 5*time.Second, time.Millisecond)
	require.Equal(t, idle, ranks[0].mgr.Stats())
	require.Equal(t, 1.0, counterValue(t, sched.m.Transfers.WithLabelValues("decode", "cancelled")))

	// Cancelled while generating (local scheduler, long generation).
	lr := newRanks(t, rankOpts{ranks: 1, batch: 1, model: model.TinyHybrid + "?decode_delay=5ms"})
	local := newScheduler(t, Config{}, lr)
	ctx3, cancel3 := context.WithCancel(context.Background())
	s3, err := local.Generate(ctx3, GenerateRequest{Prompt: model.Encode("long"), MaxTokens: 500})
	require.NoError(t, err)
	_, err = s3.Next(context.Background())
	require.NoError(t, err)
	cancel3()
	_, ev = drainStream(t, s3)
	require.ErrorIs(t, ev.Err, context.Canceled)
	require.Eventually(t, func() bool { return local.Live() == 0 }, 5*time.Second, time.Millisecond)
	require.Equal(t, 2.0, counterValue(t, sched.m.Requests.WithLabelValues("decode", "cancelled")))
	close(gate)
}

func TestSchedulerStopFailsInflight(t *testing.T) {
	ranks := newRanks(t, rankOpts{ranks: 1, batch: 1})
	pre := newScheduler(t, Config{Role: RolePrefill}, newRanks(t, rankOpts{ranks: 1, batch: 1}))
	src := &gateSource{pre: pre, dst: ranks, gate: make(chan struct{}), started: make(chan uint64, 8)}
	sched, err := NewScheduler(Config{Role: RoleDecode, Source: src}, ranks)
	require.NoError(t, err)
	idle := ranks[0].mgr.Stats()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sched.Run(ctx) }()
	s1, err := sched.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("a"), MaxTokens: 3})
	require.NoError(t, err)
	<-src.started
	s2, err := sched.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("b"), MaxTokens: 3})
	require.NoError(t, err)
	cancel()
	require.NoError(t, <-done)
	for _, s := range []*Stream{s1, s2} {
		_, ev := drainStream(t, s)
		require.Error(t, ev.Err)
	}
	require.Equal(t, idle, ranks[0].mgr.Stats())
	_, err = sched.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("c"), MaxTokens: 3})
	require.ErrorIs(t, err, ErrClosed)
}

// handoff_sessions_inflight follows a lease at once, not at the end of the
// iteration that produced it: one iteration prefills every admitted prompt,
// and with slow prefills it lasts long after the first lease went out.
func TestSchedulerSessionsGaugeLive(t *testing.T) {
	ranks := newRanks(t, rankOpts{ranks: 1, batch: 2, model: model.TinyHybrid + "?prefill_delay=2ms"})
	sched, err := NewScheduler(Config{Role: RolePrefill}, ranks)
	require.NoError(t, err)
	prompt := model.Encode(strings.Repeat("p", 200)) // about 0.4 s of prefill each
	first, err := sched.SubmitPrefill(context.Background(), PrefillJob{Prompt: prompt})
	require.NoError(t, err)
	second, err := sched.SubmitPrefill(context.Background(), PrefillJob{Prompt: prompt})
	require.NoError(t, err)
	startScheduler(t, sched) // both are admitted to the same iteration
	l, err := first.Wait(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1.0, gaugeValue(t, sched.m.Sessions.WithLabelValues("prefill")), "the second prefill still runs")
	l2, err := second.Wait(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2.0, gaugeValue(t, sched.m.Sessions.WithLabelValues("prefill")))
	l.Release()
	l2.Release()
	require.Eventually(t, func() bool {
		return sched.Live() == 0 && gaugeValue(t, sched.m.Sessions.WithLabelValues("prefill")) == 0
	}, 5*time.Second, time.Millisecond)
}

// quarantineSource fails every fetch with an error saying that a writer may
// still store into the destination until released closes
// (transfer.QuarantinedError's contract).
type quarantineSource struct{ released chan struct{} }

type quarantineErr struct{ released chan struct{} }

var _ Quarantine = quarantineErr{}

func (q quarantineErr) Error() string             { return "a writer is still copying" }
func (q quarantineErr) Released() <-chan struct{} { return q.released }

func (s *quarantineSource) Fetch(ctx context.Context, f FetchRequest) (FetchResult, error) {
	return FetchResult{}, fmt.Errorf("test fetch: %w", quarantineErr{s.released})
}

// countingQuarantine is quarantineSource counting its fetches.
type countingQuarantine struct {
	quarantineSource
	fetches atomic.Int32
}

func (s *countingQuarantine) Fetch(ctx context.Context, f FetchRequest) (FetchResult, error) {
	s.fetches.Add(1)
	return s.quarantineSource.Fetch(ctx, f)
}

// Quarantined blocks stay promised: a request that needs them waits in the
// queue until the quarantine ends, instead of being admitted onto blocks
// still held and failing as the pool runs out under it.
func TestSchedulerQuarantinedBlocksStayPromised(t *testing.T) {
	ranks := newRanks(t, rankOpts{ranks: 1, batch: 2, blocks: 4})
	src := &countingQuarantine{quarantineSource: quarantineSource{released: make(chan struct{})}}
	sched := newScheduler(t, Config{Source: src}, ranks)
	idle := ranks[0].mgr.Stats()
	s1, err := sched.Generate(context.Background(), GenerateRequest{Prompt: make([]int32, 40), MaxTokens: 8}) // 3 of 4 blocks
	require.NoError(t, err)
	_, ev := drainStream(t, s1)
	require.Error(t, ev.Err)
	require.Eventually(t, func() bool { return sched.Live() == 0 }, 5*time.Second, time.Millisecond)

	s2, err := sched.Generate(context.Background(), GenerateRequest{Prompt: make([]int32, 30), MaxTokens: 10}) // 3 more
	require.NoError(t, err)
	// The queue gauge is published after an admission pass: 1 means a
	// pass saw the request and kept it queued.
	queued := sched.m.Queued.WithLabelValues(string(RoleDecode))
	require.Eventually(t, func() bool { return testutil.ToFloat64(queued) == 1 }, 5*time.Second, time.Millisecond,
		"the second request was not kept queued while the quarantined blocks were promised")
	close(src.released)
	_, ev = drainStream(t, s2)
	require.ErrorAs(t, ev.Err, new(quarantineErr), "admitted once the quarantine ended, and fetched: %v", ev.Err)
	require.NotErrorIs(t, ev.Err, kvcache.ErrNoFreeBlocks)
	require.EqualValues(t, 2, src.fetches.Load())
	// Its own quarantine (released already) ends before the scheduler
	// stops: a stop leaves quarantined memory where it is.
	require.Eventually(t, func() bool { return ranks[0].mgr.Stats() == idle }, 5*time.Second, time.Millisecond)
}

// A fetch that fails with its destination quarantined leaves the row and
// blocks allocated, out of the pools, until the quarantine ends.
func TestSchedulerKeepsQuarantinedDestination(t *testing.T) {
	ranks := newRanks(t, rankOpts{ranks: 1, batch: 2})
	src := &quarantineSource{released: make(chan struct{})}
	sched := newScheduler(t, Config{Source: src}, ranks)
	before := ranks[0].mgr.Stats()
	s, err := sched.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("quarantined"), MaxTokens: 2})
	require.NoError(t, err)
	_, ev := drainStream(t, s)
	require.Error(t, ev.Err)
	require.Eventually(t, func() bool { return sched.Live() == 0 }, 5*time.Second, time.Millisecond)
	time.Sleep(20 * time.Millisecond)
	held := ranks[0].mgr.Stats()
	require.Equal(t, before.RowsFree-1, held.RowsFree, "the quarantined row went back to the pool")
	require.Less(t, held.BlocksFree, before.BlocksFree, "the quarantined blocks went back to the pool")
	close(src.released)
	require.Eventually(t, func() bool {
		now := ranks[0].mgr.Stats()
		return now.RowsFree == before.RowsFree && now.BlocksFree == before.BlocksFree
	}, 5*time.Second, time.Millisecond, "the destination was not freed once the quarantine ended")
}
