package service

import (
	"context"
	"errors"
	"os"
	"os/signal"
	"sync"
)

// ErrAborted is returned by Main, RunDecode and RunPrefill when a second
// stop signal (Options.Abort) cut the drain short.
var ErrAborted = errors.New("service: drain aborted by a second signal")

// NotifyStop returns ctx, cancelled by the first of sigs (the worker
// drains), and abort, cancelled by the second (the drain ends at once and
// the worker exits nonzero), as users expect from servers run by hand.
// stop releases the signals and waits for the goroutine watching them.
func NotifyStop(parent context.Context, sigs ...os.Signal) (ctx, abort context.Context, stop func()) {
	ctx, cancel := context.WithCancel(parent)
	abort, cancelAbort := context.WithCancel(parent)
	ch := make(chan os.Signal, 2) // both signals, so neither is dropped
	signal.Notify(ch, sigs...)
	quit := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for n := 0; n < 2; {
			select {
			case <-ch:
				if n++; n == 1 {
					cancel()
				} else {
					cancelAbort()
				}
			case <-quit:
				return
			}
		}
	})
	var once sync.Once
	return ctx, abort, func() {
		once.Do(func() {
			signal.Stop(ch)
			close(quit)
			wg.Wait()
			cancel()
			cancelAbort()
		})
	}
}
