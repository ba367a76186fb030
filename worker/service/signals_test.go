package service

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestNotifyStop(t *testing.T) {
	ctx, abort, stop := NotifyStop(context.Background(), syscall.SIGUSR1)
	defer stop()
	require.NoError(t, syscall.Kill(syscall.Getpid(), syscall.SIGUSR1))
	select {
	case <-ctx.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the first signal did not stop")
	}
	require.NoError(t, abort.Err(), "one signal drains, it does not abort")
	require.NoError(t, syscall.Kill(syscall.Getpid(), syscall.SIGUSR1))
	select {
	case <-abort.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the second signal did not abort")
	}
}
