package worker

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
)

func specScheduler(t *testing.T, o rankOpts, method string) *Scheduler {
	t.Helper()
	sched, err := mambacache.ParseDraftSchedule(o.sched)
	require.NoError(t, err)
	return newScheduler(t, Config{AttentionDP: o.adp,
		Speculation: Speculation{Method: method, Tokens: o.draft, Schedule: sched}}, newRanks(t, o))
}

// randomPrompts returns n prompts of printable text, some repetitive (the
// drafter's good case), some not.
func randomPrompts(seed uint64, n int) [][]int32 {
	rng := rand.New(rand.NewPCG(seed, 1))
	out := make([][]int32, n)
	for i := range out {
		var b []byte
		switch i % 3 {
		case 0:
			for range 5 + rng.IntN(30) {
				b = append(b, byte(' '+rng.IntN(95)))
			}
		case 1:
			word := fmt.Sprintf("w%d ", rng.IntN(100))
			for range 2 + rng.IntN(6) {
				b = append(b, word...)
			}
		default:
			b = fmt.Appendf(b, "%s, %s.", testPrompts[rng.IntN(len(testPrompts))], testPrompts[rng.IntN(len(testPrompts))])
		}
		out[i] = model.Encode(string(b))
	}
	return out
}

// TestSpeculationMatchesReference is the oracle: with speculative decoding
// (the n-gram drafter) every request's tokens equal those of plain decoding
// on a private pool, token for token, greedy and sampled with a seed, on
// one rank, on attention-DP ranks with max_batch_size 1 (the seed's
// scenario, now with drafts), and with a draft-length schedule that
// reaches three lengths as the batch changes; drafts are proposed and
// accepted, and the pools end where they started (startScheduler). Both
// drafters: the n-gram one, and the model's draft head (MTP) on
// tiny-hybrid with its head, whose tokens are plain tiny-hybrid's.
func TestSpeculationMatchesReference(t *testing.T) {
	for _, method := range []string{SpecNgram, SpecMTP} {
		t.Run(method, func(t *testing.T) { testSpeculationMatchesReference(t, method) })
	}
}

func testSpeculationMatchesReference(t *testing.T, method string) {
	cases := []struct {
		name string
		o    rankOpts
	}{
		{"one rank K=4", rankOpts{ranks: 1, batch: 2, draft: 4}},
		{"adp mbs 1", rankOpts{ranks: 2, batch: 1, adp: true, draft: 3}},
		{"adp schedule of three lengths", rankOpts{ranks: 2, batch: 4, adp: true, draft: 4, sched: "1:4,2:2,4:1"}},
		{"adp schedule down to 0", rankOpts{ranks: 2, batch: 4, adp: true, draft: 4, sched: "1:4,2:2,3:0"}},
	}
	prompts := randomPrompts(3, 6)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if method == SpecMTP {
				tc.o.model = model.TinyHybrid + "?mtp=1"
			}
			sched := specScheduler(t, tc.o, method)
			type job struct {
				prompt []int32
				temp   float64
				seed   uint64
				max    int
				stream *Stream
			}
			var jobs []*job
			for i, p := range prompts {
				for _, temp := range []float64{0, 0.7} {
					// Lengths differ, so the batch shrinks as requests end
					// and a schedule moves through its lengths.
					j := &job{prompt: p, temp: temp, seed: uint64(i + 11), max: 6 + 5*(len(jobs)%6)}
					s, err := sched.Generate(context.Background(), GenerateRequest{
						Prompt: p, MaxTokens: j.max, Sampling: Sampling{Temperature: temp, Seed: j.seed},
					})
					require.NoError(t, err)
					j.stream = s
					jobs = append(jobs, j)
				}
			}
			for i, j := range jobs {
				toks, ev := drainStream(t, j.stream)
				require.NoError(t, ev.Err)
				require.Equal(t, reference(t, model.TinyHybrid, j.prompt, j.max, j.temp, j.seed), toks,
					"job %d temp %v", i, j.temp)
			}
			m := sched.m
			drafted := counterValue(t, m.SpecDraftTokens.WithLabelValues("decode", method))
			accepted := counterValue(t, m.SpecAcceptedTokens.WithLabelValues("decode", method))
			require.Positive(t, drafted, "the drafter proposed")
			require.Positive(t, accepted, "tiny-hybrid's repetitive output is drafted right sometimes")
			require.Less(t, accepted, drafted, "and wrong sometimes: the rollback was exercised")
			require.Positive(t, counterValue(t, m.SpecVerifications.WithLabelValues("decode", method)))
			if tc.o.adp && tc.o.sched == "" {
				// Every step drafts K, so an idle rank pads with the
				// dummy of length K, on that length's padding row.
				require.Positive(t, counterValue(t, m.PaddingDummies.WithLabelValues("decode", fmt.Sprint(tc.o.draft))))
			}
			if tc.o.sched == "1:4,2:2,3:0" {
				require.Positive(t, counterValue(t, m.PaddingDummies.WithLabelValues("decode", "0")), "batches of 3+ pad at length 0")
			}
			require.Zero(t, testutil.CollectAndCount(m.PaddingFailures), "a step's padding dummy found no row of its draft length")
		})
	}
}

