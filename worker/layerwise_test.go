package worker

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

// Chunked prefill (one chunk per step) generates exactly what one-step
// prefill generates, alone and next to another request.
func TestChunkedPrefillMatchesReference(t *testing.T) {
	prompt := model.Encode("Chunked prefill of a hybrid model, step after step.")
	want := reference(t, model.TinyHybrid, prompt, 12, 0, 0)
	for _, chunk := range []int{1, 7, 16, 1000} {
		sched := newScheduler(t, Config{PrefillChunkTokens: chunk}, newRanks(t, rankOpts{ranks: 2, batch: 2, adp: true}))
		other, err := sched.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("other"), MaxTokens: 30})
		require.NoError(t, err)
		s, err := sched.Generate(context.Background(), GenerateRequest{Prompt: prompt, MaxTokens: 12})
		require.NoError(t, err)
		got, ev := drainStream(t, s)
		require.NoError(t, ev.Err)
		require.Equal(t, want, got, "chunk %d", chunk)
		_, ev = drainStream(t, other)
		require.NoError(t, ev.Err)
	}
	_, err := NewScheduler(Config{Role: RoleDecode, PrefillChunkTokens: -1}, newRanks(t, rankOpts{ranks: 1, batch: 1}))
	require.ErrorIs(t, err, ErrInvalidConfig)
}

// A prefill job's Parts hears of every attention layer's positions once,
// chunk by chunk, and of each Mamba layer once, after the last chunk; the
// lease's cache holds what the parts named when they were reported.
func TestPrefillParts(t *testing.T) {
	prompt := model.Encode("Parts of a cache, reported as compute finishes them.")
	n := len(prompt)
	for _, chunk := range []int{0, 9} {
		ranks := newRanks(t, rankOpts{ranks: 1, batch: 1})
		sched := newScheduler(t, Config{Role: RolePrefill, PrefillChunkTokens: chunk}, ranks)
		spec := ranks[0].exec.Spec()
		var parts []Part
		kv := make([][]int, spec.KV.Layers)
		for l := range kv {
			kv[l] = make([]int, n)
		}
		mamba := make([]int, spec.Mamba.Layers)
		var early []Part // attention parts of an earlier chunk after a Mamba part
		// Parts runs on the scheduler's goroutine: it only records.
		p, err := sched.SubmitPrefill(context.Background(), PrefillJob{Prompt: prompt, Parts: func(p Part) {
			parts = append(parts, p)
			switch p.Kind {
			case '*':
				for pos := p.From; pos < p.To; pos++ {
					kv[p.KVLayer][pos]++
				}
				if mamba[0] > 0 && p.To < n {
					early = append(early, p)
				}
			case 'M':
				mamba[p.MambaLayer]++
			}
		}})
		require.NoError(t, err)
		l, err := p.Wait(context.Background())
		require.NoError(t, err)
		require.Empty(t, early, "a Mamba state was reported before the last chunk ran")
		for layer := range kv {
			for pos, k := range kv[layer] {
				require.Equal(t, 1, k, "chunk %d: kv layer %d position %d", chunk, layer, pos)
			}
		}
		for layer, k := range mamba {
			require.Equal(t, 1, k, "chunk %d: mamba layer %d", chunk, layer)
		}
		for _, p := range parts {
			require.Equal(t, l.Rank, p.Rank)
			require.Equal(t, l.Row, p.Row)
		}
		want := reference(t, model.TinyHybrid, prompt, 1, 0, 0)
		require.Equal(t, want[0], l.First, "chunk %d", chunk)
		l.Release()
	}
}

// A prefill job whose Parts named its blocks and row keeps them until its
// holder lets go (Abandon, or Release of its lease), whatever ended it
// first: Wait's context, the job's own, a failed step. A reader of the parts
// (the layer-wise stream) may still be reading them, and a job admitted in
// their place would overwrite them: the next job waits for its room until
// the holder let go.
func TestAbandonedPrefillKeepsCacheUntilLetGo(t *testing.T) {
	prompt := model.Encode(strings.Repeat("p", 120)) // chunks of 8 tokens, about 2 ms each
	for _, how := range []string{"wait", "job"} {
		t.Run(how, func(t *testing.T) {
			ranks := newRanks(t, rankOpts{ranks: 1, batch: 1, model: model.TinyHybrid + "?prefill_delay=2ms"})
			sched := newScheduler(t, Config{Role: RolePrefill, PrefillChunkTokens: 8}, ranks)
			idle := ranks[0].mgr.Stats()
			first := make(chan struct{})
			var once sync.Once
			jctx, jcancel := context.WithCancel(context.Background())
			defer jcancel()
			p, err := sched.SubmitPrefill(jctx, PrefillJob{Prompt: prompt, Parts: func(Part) { once.Do(func() { close(first) }) }})
			require.NoError(t, err)
			var nextParts atomic.Int64
			next, err := sched.SubmitPrefill(context.Background(), PrefillJob{Prompt: prompt, Parts: func(Part) { nextParts.Add(1) }})
			require.NoError(t, err)
			<-first
			wctx, wcancel := context.WithCancel(context.Background())
			if how == "wait" {
				wcancel()
			} else {
				defer wcancel()
				jcancel()
			}
			_, err = p.Wait(wctx)
			require.ErrorIs(t, err, context.Canceled)
			// The job ended; its row and blocks stay its holder's.
			time.Sleep(50 * time.Millisecond)
			held := ranks[0].mgr.Stats()
			require.Equal(t, idle.RowsFree-1, held.RowsFree, "the abandoned job's row was freed before its holder let go")
			require.Less(t, held.BlocksFree, idle.BlocksFree)
			require.Zero(t, nextParts.Load(), "the next job computed into the abandoned job's cache")
			require.Equal(t, 2, sched.Live())
			p.Abandon()
			l, err := next.Wait(context.Background())
			require.NoError(t, err, "the next job did not run once the holder let go")
			require.Positive(t, nextParts.Load())
			l.Release()
			p.Abandon() // idempotent
			require.Eventually(t, func() bool { return sched.Live() == 0 && ranks[0].mgr.Stats() == idle }, 5*time.Second, time.Millisecond)
		})
	}
}
