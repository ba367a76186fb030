//go:build integration

package integration

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// burstClients is the burst: a thousand clients at once on one
// decode worker.
const burstClients = 1000

// burstClient is one client of a burst: its own http.Client and connection
// (keep-alive), retrying 429 and 503 after the Retry-After the server gave,
// with jitter, up to maxAttempts.
type burstClient struct {
	http        *http.Client
	api         string
	body        []byte
	maxAttempts int
	rng         *rand.Rand
}

// burstResult is what one client saw.
type burstResult struct {
	status   int           // the last answer's status (0: a transport error)
	err      string        // the transport error or unexpected answer, if any
	attempts int           // requests sent
	refusals int           // 429 and 503 answers
	refused5 int           // of which 503
	badRA    []string      // Retry-After values of refusals that were not 1..60 whole seconds
	maxRA    time.Duration // the longest valid Retry-After seen
	latency  time.Duration // from the first attempt to the 200
}

func newBurstClient(api, model string, i, maxTokens, maxAttempts int) *burstClient {
	return &burstClient{
		http: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}, Timeout: 2 * time.Minute},
		api:  api,
		body: fmt.Appendf(nil, `{"model":%q,"prompt":"client %d says hello","max_tokens":%d,"temperature":0}`,
			model, i, maxTokens),
		maxAttempts: maxAttempts,
		rng:         rand.New(rand.NewPCG(uint64(i), 14)),
	}
}

// retryAfter parses a refusal's Retry-After: whole seconds, 1..60.
func retryAfter(v string) (time.Duration, bool) {
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > 60 {
		return 0, false
	}
	return time.Duration(n) * time.Second, true
}

// run sends the client's completion until it gets a 200, a status that is
// not worth retrying, or it ran out of attempts or ctx.
func (c *burstClient) run(ctx context.Context) burstResult {
	var r burstResult
	start := time.Now()
	for r.attempts < c.maxAttempts && ctx.Err() == nil {
		r.attempts++
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.api+"/v1/completions", bytes.NewReader(c.body))
		if err != nil {
			r.err = err.Error()
			return r
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := c.http.Do(req)
		if err != nil {
			r.status, r.err = 0, err.Error()
			return r
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		r.status = resp.StatusCode
		switch resp.StatusCode {
		case http.StatusOK:
			r.latency, r.err = time.Since(start), ""
			return r
		case http.StatusTooManyRequests, http.StatusServiceUnavailable:
			r.refusals++
			if resp.StatusCode == http.StatusServiceUnavailable {
				r.refused5++
			}
			ra := resp.Header.Get("Retry-After")
			wait, ok := retryAfter(ra)
			if !ok {
				r.badRA = append(r.badRA, ra)
				wait = time.Second
			}
			r.maxRA = max(r.maxRA, wait)
			r.err = fmt.Sprintf("%d: %s", resp.StatusCode, body)
			// Jitter: come back within [wait, 1.5·wait), so that the
			// refused do not all return in the same instant.
			wait += time.Duration(c.rng.Int64N(int64(wait / 2)))
			select {
			case <-time.After(wait):
			case <-ctx.Done():
			}
		default:
			r.err = fmt.Sprintf("%d: %s", resp.StatusCode, body)
			return r
		}
	}
	return r
}

// vmHWM is a process's peak resident set (VmHWM in /proc/<pid>/status), in
// bytes; 0 where /proc does not say.
func vmHWM(pid int) int64 { return procStatusKiB(pid, "VmHWM:") << 10 }

// vmRSS is a process's resident set now, in bytes.
func vmRSS(pid int) int64 { return procStatusKiB(pid, "VmRSS:") << 10 }

func procStatusKiB(pid int, key string) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), key); ok {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return n
		}
	}
	return 0
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[min(len(sorted)-1, int(p*float64(len(sorted))))]
}