// TestSpeculationOffIsUnchanged: a scheduler without speculation drafts
// nothing and its requests run one token per step as before.
func TestSpeculationOffIsUnchanged(t *testing.T) {
	sched := newScheduler(t, Config{}, newRanks(t, rankOpts{ranks: 1, batch: 1}))
	p := model.Encode("Hello, world")
	got, _ := generate(t, sched, p)
	require.Equal(t, reference(t, model.TinyHybrid, p, 12, 0, 0), got)
	require.Zero(t, counterValue(t, sched.m.SpecVerifications.WithLabelValues("decode", SpecNgram)))
}

// fixedDrafter proposes the same tokens whatever the context.
type fixedDrafter struct{ toks []int32 }

func (d fixedDrafter) Draft(dst, _ []int32, k int) []int32 {
	return append(dst, d.toks[:min(k, len(d.toks))]...)
}

// TestSpeculationRejectedDraftsLeaveNoState: a drafter whose drafts are
// always wrong makes every verification advance the row K+1 times and
// accept none; the row must then hold the state after the one token the
// request consumed, or the next step reads a state that ran ahead (the
// stale-state class of vllm#52942) and the output differs from the
// reference.
func TestSpeculationRejectedDraftsLeaveNoState(t *testing.T) {
	for _, k := range []int{1, 4} {
		t.Run(fmt.Sprint("K=", k), func(t *testing.T) {
			ranks := newRanks(t, rankOpts{ranks: 1, batch: 1, draft: k})
			sched := newScheduler(t, Config{Speculation: Speculation{Method: SpecNgram, Tokens: k,
				Drafter: fixedDrafter{toks: []int32{'\x7f', '\x7f', '\x7f', '\x7f'}}}}, ranks) // DEL: tiny-hybrid never emits it
			p := model.Encode("The quick brown fox jumps over the lazy dog.")
			got, _ := generate(t, sched, p)
			require.Equal(t, reference(t, model.TinyHybrid, p, 12, 0, 0), got)
			m := sched.m
			require.Positive(t, counterValue(t, m.SpecDraftTokens.WithLabelValues("decode", SpecNgram)))
			require.Zero(t, counterValue(t, m.SpecAcceptedTokens.WithLabelValues("decode", SpecNgram)))
		})
	}
}

