package worker

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

// holdSource holds every fetch until the test releases it, then refuses it:
// the request ends and frees its row, so the next one is admitted.
type holdSource struct{ release chan struct{} }

func (h *holdSource) Fetch(ctx context.Context, _ FetchRequest) (FetchResult, error) {
	select {
	case <-h.release:
		return FetchResult{}, ErrTransferRefused
	case <-ctx.Done():
		return FetchResult{}, context.Cause(ctx)
	}
}

// QueueWait is the requests queued (plus the one asking) times the interval
// between admissions while requests waited, and follows a change of rate.
func TestQueueWaitFollowsAdmissionRate(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := &holdSource{release: make(chan struct{})}
		sched, err := NewScheduler(Config{Role: RoleDecode, Source: src, QueueSize: 64},
			newRanks(t, rankOpts{ranks: 1, batch: 1}))
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- sched.Run(ctx) }()
		defer func() {
			cancel()
			require.NoError(t, <-done)
		}()

		require.Zero(t, sched.QueueWait(), "no request has waited yet: no estimate")
		reqCtx, cancelReqs := context.WithCancel(context.Background())
		for range 40 {
			_, err := sched.Generate(reqCtx, GenerateRequest{Prompt: model.Encode("wait"), MaxTokens: 1})
			require.NoError(t, err)
		}
		synctest.Wait() // one admitted (its fetch held), 39 queued
		require.Zero(t, sched.QueueWait(), "no admission has followed a wait yet")

		// One admission every 2 s: the estimate is exactly that per request ahead.
		release := func(every time.Duration, n int) {
			for range n {
				time.Sleep(every)
				src.release <- struct{}{}
				synctest.Wait()
			}
		}
		release(2*time.Second, 3)
		require.Equal(t, 36, queued(sched))
		require.Equal(t, 36.0, gaugeValue(t, sched.m.Queued.WithLabelValues(string(RoleDecode))), "handoff_queued_requests")
		require.Equal(t, 37*2*time.Second, sched.QueueWait())

		// Admissions four times as fast: the estimate comes down towards it.
		release(500*time.Millisecond, 30)
		require.Equal(t, 6, queued(sched))
		wait := sched.QueueWait()
		require.Less(t, wait, 7*2*time.Second/2, "the estimate did not follow the faster rate")
		require.Greater(t, wait, 7*500*time.Millisecond)

		// Every client leaves; the worker idles for ten minutes; a new
		// request is admitted at once and one more waits 500 ms. The idle
		// time is no sample: the estimate stays what admissions showed.
		cancelReqs()
		synctest.Wait()
		require.Zero(t, sched.Live())
		time.Sleep(10 * time.Minute)
		for range 2 {
			_, err := sched.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("back"), MaxTokens: 1})
			require.NoError(t, err)
		}
		synctest.Wait()
		release(500*time.Millisecond, 1)
		require.Less(t, sched.QueueWait(), wait/7+time.Second/10, "idle time was taken for a slow admission")
		release(0, 1)
	})
}

func queued(sched *Scheduler) int {
	sched.mu.Lock()
	defer sched.mu.Unlock()
	return len(sched.queue)
}
