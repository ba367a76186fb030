package worker

import (
	"context"
	"fmt"
	"time"
)

// Drain stops intake (Generate and Prefill return ErrDraining) and waits
// until every accepted request ended, or ctx ends.
func (s *Scheduler) Drain(ctx context.Context) error {
	s.mu.Lock()
	s.draining = true
	s.maybeIdleLocked()
	idle := s.idle
	s.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("worker: drain: %w", ctx.Err())
	}
}

// Draining reports whether Drain was called.
func (s *Scheduler) Draining() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.draining
}

// Live is the number of accepted requests not yet ended.
func (s *Scheduler) Live() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.live
}

func (s *Scheduler) maybeIdleLocked() {
	if s.draining && s.live == 0 && !s.idleShut {
		s.idleShut = true
		close(s.idle)
	}
}

// shutdown fails what is left and waits for fetches and leases, up to
// ReleaseGrace, before freeing their resources anyway.
func (s *Scheduler) shutdown() {
	close(s.quit)
	s.mu.Lock()
	s.stopped = true
	queued := s.queue
	s.queue = nil
	s.mu.Unlock()
	for _, q := range queued {
		s.finish(q, ErrClosed)
	}
	var running []*request
	for _, r := range s.ranks {
		running = append(running, r.held...)
	}
	for _, q := range running {
		switch q.phase {
		case PhaseContext, PhaseGenerate:
			s.end(q, ErrClosed) // a prefill job waits for its holder, as a lease does
		case PhaseAwaitCache:
			// The fetch ends with its context; it then fails with
			// ErrClosed, like every other phase.
			q.cancel(ErrClosed)
		}
	}
	timer := time.NewTimer(s.cfg.ReleaseGrace)
	defer timer.Stop()
wait:
	for {
		s.applyInbox()
		held := 0
		for _, r := range s.ranks {
			held += len(r.held)
		}
		if held == 0 {
			break
		}
		select {
		case <-s.wake:
		case <-timer.C:
			for _, r := range s.ranks {
				for _, q := range append([]*request(nil), r.held...) {
					q.log.Warn("freeing resources of a request still in transfer at shutdown", "phase", q.phase.String())
					s.finish(q, ErrClosed)
				}
			}
			break wait
		}
	}
	s.fetches.Wait()
	s.applyInbox()
	s.publish()
}
