package transfer

import (
	"context"
	"sync"
	"time"
)

// deadlineCtx is a prefill task's context: done at its deadline or when
// cancelled. Unlike context.WithDeadline it arms no timer until someone asks
// for Done (or a Value, which is how a derived context finds its parent):
// most tasks only ever check Err, between steps that cannot block (a cached
// prompt written in-process), and a timer per task costs more than they do.
// Once armed it is a context.WithDeadline in every respect. The zero value
// with deadline set is ready; it must not be copied.
type deadlineCtx struct {
	deadline time.Time

	mu   sync.Mutex
	real context.Context    // nil until armed
	stop context.CancelFunc // real's
	err  error              // set by cancel before arming
}

var _ context.Context = (*deadlineCtx)(nil)

func (c *deadlineCtx) arm() context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.real != nil:
	case c.err == context.Canceled:
		// Cancelled before it was armed: it stays Canceled, even when its
		// deadline has passed since (Err must not change once non-nil).
		c.real, c.stop = context.WithCancel(context.Background())
		c.stop()
	default:
		c.real, c.stop = context.WithDeadline(context.Background(), c.deadline)
	}
	return c.real
}

// armed reports whether the context was armed: something asked for Done or
// a Value.
func (c *deadlineCtx) armed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.real != nil
}

// Deadline implements context.Context.
func (c *deadlineCtx) Deadline() (time.Time, bool) { return c.deadline, true }

// Done implements context.Context; it arms the context.
func (c *deadlineCtx) Done() <-chan struct{} { return c.arm().Done() }

// Value implements context.Context; it arms the context, so that a context
// derived from this one hooks into the armed one without a goroutine.
func (c *deadlineCtx) Value(key any) any { return c.arm().Value(key) }

// Err implements context.Context.
func (c *deadlineCtx) Err() error {
	c.mu.Lock()
	real, err := c.real, c.err
	c.mu.Unlock()
	switch {
	case real != nil:
		return real.Err()
	case err != nil:
		return err
	case time.Until(c.deadline) <= 0:
		return context.DeadlineExceeded
	}
	return nil
}

// release ends the context once its task is done: an armed one is
// cancelled (its timer stopped); an unarmed one, which nothing waits on, is
// marked cancelled without reading the clock. Idempotent.
func (c *deadlineCtx) release() {
	c.mu.Lock()
	if c.real == nil {
		if c.err == nil {
			c.err = context.Canceled
		}
		c.mu.Unlock()
		return
	}
	stop := c.stop
	c.mu.Unlock()
	stop()
}

// cancel ends the context with context.Canceled, unless its deadline passed
// first. Idempotent.
func (c *deadlineCtx) cancel() {
	c.mu.Lock()
	if c.real != nil {
		stop := c.stop
		c.mu.Unlock()
		stop()
		return
	}
	if c.err == nil {
		c.err = context.Canceled
		if time.Until(c.deadline) <= 0 {
			c.err = context.DeadlineExceeded
		}
	}
	c.mu.Unlock()
}
