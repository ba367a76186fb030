//go:build linux && cgo && ucx

package ucx

// The owner goroutine: the queue callers hand their work to, the wake-up,
// and the loop that progresses UCX, delivers completions and sleeps on
// the worker's event fd.

/*
#include "shim.h"
*/
import "C"

import (
	"context"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// onOwner reports whether the caller runs on the owner goroutine: its
// thread is locked, so while it runs its thread id names it (once it has
// ended, the id may come back for another thread).
func (w *Worker) onOwner() bool {
	select {
	case <-w.done:
		return false
	default:
		return unix.Gettid() == w.tid
	}
}

// submit queues f for the owner and wakes it. f runs with closing false,
// or with closing true (do nothing but fail) once the worker is torn down.
func (w *Worker) submit(f func(closing bool)) error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return ErrClosed
	}
	w.queue = append(w.queue, f)
	w.wake()
	w.mu.Unlock()
	return nil
}

// wake makes the owner's sleep return. w.mu is held: the owner closes the
// eventfd under it.
func (w *Worker) wake() {
	if w.wakefd < 0 {
		return
	}
	one := [8]byte{1}
	unix.Write(w.wakefd, one[:]) //nolint:errcheck // EAGAIN: already awake
}

// call runs f on the owner and returns its result, or ctx's error first.
func (w *Worker) call(ctx context.Context, f func() error) error {
	return w.callUndo(ctx, f, nil)
}

// callUndo is call for work that leaves something behind (an endpoint):
// when f succeeded but its caller had already given up (ctx ended), undo
// runs on the owner right after f, so that nothing is left that no one
// knows of. The caller and the owner settle who won with one CAS: a caller
// that lost waits for f's result and returns it.
func (w *Worker) callUndo(ctx context.Context, f func() error, undo func()) error {
	if w.onOwner() {
		return ErrOwner
	}
	const waiting, answered, gaveUp = 0, 1, 2
	var state atomic.Int32
	res := make(chan error, 1)
	err := w.submit(func(closing bool) {
		switch {
		case closing:
			res <- ErrClosed
		case ctx.Err() != nil:
			res <- ctx.Err()
		default:
			err := f()
			if err == nil && undo != nil && !state.CompareAndSwap(waiting, answered) {
				undo()
			}
			res <- err
		}
	})
	if err != nil {
		return err
	}
	select {
	case err := <-res:
		return err
	case <-ctx.Done():
		if undo == nil || state.CompareAndSwap(waiting, gaveUp) {
			return ctx.Err()
		}
		return <-res // f succeeded, and its caller is told so
	}
}

func (w *Worker) nextSeq() uint64 {
	w.seq++
	return w.seq
}

func (w *Worker) ud(seq uint64) C.uintptr_t { return C.uintptr_t(uint64(w.id)<<seqBits | seq) }

// loop is the owner's: run submitted work, progress UCX, deliver
// completions, then arm the worker and sleep on its event fd and the wake
// eventfd until either is readable (or MaxSleep).
func (w *Worker) loop() {
	for {
		w.mu.Lock()
		q, closed := w.queue, w.closed
		w.queue = nil
		w.mu.Unlock()
		for _, f := range q {
			f(false)
		}
		w.progress()
		if closed {
			w.shutdown()
			return
		}
		w.mu.Lock()
		more := len(w.queue) > 0 || w.closed
		w.mu.Unlock()
		if more {
			continue
		}
		if st := C.ucp_worker_arm(w.uw); st == C.UCS_ERR_BUSY {
			continue
		}
		w.sleep()
	}
}

// progress calls ucp_worker_progress until it reports nothing done (or a
// burst), then delivers what the callbacks left for later.
func (w *Worker) progress() {
	for i := 0; i < progressBurst; i++ {
		w.st.progress.Add(1)
		if C.ucp_worker_progress(w.uw) == 0 {
			break
		}
	}
	if w.panicked != nil {
		panic(w.panicked)
	}
	w.deliver()
}

func (w *Worker) deliver() {
	for len(w.later) > 0 || len(w.failed) > 0 {
		for _, f := range w.failed {
			w.peerFailed(f)
		}
		w.failed = w.failed[:0]
		later := w.later
		w.later = nil
		for _, f := range later {
			f()
		}
	}
}

func (w *Worker) sleep() {
	fds := []unix.PollFd{{Fd: int32(w.efd), Events: unix.POLLIN}, {Fd: int32(w.wakefd), Events: unix.POLLIN}}
	w.st.sleeps.Add(1)
	n, err := unix.Poll(fds, w.maxSleep)
	if err == nil && n == 0 {
		w.st.sleepTimeouts.Add(1)
	}
	if fds[1].Revents != 0 {
		var b [8]byte
		unix.Read(w.wakefd, b[:]) //nolint:errcheck // nonblocking; EAGAIN is fine
	}
}
