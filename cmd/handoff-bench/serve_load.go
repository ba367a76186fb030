package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/handoff-io/handoff/cmd/handoff-bench/internal/serving"
)

// loadRun is what runLoad measured.
type loadRun struct {
	results  []serving.Result // the requests sent, in the order sent
	notSent  int              // requests never sent because ctx ended
	duration time.Duration    // the first dispatch to the last completion
	partial  bool             // ctx ended before every request finished
}

// runLoad sends reqs[i] at arrivals[i] after its start, at most maxConc at
// once (0: no limit), and waits for every request it sent. Requests take the
// concurrency slots in the order they arrive, as vLLM's do; the wait from a
// request's arrival to its POST is its QueueTime. When ctx ends runLoad sends
// no more (a request still waiting for its arrival or a slot is not sent),
// and the requests in flight are cancelled (marked so); it returns once they
// have all returned. prog, if not nil, hears of each finished request.
func runLoad(ctx context.Context, c *serveClient, model, idPrefix string, reqs []serving.Request,
	arrivals []time.Duration, maxConc int, prog *progress) loadRun {
	results := make([]serving.Result, len(reqs))
	var sem chan struct{}
	if maxConc > 0 {
		sem = make(chan struct{}, maxConc)
	}
	runID := fmt.Sprintf("%s-%d", idPrefix, time.Now().UnixNano())
	var wg sync.WaitGroup
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	start := time.Now()
	sent := 0
dispatch:
	for i, in := range reqs {
		due := start.Add(arrivals[i])
		if wait := time.Until(due); wait > 0 {
			timer.Reset(wait)
			select {
			case <-ctx.Done():
				break dispatch
			case <-timer.C:
			}
		}
		if sem != nil {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				break dispatch
			}
		}
		if ctx.Err() != nil {
			break
		}
		sent++
		wg.Go(func() {
			if sem != nil {
				defer func() { <-sem }()
			}
			r := c.complete(ctx, model, start, in, fmt.Sprintf("%s-%d", runID, i))
			r.QueueTime = start.Add(r.Start).Sub(due)
			results[i] = r
			prog.add(r)
		})
	}
	wg.Wait()
	return loadRun{results: results[:sent], notSent: len(reqs) - sent, duration: time.Since(start),
		partial: ctx.Err() != nil}
}

// progress shows a run's progress on stderr: a bar redrawn in place on a
// terminal, a line per tenth of the requests otherwise. A nil *progress
// shows nothing. Its methods may be called from any goroutine.
type progress struct {
	mu       sync.Mutex
	w        io.Writer
	bar      bool
	label    string
	total    int
	done     int
	failed   int
	start    time.Time
	lastDraw time.Time
	tenth    int // the last tenth reported in lines mode
}

// newProgress returns nil for mode "none".
func newProgress(w io.Writer, mode string, tty bool, label string, total int) *progress {
	if mode == "none" {
		return nil
	}
	return &progress{w: w, bar: mode == "bar" || (mode == "auto" && tty), label: label, total: total,
		start: time.Now()}
}

func (p *progress) add(r serving.Result) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done++
	if !r.Success && !r.Cancelled {
		p.failed++
	}
	now := time.Now()
	switch {
	case p.bar:
		if now.Sub(p.lastDraw) >= 100*time.Millisecond || p.done == p.total {
			p.lastDraw = now
			p.draw(now)
		}
	case p.done*10/p.total > p.tenth:
		p.tenth = p.done * 10 / p.total
		fmt.Fprintf(p.w, "%s: %d/%d done, %d failed, %.1f s\n", p.label, p.done, p.total, p.failed,
			now.Sub(p.start).Seconds())
	}
}

func (p *progress) draw(now time.Time) {
	const width = 30
	filled := width * p.done / p.total
	el := now.Sub(p.start).Seconds()
	rate := 0.0
	if el > 0 {
		rate = float64(p.done) / el
	}
	fmt.Fprintf(p.w, "\r\x1b[K%s [%s%s] %d/%d %3d%% %.1f req/s %.0fs failed %d", p.label,
		strings.Repeat("=", filled), strings.Repeat(" ", width-filled), p.done, p.total,
		100*p.done/p.total, rate, el, p.failed)
}

// finish ends the bar's line.
func (p *progress) finish() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.bar {
		p.draw(time.Now())
		fmt.Fprintln(p.w)
	}
}

// isTerminal reports whether w is a character device (a terminal).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
