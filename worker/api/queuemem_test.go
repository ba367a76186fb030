package api

import (
	"context"
	"fmt"
	"net"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/worker"
)

// blockedSource holds every fetch until its context ends: the rows stay
// taken, so every later request waits in the queue.
type blockedSource struct{}

func (blockedSource) Fetch(ctx context.Context, _ worker.FetchRequest) (worker.FetchResult, error) {
	<-ctx.Done()
	return worker.FetchResult{}, context.Cause(ctx)
}

// queuedRequestBytes measures what one request waiting in the admission
// queue costs the server, everything included: its connection and handler
// goroutine (net/http), its parsed request and token ids, its scheduler record
// and stream. n clients send a completion of prompt bytes over raw
// connections and read nothing; the heap and stacks in use are compared
// before and after, with the scheduler's rows all taken.
func queuedRequestBytes(t *testing.T, n, prompt int) float64 {
	t.Helper()
	exec, err := model.Lookup(model.TinyHybrid)
	require.NoError(t, err)
	cfg, err := worker.PoolConfig(exec.Spec(), worker.PoolParams{MaxBatchSize: 1})
	require.NoError(t, err)
	m, err := hybrid.New(cfg)
	require.NoError(t, err)
	r, err := worker.NewRank(0, m, exec, make([]byte, cfg.KV.ArenaBytes()), make([]byte, cfg.Mamba.ArenaBytes()))
	require.NoError(t, err)
	sched, err := worker.NewScheduler(worker.Config{Role: worker.RoleDecode, QueueSize: n, Source: blockedSource{}},
		[]*worker.Rank{r})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sched.Run(ctx) }()
	srv := httptest.NewServer(New(Config{Model: model.TinyHybrid}, sched))
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
		srv.Close()
		cancel()
		require.NoError(t, <-done)
	}()

	body := fmt.Sprintf(`{"model":"tiny-hybrid","prompt":%q,"max_tokens":16}`, strings.Repeat("a", prompt))
	req := fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
		len(body), body)
	send := func() {
		c, err := net.Dial("tcp", srv.Listener.Addr().String())
		require.NoError(t, err)
		conns = append(conns, c)
		_, err = c.Write([]byte(req))
		require.NoError(t, err)
	}
	live := func(want int) {
		require.Eventually(t, func() bool { return sched.Live() == want }, 10*time.Second, 5*time.Millisecond)
	}
	send() // takes the one row; its fetch never ends
	live(1)
	before := inUse()
	for range n {
		send()
	}
	live(n + 1)
	after := inUse()
	return float64(after-before) / float64(n)
}

// inUse is the heap and goroutine stacks in use after a collection.
func inUse() int64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapInuse + ms.StackInuse)
}

// A queued request costs the server a bounded, small amount of memory, so
// --queue-size can absorb a burst: the figure behind its default (README,
// --help). Client connections here are raw sockets (a few hundred bytes
// each), so the figure is the server's.
func TestQueuedRequestMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("measures memory; not in -short")
	}
	const n = 256
	// A first run pays one-time costs (span classes, pools, the runtime's
	// and net/http's first allocations) that are no request's.
	queuedRequestBytes(t, 32, 64)
	for _, tc := range []struct {
		prompt int
		limit  float64
	}{
		{64, 48 << 10},   // a chat-sized prompt
		{4000, 96 << 10}, // tiny-hybrid's whole context (4096 tokens)
	} {
		per := queuedRequestBytes(t, n, tc.prompt)
		t.Logf("prompt %d bytes: %.1f KiB per queued request (%d queued)", tc.prompt, per/1024, n)
		require.Less(t, per, tc.limit, "a queued request of a %d-byte prompt holds more than it should", tc.prompt)
	}
}
