package transfer

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"
)

func TestDeadlineCtx(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		var c deadlineCtx
		c.deadline = start.Add(time.Second)
		dl, ok := c.Deadline()
		require.True(t, ok)
		require.Equal(t, start.Add(time.Second), dl)
		require.NoError(t, c.Err())
		time.Sleep(time.Second)
		require.ErrorIs(t, c.Err(), context.DeadlineExceeded, "unarmed, past the deadline")
		c.cancel()
		require.ErrorIs(t, c.Err(), context.DeadlineExceeded, "the deadline came first")
		select {
		case <-c.Done(): // armed past the deadline: done at once
		default:
			t.Fatal("not done past its deadline")
		}
		require.ErrorIs(t, c.Err(), context.DeadlineExceeded)
	})
	synctest.Test(t, func(t *testing.T) {
		var c deadlineCtx
		c.deadline = time.Now().Add(time.Second)
		c.cancel()
		c.cancel()
		require.ErrorIs(t, c.Err(), context.Canceled)
		<-c.Done()
		require.ErrorIs(t, c.Err(), context.Canceled, "armed after a cancel")
	})
	synctest.Test(t, func(t *testing.T) {
		// Armed by Done: a context.WithDeadline, done at the deadline.
		var c deadlineCtx
		c.deadline = time.Now().Add(time.Second)
		done := c.Done()
		time.Sleep(999 * time.Millisecond)
		require.NoError(t, c.Err())
		select {
		case <-done:
			t.Fatal("done early")
		default:
		}
		time.Sleep(time.Millisecond)
		<-done
		require.ErrorIs(t, c.Err(), context.DeadlineExceeded)
	})
	synctest.Test(t, func(t *testing.T) {
		// A derived context follows a cancel, without a goroutine of its own
		// (the bubble would not end with one blocked).
		var c deadlineCtx
		c.deadline = time.Now().Add(time.Hour)
		child, stop := context.WithCancel(&c)
		defer stop()
		require.NoError(t, child.Err())
		c.cancel()
		<-child.Done()
		require.ErrorIs(t, child.Err(), context.Canceled)
		dl, _ := child.Deadline()
		require.Equal(t, c.deadline, dl)
	})
}

func TestDeadlineCtxRelease(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var c deadlineCtx
		c.deadline = time.Now().Add(time.Second)
		c.release()
		require.ErrorIs(t, c.Err(), context.Canceled)
		var armed deadlineCtx
		armed.deadline = time.Now().Add(time.Second)
		done := armed.Done()
		armed.release()
		<-done
		require.ErrorIs(t, armed.Err(), context.Canceled)
	})
}

// A task whose context was armed is not reused: whoever asked for its Done
// may still hold the context.
func TestArmedTaskNotReused(t *testing.T) {
	p := &Prefiller{}
	tk := p.newTask()
	tk.ctx.deadline = time.Now().Add(time.Hour)
	_ = tk.ctx.Done()
	tk.ctx.cancel()
	p.freeTask(tk)
	require.Nil(t, p.free.Get())
}

// Err keeps the error it reported first, as context.Context requires: a
// context cancelled before its deadline and armed (Done asked for) after it
// stays Canceled, not DeadlineExceeded.
func TestDeadlineCtxErrStableWhenArmedAfterDeadline(t *testing.T) {
	for _, end := range []struct {
		name string
		f    func(*deadlineCtx)
	}{{"cancel", (*deadlineCtx).cancel}, {"release", (*deadlineCtx).release}} {
		t.Run(end.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var c deadlineCtx
				c.deadline = time.Now().Add(time.Second)
				end.f(&c)
				require.Equal(t, context.Canceled, c.Err())
				time.Sleep(2 * time.Second)
				require.Equal(t, context.Canceled, c.Err(), "unarmed, past the deadline")
				<-c.Done()
				require.Equal(t, context.Canceled, c.Err(), "armed past the deadline")
				require.Equal(t, context.Canceled, context.Cause(&c))
			})
		})
	}
}
