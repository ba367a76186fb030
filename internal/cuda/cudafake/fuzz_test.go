//go:build linux

package cudafake_test

import (
	"errors"
	"runtime"
	"testing"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
)

// FuzzIpcOpenMemHandle: a handle is 64 bytes from another process; the fake
// decodes it. Any bytes must be refused with a driver error or open a
// mapping that closes, never panic or map this process's own memory.
func FuzzIpcOpenMemHandle(f *testing.F) {
	d := cudafake.New(cudafake.Config{})
	var valid cuda.IpcMemHandle
	f.Add(valid.Reserved[:])
	f.Add(append([]byte("FAKECUDA"), make([]byte, 56)...))
	seed := append([]byte("FAKECUDA"), make([]byte, 56)...)
	seed[8], seed[12] = 1, 0 // pid 1, fd 0: exists, wrong inode
	f.Add(seed)
	f.Fuzz(func(t *testing.T, b []byte) {
		var h cuda.IpcMemHandle
		copy(h.Reserved[:], b)
		done := make(chan struct{})
		go func() {
			defer close(done)
			runtime.LockOSThread()
			_ = d.Init(0)
			c, _ := d.DevicePrimaryCtxRetain(0)
			defer d.DevicePrimaryCtxRelease(0) //nolint:errcheck
			_ = d.CtxSetCurrent(c)
			p, err := d.IpcOpenMemHandle(h, cuda.IpcLazyEnablePeerAccess)
			if err != nil {
				var ce *cuda.Error
				if !errors.As(err, &ce) {
					t.Errorf("not a driver error: %v", err)
				}
				return
			}
			if err := d.IpcCloseMemHandle(p); err != nil {
				t.Errorf("close: %v", err)
			}
		}()
		<-done
	})
}
