package worker

import (
	"context"
	"fmt"
	"time"
)

// Drain stops intake (Generate and Prefill return ErrDraining) and waits
// until every accepted request ended, or ctx ends.
func (e *Scheduler) Drain(ctx context.Context) error {
	e.mu.Lock()
	e.draining = true
	e.maybeIdleLocked()
	idle := e.idle
	e.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("worker: drain: %w", ctx.Err())
	}
}

// Draining reports whether Drain was called.
func (e *Scheduler) Draining() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.draining
}

// Live is the number of accepted requests not yet ended.
func (e *Scheduler) Live() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.live
}

func (e *Scheduler) maybeIdleLocked() {
	if e.draining && e.live == 0 && !e.idleShut {
		e.idleShut = true
		close(e.idle)
	}
}

// shutdown fails what is left and waits for fetches and leases, up to
// ReleaseGrace, before freeing their resources anyway.
func (e *Scheduler) shutdown() {
	close(e.quit)
	e.mu.Lock()
	e.stopped = true
	queued := e.queue
	e.queue = nil
	e.mu.Unlock()
	for _, q := range queued {
		e.finish(q, ErrClosed)
	}
	var running []*request
	for _, r := range e.ranks {
		running = append(running, r.held...)
	}
	for _, q := range running {
		switch q.phase {
		case PhaseContext, PhaseGenerate:
			e.end(q, ErrClosed) // a prefill job waits for its holder, as a lease does
		case PhaseAwaitCache:
			// The fetch ends with its context; it then fails with
			// ErrClosed, like every other phase.
			q.cancel(ErrClosed)
		}
	}
	timer := time.NewTimer(e.cfg.ReleaseGrace)
	defer timer.Stop()
wait:
	for {
		e.applyInbox()
		held := 0
		for _, r := range e.ranks {
			held += len(r.held)
		}
		if held == 0 {
			break
		}
		select {
		case <-e.wake:
		case <-timer.C:
			for _, r := range e.ranks {
				for _, q := range append([]*request(nil), r.held...) {
					q.log.Warn("freeing resources of a request still in transfer at shutdown", "phase", q.phase.String())
					e.finish(q, ErrClosed)
				}
			}
			break wait
		}
	}
	e.fetches.Wait()
	e.applyInbox()
	e.publish()
}