func TestSpeculationConfigRefused(t *testing.T) {
	sched := func(s string) mambacache.DraftSchedule {
		d, err := mambacache.ParseDraftSchedule(s)
		require.NoError(t, err)
		return d
	}
	cases := []struct {
		name string
		o    rankOpts
		spec Speculation
		want string
	}{
		{"mtp", rankOpts{draft: 2}, Speculation{Method: SpecMTP, Tokens: 2}, `method "mtp": model tiny-hybrid has no draft head`},
		{"unknown", rankOpts{draft: 2}, Speculation{Method: "eagle", Tokens: 2}, `method "eagle"`},
		{"zero tokens", rankOpts{draft: 2}, Speculation{Method: SpecNgram}, "0 speculative tokens"},
		{"pool without speculation", rankOpts{}, Speculation{Method: SpecNgram, Tokens: 2}, "built for 0 draft tokens"},
		{"pool for another schedule", rankOpts{draft: 2, sched: "1:2"}, Speculation{Method: SpecNgram, Tokens: 2, Schedule: sched("1:1")}, "built for 2 draft tokens"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.o.ranks, tc.o.batch = 1, 2
			_, err := NewScheduler(Config{Role: RoleDecode, Speculation: tc.spec}, newRanks(t, tc.o))
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// draftSource is a gateSource whose results carry the given drafts
// instead of the prefill worker's (nil: the prefill worker's).
type draftSource struct {
	gateSource
	drafts []int32
	asked  chan int
}

func (d *draftSource) Fetch(ctx context.Context, f FetchRequest) (FetchResult, error) {
	d.asked <- f.Drafts
	res, err := d.gateSource.Fetch(ctx, f)
	if d.drafts != nil {
		res.Drafts = d.drafts
	}
	return res, err
}

// TestSpeculationShippedDrafts: with a remote prefill the decode worker
// asks for K drafts, the prefill worker drafts them on the prompt and its
// first token, and the first decode step verifies them: the output is the
// reference's whether they are right or wrong, and drafts out of the
// vocabulary, or more than asked for, fail the request.
func TestSpeculationShippedDrafts(t *testing.T) {
	// A prompt after which the prefill worker has drafts to ship: its
	// first token occurred in it before.
	var p, want []int32
	for _, text := range []string{"so so so so so so", "Hello, handoff", "e S unr S unr S", "the the the the", "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ"} {
		p = model.Encode(text)
		want = reference(t, model.TinyHybrid, p, 12, 0, 0)
		if len(model.DefaultNgram.Draft(nil, append(append([]int32(nil), p...), want[0]), 3)) > 0 {
			break
		}
	}
	require.NotEmpty(t, model.DefaultNgram.Draft(nil, append(append([]int32(nil), p...), want[0]), 3), "no prompt drafts")
	for _, tc := range []struct {
		name   string
		drafts []int32
		err    string
	}{
		{"prefill's drafts", nil, ""},
		{"wrong drafts", []int32{'x', 'y', 'z'}, ""},
		{"out of vocabulary", []int32{'a', 300}, "draft token 1 is 300"},
		{"negative", []int32{-1}, "draft token 0 is -1"},
		{"too many", []int32{'a', 'b', 'c', 'd'}, "4 draft tokens shipped, 3 asked for"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pre := newScheduler(t, Config{Role: RolePrefill}, newRanks(t, rankOpts{ranks: 1, batch: 1}))
			dranks := newRanks(t, rankOpts{ranks: 1, batch: 1, draft: 3})
			src := &draftSource{gateSource: gateSource{pre: pre, dst: dranks}, drafts: tc.drafts, asked: make(chan int, 1)}
			dec := newScheduler(t, Config{Source: src, Speculation: Speculation{Method: SpecNgram, Tokens: 3}}, dranks)
			s, err := dec.Generate(context.Background(), GenerateRequest{Prompt: p, MaxTokens: 12})
			require.NoError(t, err)
			toks, ev := drainStream(t, s)
			require.Equal(t, 3, <-src.asked, "decode asks for K drafts")
			shipped := counterValue(t, dec.m.SpecShipped.WithLabelValues("decode", SpecNgram))
			if tc.err != "" {
				require.ErrorIs(t, ev.Err, ErrTransferFailed)
				require.ErrorContains(t, ev.Err, tc.err)
				require.Zero(t, shipped)
				return
			}
			require.NoError(t, ev.Err)
			require.Equal(t, want, toks)
			require.Positive(t, shipped, "the first step verified the shipped drafts")
		})
	}
}

// TestPrefillDrafts: a prefill-only job asked for drafts returns the
// n-gram drafter's over its prompt and first token, at most as many as
// asked, and none when not asked.
func TestPrefillDrafts(t *testing.T) {
	pre := newScheduler(t, Config{Role: RolePrefill}, newRanks(t, rankOpts{ranks: 1, batch: 1}))
	p := model.Encode("abcabcabcab")
	for _, ask := range []int{0, 2, 5} {
		l, err := pre.Prefill(context.Background(), PrefillJob{Prompt: p, Drafts: ask})
		require.NoError(t, err)
		want := model.DefaultNgram.Draft(nil, append(append([]int32(nil), p...), l.First), ask)
		if ask == 0 {
			want = nil
		}
		require.Equal(t, want, l.Drafts, "ask %d", ask)
		require.LessOrEqual(t, len(l.Drafts), ask)
		l.Release()
	}
}

// TestPrefillDraftsWithDraftHead: a prefill worker whose model has a draft
// head ships its drafts: model.Draft on the prompt's cache after the first
// token, the prompt's draft-layer KV in the blocks it hands over.
func TestPrefillDraftsWithDraftHead(t *testing.T) {
	name := model.TinyHybrid + "?mtp=1"
	pre := newScheduler(t, Config{Role: RolePrefill}, newRanks(t, rankOpts{ranks: 1, batch: 1, model: name}))
	e, err := model.Lookup(name)
	require.NoError(t, err)
	p := model.Encode("disaggregated prefill and decode")
	l, err := pre.Prefill(context.Background(), PrefillJob{Prompt: p, Drafts: 4})
	require.NoError(t, err)
	defer l.Release()
	// The reference: the same prompt on a private cache.
	spec := e.Spec()
	kv := spec.KV
	kv.Blocks = 4
	m := spec.Mamba
	m.MaxBatchSize = 1
	c := model.Cache{KVArena: make([]byte, kv.ArenaBytes()), KV: kv, Blocks: []kvcache.BlockID{0, 1, 2, 3},
		MambaArena: make([]byte, m.ArenaBytes()), Mamba: m, Row: 0}
	logits, err := e.Prefill(c, p)
	require.NoError(t, err)
	first := model.Sample(logits, 0, 0, 0)
	require.Equal(t, first, l.First)
	want, err := model.Draft(context.Background(), e, c, first, len(p), 4, nil)
	require.NoError(t, err)
	require.Len(t, l.Drafts, 4)
	require.Equal(t, want, l.Drafts)
}

// TestSpeculationCancelMidVerification: requests cancelled at random
// points, many of them inside a verification (a decode delay makes each
// one last K+1 decodes), leave the pools at their idle counts
// (startScheduler checks at the end), and a request after them still
// matches the reference: no scratch or rolled-back state leaks into the
// next user of a row.
func TestSpeculationCancelMidVerification(t *testing.T) {
	for _, method := range []string{SpecNgram, SpecMTP} {
		t.Run(method, func(t *testing.T) {
			name := model.TinyHybrid + "?decode_delay=2ms"
			if method == SpecMTP {
				name += "&mtp=1"
			}
			o := rankOpts{ranks: 2, batch: 2, adp: true, draft: 4, sched: "1:4,2:2", model: name}
			sched := specScheduler(t, o, method)
			rng := rand.New(rand.NewPCG(7, 7))
			var streams []*Stream
			for i, p := range randomPrompts(9, 10) {
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration(5+rng.IntN(80))*time.Millisecond)
				t.Cleanup(cancel)
				s, err := sched.Generate(ctx, GenerateRequest{Prompt: p, MaxTokens: 40, Sampling: Sampling{Temperature: float64(i%2) * 0.7, Seed: uint64(i)}})
				require.NoError(t, err)
				streams = append(streams, s)
			}
			cancelled := 0
			for _, s := range streams {
				_, ev := drainStream(t, s)
				if ev.Err != nil {
					cancelled++
				}
			}
			require.Positive(t, cancelled, "some requests ended by cancellation")
			p := model.Encode("after the storm")
			got, _ := generate(t, sched, p)
			require.Equal(t, reference(t, model.TinyHybrid, p, 12, 0, 0), got)
		})
	}
}

// TestSpeculationAcceptanceGate: drafts that are never accepted close the
// acceptance-rate gate: steps stop drafting but for a probe per window,
// pad on the zero-length padding row, and the output is still the
// reference's; a gate without its zero-length row is refused.
func TestSpeculationAcceptanceGate(t *testing.T) {
	o := rankOpts{ranks: 2, batch: 1, adp: true, draft: 2, gating: true}
	spec := Speculation{Method: SpecNgram, Tokens: 2, GateWindow: 3, GateThreshold: 0.5,
		Drafter: fixedDrafter{toks: []int32{'\x7f', '\x7f'}}}
	sched := newScheduler(t, Config{AttentionDP: true, Speculation: spec}, newRanks(t, o))
	p := model.Encode("Hello, world")
	s, err := sched.Generate(context.Background(), GenerateRequest{Prompt: p, MaxTokens: 40})
	require.NoError(t, err)
	got, ev := drainStream(t, s)
	require.NoError(t, ev.Err)
	require.Equal(t, reference(t, model.TinyHybrid, p, 40, 0, 0), got)
	m := sched.m
	verifications := counterValue(t, m.SpecVerifications.WithLabelValues("decode", SpecNgram))
	require.GreaterOrEqual(t, verifications, 3.0, "the window filled")
	require.Less(t, verifications, 3+39.0/3+1, "then only probes drafted")
	require.Equal(t, 1.0, gaugeValue(t, m.SpecGated.WithLabelValues("decode")))
	require.Positive(t, counterValue(t, m.PaddingDummies.WithLabelValues("decode", "0")), "gated steps pad on the zero-length row")

	o.gating = false
	_, err = NewScheduler(Config{Role: RoleDecode, AttentionDP: true, Speculation: spec}, newRanks(t, o))
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorContains(t, err, "zero-length padding row")
}

// TestSpeculationWithPrefixCache: multi-turn conversations with the prefix
// cache and speculative decoding give the tokens of plain decoding with
// the cache off. A generation's end checkpoint is taken after a
// verification's rollback, so it must hold the state after exactly the
// tokens the request absorbed (a checkpoint is never a scratch state), or
// the next turn, resumed from it, differs.
func TestSpeculationWithPrefixCache(t *testing.T) {
	off := runCached(t, Config{}, cacheRanks(t, rankOpts{ranks: 1, batch: 2, blocks: 64}, 0))
	want, _ := runScript(t, off, 16)
	mtp := model.TinyHybrid + "?mtp=1"
	for _, tc := range []struct {
		method string
		o      rankOpts
	}{
		{SpecNgram, rankOpts{ranks: 1, batch: 2, draft: 4}},
		{SpecNgram, rankOpts{ranks: 2, batch: 1, adp: true, draft: 3, sched: "1:3"}},
		// The draft head reads its layer's KV of the cached blocks: what
		// the prefix cache shares must be final there too.
		{SpecMTP, rankOpts{ranks: 1, batch: 2, draft: 4, model: mtp}},
		{SpecMTP, rankOpts{ranks: 2, batch: 1, adp: true, draft: 3, sched: "1:3", model: mtp}},
	} {
		o := tc.o
		sched, err := mambacache.ParseDraftSchedule(o.sched)
		require.NoError(t, err)
		on := runCached(t, Config{AttentionDP: o.adp, PrefixCache: true, CheckpointInterval: 16,
			Speculation: Speculation{Method: tc.method, Tokens: o.draft, Schedule: sched}}, cacheRanks(t, o, 16))
		got, outs := runScript(t, on, 16)
		hits := 0
		for _, tr := range convScript {
			require.Equal(t, want[tr.conv], got[tr.conv], "%s: turn %s", tc.method, tr.conv)
			hits += outs[tr.conv].Cached
		}
		require.Positive(t, hits, "the later turns resumed from checkpoints")
		require.Positive(t, counterValue(t, on.m.SpecAcceptedTokens.WithLabelValues("decode", tc.method)))
		require.Less(t, counterValue(t, on.m.SpecAcceptedTokens.WithLabelValues("decode", tc.method)),
			counterValue(t, on.m.SpecDraftTokens.WithLabelValues("decode", tc.method)), "rollbacks happened")
	}
}

// TestSpeculationStopMidVerificationCheckpoint: a stop string that ends a
// request inside a verification (after a rejected draft: fewer positions
// consumed than the step ran), with the prefix cache on: the next turn,
// resumed from the first turn's generation-end checkpoint, gives the
// tokens it gives with the cache and speculation off.
func TestSpeculationStopMidVerificationCheckpoint(t *testing.T) {
	p := model.Encode("e S unr S unr S unr S")
	full := reference(t, model.TinyHybrid, p, 24, 0, 0)
	text := model.Decode(full)
	stop := ""
	for k := 4; k < len(text); k++ { // a character first seen late in the reply
		if !strings.ContainsRune(text[:k], rune(text[k])) {
			stop = text[k : k+1]
			break
		}
	}
	if stop == "" {
		t.Skipf("reply %q repeats every character: no late stop", text)
	}
	turn := func(s *Scheduler, prompt []int32, stops []string) []int32 {
		st, err := s.Generate(context.Background(), GenerateRequest{Prompt: prompt, MaxTokens: 24, Stop: stops})
		require.NoError(t, err)
		toks, ev := drainStream(t, st)
		require.NoError(t, ev.Err)
		return toks
	}
	run := func(s *Scheduler) (first, second []int32) {
		first = turn(s, p, []string{stop})
		second = turn(s, slices.Concat(p, first, model.Encode("\nQ? 7")), nil)
		return first, second
	}
	off := runCached(t, Config{}, cacheRanks(t, rankOpts{ranks: 1, batch: 1, blocks: 64}, 0))
	wantFirst, wantSecond := run(off)
	require.Less(t, len(wantFirst), 20, "the stop ended the first turn early")
	on := runCached(t, Config{PrefixCache: true, Speculation: Speculation{Method: SpecNgram, Tokens: 4}},
		cacheRanks(t, rankOpts{ranks: 1, batch: 1, draft: 4}, 8))
	first, second := run(on)
	require.Equal(t, wantFirst, first)
	require.Equal(t, wantSecond, second)
	require.Positive(t, counterValue(t, on.m.PrefixHitTokens.WithLabelValues("decode", "0")), "the second turn resumed from the first's checkpoint")
}

// TestSpeculationCheckpointIsExact: the generation-end checkpoint of a
// request that a stop string ended inside a verification (after a
// rejected draft) holds, byte for byte, the state the same generation
// leaves without speculation: the rolled-back row, never a state that ran
// ahead into the rejected draft. (The next turn's text is too coarse an
// oracle here: one extra token in the state may not change an argmax.)
func TestSpeculationCheckpointIsExact(t *testing.T) {
	p := model.Encode("e S unr S unr S unr S")
	text := model.Decode(reference(t, model.TinyHybrid, p, 24, 0, 0))
	stop := ""
	for k := 4; k < len(text); k++ {
		if !strings.ContainsRune(text[:k], rune(text[k])) {
			stop = text[k : k+1]
			break
		}
	}
	if stop == "" {
		t.Skipf("reply %q repeats every character: no late stop", text)
	}
	checkpoint := func(spec Speculation, o rankOpts) []byte {
		ranks := cacheRanks(t, o, 8)
		s := runCached(t, Config{PrefixCache: true, Speculation: spec}, ranks)
		st, err := s.Generate(context.Background(), GenerateRequest{Prompt: p, MaxTokens: 24, Stop: []string{stop}})
		require.NoError(t, err)
		toks, ev := drainStream(t, st)
		require.NoError(t, ev.Err)
		r := ranks[0]
		probe := &request{prompt: slices.Concat(p, toks, model.Encode("?"))} // a hit leaves one token to compute
		hit := r.mgr.Lookup(probe.cachePrompt(r))
		require.Equal(t, len(p)+len(toks), hit.Tokens, "the generation's end is checkpointed")
		x := r.mCfg.RowExtent(hit.Row)
		return slices.Clone(r.mambaArena[x.Offset:x.End()])
	}
	plain := checkpoint(Speculation{}, rankOpts{ranks: 1, batch: 1, blocks: 64})
	spec := checkpoint(Speculation{Method: SpecNgram, Tokens: 4}, rankOpts{ranks: 1, batch: 1, blocks: 64, draft: 4})
	require.True(t, bytes.Equal(plain, spec), "the speculative run's checkpoint differs from the plain run's")
}
