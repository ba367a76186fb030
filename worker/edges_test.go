package worker

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

// Issue 19 finding 2: a request still waiting for its cache when the scheduler
// stops fails with ErrClosed (503 unavailable at the API), counted failed,
// like a request stopped in any other phase; it used to end with a plain
// context.Canceled, counted cancelled (and answered 500).
func TestStopFailsAwaitCacheWithErrClosed(t *testing.T) {
	pre := newScheduler(t, Config{Role: RolePrefill}, newRanks(t, rankOpts{ranks: 1, batch: 1}))
	dranks := newRanks(t, rankOpts{ranks: 1, batch: 2})
	src := &gateSource{pre: pre, dst: dranks, gate: make(chan struct{}), started: make(chan uint64, 1)}
	sched, err := NewScheduler(Config{Role: RoleDecode, Source: src}, dranks)
	require.NoError(t, err)
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sched.Run(ctx) }()

	sa, err := sched.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("awaiting its cache"), MaxTokens: 4})
	require.NoError(t, err)
	<-src.started
	stop()
	require.NoError(t, <-done)
	_, ev := drainStream(t, sa)
	require.ErrorIs(t, ev.Err, ErrClosed)
	require.Equal(t, 1.0, counterValue(t, sched.m.Requests.WithLabelValues("decode", ResultFailed)))
	require.Equal(t, 0.0, counterValue(t, sched.m.Requests.WithLabelValues("decode", ResultCancelled)))
	require.Equal(t, 2, dranks[0].mgr.Stats().RowsFree, "the row came back")
}

// Issue 19 finding 3: a refused request allocates nothing sized by its
// max_tokens (it used to allocate a channel of max_tokens+1 events, about
// 100 bytes a token, before the queue bound was checked).
func TestRefusedRequestAllocatesLittle(t *testing.T) {
	sched, err := NewScheduler(Config{Role: RoleDecode, QueueSize: 1}, newRanks(t, rankOpts{ranks: 1, batch: 1}))
	require.NoError(t, err) // not running: the first request stays queued
	maxTokens := sched.MaxContext() - 1
	req := GenerateRequest{Prompt: []int32{1}, MaxTokens: maxTokens}
	_, err = sched.Generate(context.Background(), req)
	require.NoError(t, err)
	const n = 200
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range n {
		_, err := sched.Generate(context.Background(), req)
		require.ErrorIs(t, err, ErrQueueFull)
	}
	runtime.ReadMemStats(&after)
	perRequest := (after.TotalAlloc - before.TotalAlloc) / n
	t.Logf("max_tokens %d: %d bytes allocated per refused request", maxTokens, perRequest)
	require.Less(t, perRequest, uint64(4096))
}

func TestStopper(t *testing.T) {
	tests := []struct {
		name   string
		stops  []string
		tokens []string // one event each
		want   []string // the texts emitted, in order
		match  bool
	}{
		{"no stops", nil, []string{"a", "b"}, []string{"a", "b"}, false},
		{"match across tokens", []string{"cd"}, []string{"a", "b", "c", "d", "e"}, []string{"a", "b"}, true},
		{"partial then miss", []string{"cd"}, []string{"a", "c", "x", "y"}, []string{"a", "c", "x", "y"}, false},
		{"held tail flushed", []string{"xyz"}, []string{"a", "x", "y"}, []string{"a", "x", "y"}, false},
		{"match inside a token", []string{"lo w"}, []string{"hel", "lo wor", "ld"}, []string{"hel"}, true},
		{"match mid token keeps its head", []string{"wor"}, []string{"hello ", "big world"}, []string{"hello ", "big "}, true},
		{"earliest of several", []string{"zz", "b"}, []string{"a", "bzz"}, []string{"a"}, true},
		{"overlapping prefix", []string{"aab"}, []string{"a", "a", "a", "b"}, []string{"a"}, true},
		{"whole first token", []string{"ab"}, []string{"ab", "c"}, nil, true},
		{"utf-8 bytes", []string{"é"}, []string{"caf", "\xc3", "\xa9"}, []string{"caf"}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := stopper{stops: tt.stops}
			var out []Output
			match := false
			for i, tok := range tt.tokens {
				out, match = s.push(Output{Token: int32(i), Text: tok}, out)
				if match {
					break
				}
			}
			if !match {
				out = s.flush(out)
			}
			var got []string
			for _, ev := range out {
				got = append(got, ev.Text)
			}
			require.Equal(t, tt.want, got)
			require.Equal(t, tt.match, match)
		})
	}
}

