package main

// The datapath command's receivers: in a goroutine or in a child process.

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"syscall"

	"github.com/handoff-io/handoff/rdma"
)

// receiverHandle is a running receiver seen from the writer.
type receiverHandle struct {
	in   io.WriteCloser // to the receiver
	out  io.Reader      // from the receiver
	wait func() error   // after in is closed: the receiver's exit
	// abort, when set, tells a receiver that did not exit on its own to
	// stop now; a child gets SIGTERM and, receiverKillDelay later, SIGKILL.
	abort func()
	// processes is 2 when the receiver is a child process.
	processes int
	pid       int // the child's process id; 0 in this process
}

// spawner starts a receiver for one run.
type spawner interface {
	spawn(ctx context.Context, t rdma.Transport, l layout, logger *slog.Logger) (*receiverHandle, error)
}

// goroutineSpawner runs the receiver in this process.
type goroutineSpawner struct{}

func (goroutineSpawner) spawn(ctx context.Context, t rdma.Transport, l layout, logger *slog.Logger) (*receiverHandle, error) {
	toRx, fromWriter := io.Pipe()
	fromRx, toWriter := io.Pipe()
	done := make(chan error, 1)
	ctx, abort := context.WithCancel(ctx)
	go func() {
		err := serveReceiver(ctx, receiverConfig{Transport: t, Layout: l, Logger: logger, GrantTTL: l.ttl()}, toRx, toWriter)
		_ = toRx.CloseWithError(io.ErrClosedPipe) // unblock a writer still sending
		_ = toWriter.CloseWithError(io.EOF)
		done <- err
	}()
	wait := func() error {
		defer abort()
		return <-done
	}
	return &receiverHandle{in: fromWriter, out: fromRx, wait: wait, abort: abort, processes: 1}, nil
}

// childSpawner re-executes this binary as the receiver; env is added to its
// environment.
type childSpawner struct{ env []string }

// spawn starts the receiver on a context of its own under ctx. When that ends
// (the caller's ctx, or abort) the child gets SIGTERM, on which it closes its
// engine, which removes its shm socket, and exits; SIGKILL follows only if
// it has not exited receiverKillDelay later.
func (c childSpawner) spawn(ctx context.Context, t rdma.Transport, l layout, _ *slog.Logger) (*receiverHandle, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("locate own binary: %w", err)
	}
	ctx, abort := context.WithCancel(ctx)
	cmd := exec.CommandContext(ctx, exe, "datapath", "--role=receiver",
		"--transport="+string(t),
		"--extent="+strconv.FormatUint(l.Extent, 10),
		"--grant-bytes="+strconv.FormatUint(l.grantBytes(), 10),
		"--streams="+strconv.Itoa(l.Streams),
		"--depth="+strconv.Itoa(l.Depth),
		"--tcp-lanes="+strconv.Itoa(max(l.TCPLanes, 1)),
		"--skip-crc="+strconv.FormatBool(l.SkipCRC),
		"--tls-dir="+l.TLSDir,
		"--grant-ttl="+l.ttl().String())
	cmd.Env = append(os.Environ(), c.env...)
	cmd.Stderr = os.Stderr
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = receiverKillDelay
	in, err := cmd.StdinPipe()
	if err != nil {
		abort()
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		abort()
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		abort()
		return nil, fmt.Errorf("start receiver: %w", err)
	}
	wait := func() error {
		defer abort()
		return cmd.Wait()
	}
	return &receiverHandle{in: in, out: out, wait: wait, abort: abort, processes: 2, pid: cmd.Process.Pid}, nil
}
