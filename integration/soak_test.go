//go:build integration

package integration

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// soakSample is one scrape of the worker's own gauges.
type soakSample struct {
	at         time.Duration
	goroutines float64 // go_goroutines
	rss        float64 // process_resident_memory_bytes
	heap       float64 // go_memstats_heap_inuse_bytes
}

// soakEnv reads a soak setting from the environment.
func soakEnv[T any](t *testing.T, name string, def T, parse func(string) (T, error)) T {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	x, err := parse(v)
	require.NoError(t, err, name)
	return x
}

// TestSoak runs decode --standalone at a steady request rate and checks that
// its memory and goroutines stay flat (issue 14): the resident set and the
// goroutine count of the last third of the run are those of the first third
// (after a warm-up), and once the load stops and the clients hang up the
// goroutines come back to what they were before it. The load mixes plain,
// streamed and chat completions, and streams that the client abandons after
// the first chunk (a cancellation each).
//
// The default run is short (20 s, for the integration suite);
// HANDOFF_SOAK=10m runs the 10-minute soak, HANDOFF_SOAK_RATE sets
// the rate (requests per second, default 40):
//
//	HANDOFF_SOAK=10m go test -tags integration -run TestSoak -timeout 15m -v ./integration
func TestSoak(t *testing.T) {
	duration := soakEnv(t, "HANDOFF_SOAK", 20*time.Second, time.ParseDuration)
	rate := soakEnv(t, "HANDOFF_SOAK_RATE", 40, strconv.Atoi)
	p := startProc(t, "decode", "--standalone", "--log-level", "info") // as a user's; the harness reads info lines
	p.waitReady(readyWithin)
	model := modelName(t, p.api)
	ctx, cancel := context.WithTimeout(context.Background(), duration+2*time.Minute)
	defer cancel()
	warmUp(ctx, t, p.api, model)

	scrape := func(at time.Duration) soakSample {
		mf := p.metrics()
		return soakSample{at: at, goroutines: sum(mf, "go_goroutines", nil),
			rss: sum(mf, "process_resident_memory_bytes", nil), heap: sum(mf, "go_memstats_heap_inuse_bytes", nil)}
	}
	idle := scrape(0)

	// Open loop: a pacer offers one request every 1/rate to a pool of
	// workers; an offer no worker is free to take is counted as missed
	// (the worker is behind), not queued.
	const workers = 32
	jobs := make(chan int)
	var sent, ok, cancelled, missed atomic.Int64
	var failMu sync.Mutex
	var failures []string
	var wg sync.WaitGroup
	clients := make([]*http.Client, workers)
	for w := range workers {
		client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}, Timeout: time.Minute}
		clients[w] = client
		wg.Go(func() {
			for i := range jobs {
				sent.Add(1)
				abandoned, err := soakRequest(ctx, client, p.api, model, w, i)
				switch {
				case err != nil:
					failMu.Lock()
					failures = append(failures, err.Error())
					failMu.Unlock()
				case abandoned:
					cancelled.Add(1)
				default:
					ok.Add(1)
				}
			}
		})
	}

	every := max(time.Second, duration/120)
	var samples []soakSample
	start := time.Now()
	pace := time.NewTicker(time.Second / time.Duration(rate))
	sample := time.NewTicker(every)
	end := time.After(duration)
	i := 0