// TestBurst sends a thousand concurrent clients at one decode --standalone
// worker (issue 14). With default flags the queue absorbs the whole burst:
// nobody is refused. With the old 64-place queue most are refused at once;
// every refusal is a 429 (or 503) whose Retry-After is whole seconds in
// 1..60, and clients that honour it, with jitter, are all served. On a
// slower model the queue's expected wait, hence Retry-After, is longer than
// a second. Every client gets its 200, and the run's p50/p99 latency (first
// attempt to 200) and the worker's peak RSS are logged.
func TestBurst(t *testing.T) {
	for _, tc := range []struct {
		name        string
		clients     int
		args        []string
		wantRefused bool          // false: no client may be refused
		wantRA      time.Duration // the longest Retry-After must reach this
	}{
		{"default flags", burstClients, nil, false, 0},
		{"queue 64", burstClients, []string{"--queue-size", "64"}, true, time.Second},
		// 10 ms a generated token: about 40 ms a request (4 tokens), so a
		// full 64-place queue waits about 2.6 s.
		{"slow model queue 64", 150, []string{"--queue-size", "64", "--model", "tiny-hybrid?decode_delay=10ms"}, true, 2 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// The harness logs at debug; a user's worker logs at info.
			p := startProc(t, "decode", append([]string{"--standalone", "--log-level", "info"}, tc.args...)...)
			p.waitReady(readyWithin)
			pid := p.cmd.Process.Pid
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			model := modelName(t, p.api)
			warmUp(ctx, t, p.api, model)
			rssBefore := vmRSS(pid)

			clients := make([]*burstClient, tc.clients)
			for i := range clients {
				clients[i] = newBurstClient(p.api, model, i, 4, 40)
			}
			results := make([]burstResult, len(clients))
			start := make(chan struct{})
			var wg sync.WaitGroup
			for i, c := range clients {
				wg.Go(func() {
					<-start
					results[i] = c.run(ctx)
				})
			}
			began := time.Now()
			close(start)
			wg.Wait()
			took := time.Since(began)
			for _, c := range clients {
				c.http.CloseIdleConnections()
			}
			peak := vmHWM(pid)

			var lat []time.Duration
			refusals, refused5, refused, attempts, mostAttempts := 0, 0, 0, 0, 0
			var maxRA time.Duration
			var failures, bad []string
			for i, r := range results {
				attempts += r.attempts
				mostAttempts = max(mostAttempts, r.attempts)
				maxRA = max(maxRA, r.maxRA)
				refusals += r.refusals
				refused5 += r.refused5
				if r.refusals > 0 {
					refused++
				}
				bad = append(bad, r.badRA...)
				if r.status != http.StatusOK {
					failures = append(failures, fmt.Sprintf("client %d after %d attempts: %s", i, r.attempts, r.err))
					continue
				}
				lat = append(lat, r.latency)
			}
			slices.Sort(lat)
			t.Logf("%d clients in %v: %d served, %d refusals (%d clients refused at least once, longest Retry-After %v), "+
				"%d requests (at most %d by one client); latency p50 %v p99 %v max %v; decode RSS %.1f MiB before, peak (VmHWM) %.1f MiB",
				len(clients), took.Round(time.Millisecond), len(lat), refusals, refused, maxRA, attempts, mostAttempts,
				percentile(lat, 0.5).Round(time.Millisecond), percentile(lat, 0.99).Round(time.Millisecond),
				percentile(lat, 1).Round(time.Millisecond), float64(rssBefore)/(1<<20), float64(peak)/(1<<20))
			require.Empty(t, bad, "refusals without a Retry-After of 1..60 whole seconds")
			require.Zero(t, refused5, "503s from a worker that is not draining: every refusal must be a 429")
			require.Empty(t, failures[:min(len(failures), 10)], "%d clients not served", len(failures))
			if tc.wantRefused {
				require.Positive(t, refusals, "the burst was meant to overflow the queue")
				require.GreaterOrEqual(t, maxRA, tc.wantRA, "Retry-After does not follow the queue's expected wait")
			} else {
				require.Zero(t, refusals, "the default queue did not absorb the burst")
			}
			requireIdle(t, p, "decode")
		})
	}
}
