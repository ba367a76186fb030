//go:build linux && cgo && ucx

package ucx

import "context"

// FenceWaiters is the number of Fence calls waiting on tok.
func (w *Worker) FenceWaiters(ctx context.Context, tok Token) (n int, err error) {
	err = w.call(ctx, func() error {
		if g := w.groups[tok]; g != nil {
			n = len(g.waiters)
		}
		return nil
	})
	return n, err
}