// Generation with a stop sequence taken from the unconstrained output ends
// right before it, with finish "stop", and frees everything.
func TestGenerateStopSequence(t *testing.T) {
	sched := newScheduler(t, Config{}, newRanks(t, rankOpts{ranks: 1, batch: 2}))
	prompt := model.Encode("Hello, handoff")
	run := func(stop []string) (string, Output) {
		s, err := sched.Generate(context.Background(), GenerateRequest{Prompt: prompt, MaxTokens: 40, Stop: stop})
		require.NoError(t, err)
		var text strings.Builder
		for {
			ev, err := s.Next(context.Background())
			require.NoError(t, err)
			if ev.Done {
				return text.String(), ev
			}
			text.WriteString(ev.Text)
		}
	}
	full, ev := run(nil)
	require.Equal(t, "length", ev.Finish)
	require.Equal(t, 40, ev.Tokens)
	stop := full[20:23]
	at := strings.Index(full, stop)
	got, ev := run([]string{stop, "never in the text \x00"})
	require.Equal(t, full[:at], got)
	require.Equal(t, "stop", ev.Finish)
	require.GreaterOrEqual(t, ev.Tokens, at+len(stop), "tokens generated include the matched ones")
	require.Less(t, ev.Tokens, 40, "generation ended at the match")
	require.Eventually(t, func() bool { return sched.Live() == 0 }, 5*time.Second, time.Millisecond)
}

// Logprobs ride on every token, and the remote path (the first token's
// logprobs computed on the prefill scheduler) gives what local gives.
func TestGenerateLogprobsRemoteEqualsLocal(t *testing.T) {
	pre := newScheduler(t, Config{Role: RolePrefill}, newRanks(t, rankOpts{ranks: 1, batch: 1}))
	dranks := newRanks(t, rankOpts{ranks: 1, batch: 1})
	remote := newScheduler(t, Config{Source: &gateSource{pre: pre, dst: dranks}}, dranks)
	local := newScheduler(t, Config{}, newRanks(t, rankOpts{ranks: 1, batch: 1}))
	smp := Sampling{Temperature: 0.9, TopP: 0.8, Seed: 5, Logprobs: true, TopLogprobs: 3}
	collect := func(sched *Scheduler) []Output {
		s, err := sched.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("logprobs"), MaxTokens: 12, Sampling: smp})
		require.NoError(t, err)
		var evs []Output
		for {
			ev, err := s.Next(context.Background())
			require.NoError(t, err)
			if ev.Done {
				require.NoError(t, ev.Err)
				return evs
			}
			evs = append(evs, ev)
		}
	}
	r, l := collect(remote), collect(local)
	require.Len(t, l, 12)
	require.Equal(t, len(l), len(r))
	for i := range l {
		require.NotNil(t, l[i].Logprobs, "token %d", i)
		require.Equal(t, l[i].Token, l[i].Logprobs.Chosen.Token)
		require.Len(t, l[i].Logprobs.Top, 3)
		require.LessOrEqual(t, l[i].Logprobs.Chosen.Logprob, float32(0))
		require.Equal(t, l[i].Token, r[i].Token, "token %d", i)
		require.Equal(t, *l[i].Logprobs, *r[i].Logprobs, "token %d", i)
	}
}