load:
	for {
		select {
		case <-pace.C:
			select {
			case jobs <- i:
			default:
				missed.Add(1)
			}
			i++
		case <-sample.C:
			samples = append(samples, scrape(time.Since(start)))
		case <-end:
			break load
		}
	}
	pace.Stop()
	sample.Stop()
	close(jobs)
	wg.Wait()
	took := time.Since(start)

	// Flat: compare the medians of the first and last thirds of the run
	// after a warm-up fifth.
	warm := samples[len(samples)/5:]
	require.GreaterOrEqual(t, len(warm), 6, "too few samples")
	third := len(warm) / 3
	first, last := warm[:third], warm[len(warm)-third:]
	median := func(s []soakSample, f func(soakSample) float64) float64 {
		v := make([]float64, len(s))
		for i, x := range s {
			v[i] = f(x)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	rss := func(s soakSample) float64 { return s.rss }
	gor := func(s soakSample) float64 { return s.goroutines }
	heap := func(s soakSample) float64 { return s.heap }
	peakRSS := slices.MaxFunc(samples, func(a, b soakSample) int { return int(a.rss - b.rss) }).rss
	t.Logf("%v at %d req/s offered: %d sent (%d missed offers), %d ok, %d abandoned streams, %d failed; "+
		"%d samples every %v", took.Round(time.Second), rate, sent.Load(), missed.Load(), ok.Load(), cancelled.Load(),
		len(failures), len(samples), every)
	t.Logf("RSS MiB: idle %.1f, first third %.1f, last third %.1f, peak %.1f; heap in use MiB: first %.1f, last %.1f; "+
		"goroutines: idle %.0f, first third %.0f, last third %.0f",
		idle.rss/(1<<20), median(first, rss)/(1<<20), median(last, rss)/(1<<20), peakRSS/(1<<20),
		median(first, heap)/(1<<20), median(last, heap)/(1<<20), idle.goroutines, median(first, gor), median(last, gor))

	require.Empty(t, failures[:min(len(failures), 10)], "%d requests failed", len(failures))
	require.Positive(t, ok.Load())
	// A leak of even 1 KiB a request grows the resident set by tens of MiB
	// over 10 minutes at this rate; the slack covers the GC's pacing.
	require.LessOrEqual(t, median(last, rss), median(first, rss)*1.15+8<<20, "resident memory grew under a steady load")
	require.LessOrEqual(t, median(last, gor), median(first, gor)+workers, "goroutines grew under a steady load")
	// Every client hangs up: the worker is back to its idle goroutines, but
	// for its bounded pools: prefill's dispatch workers exit after 10-20 s
	// idle (transfer.workerIdle), and the tcp data path keeps up to 16 idle
	// connections per peer (rdma maxIdlePerPeer), a goroutine on each side
	// of one in standalone.
	for _, c := range clients {
		c.CloseIdleConnections()
	}
	const pooled = 2 * 16
	var after float64
	back := assert.Eventually(t, func() bool {
		after = scrape(0).goroutines
		return after <= idle.goroutines+pooled+2
	}, 30*time.Second, 200*time.Millisecond)
	t.Logf("goroutines after the load: %v (idle before it: %v)", after, idle.goroutines)
	require.Truef(t, back, "goroutines did not come back to the idle %v (+%d pooled): %v", idle.goroutines, pooled, after)
	requireIdle(t, p, "decode")
}

// soakRequest sends request i of worker w: a plain completion, a streamed
// one read to its end, a chat completion, or (one in ten) a stream abandoned
// after its first chunk. abandoned says it was the last kind.
func soakRequest(ctx context.Context, client *http.Client, api, model string, w, i int) (abandoned bool, err error) {
	path, body := "/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"soak %d/%d","max_tokens":8,"temperature":0`, model, w, i)
	switch i % 10 {
	case 1, 2:
		body += `,"stream":true`
	case 3, 4:
		path = "/v1/chat/completions"
		body = fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"soak %d/%d"}],"max_tokens":8`, model, w, i)
	case 5:
		body = fmt.Sprintf(`{"model":%q,"prompt":"soak %d/%d","max_tokens":200,"stream":true`, model, w, i)
		abandoned = true
	}
	body += "}"
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, api+path, bytes.NewReader([]byte(body)))
	if err != nil {
		return abandoned, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return abandoned, fmt.Errorf("%s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return abandoned, fmt.Errorf("%s: %d %s", path, resp.StatusCode, b)
	}
	if abandoned {
		var first [64]byte
		if _, err := io.ReadAtLeast(resp.Body, first[:], 1); err != nil {
			return abandoned, fmt.Errorf("%s: first chunk: %w", path, err)
		}
		cancel() // hang up mid-stream: the worker cancels the request
		return abandoned, nil
	}
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return abandoned, fmt.Errorf("%s: reading: %w", path, err)
	}
	return abandoned, nil
}
