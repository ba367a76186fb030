//go:build integration

package integration

// Helper processes: this test binary run again as a child that plays one
// part of a measurement (a NATS peer, a Go worker receiving), so that the
// parts are processes of their own, as in a deployment.

import (
	"bufio"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// helperProtocol is where a helper child answers its parent: descriptor 3
// (exec.Cmd.ExtraFiles), so that its stdout stays the test's report.
func helperProtocol() *os.File { return os.NewFile(3, "protocol") }

// helper is a running helper child.
type helper struct {
	name  string
	stdin io.WriteCloser
	lines chan string // its answers, a line each; closed once it stopped answering
}

// startHelper runs the test named run of this binary as a child, with env
// added. Its answers arrive through next; its stdout and stderr (where a
// failing test reports) are ours. It stops with the test: its stdin
// closes, and it is killed if it has not exited 10 s later.
func startHelper(t *testing.T, run string, env ...string) *helper {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+run+"$", "-test.v=false")
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	proto, w, err := os.Pipe()
	require.NoError(t, err)
	cmd.ExtraFiles = []*os.File{w}
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	err = cmd.Start()
	w.Close()
	require.NoError(t, err, run)
	h := &helper{name: run, stdin: stdin, lines: make(chan string, 1)}
	stop := make(chan struct{})
	go func() {
		defer close(h.lines)
		r := bufio.NewReader(proto)
		for {
			l, err := r.ReadString('\n')
			if err != nil {
				return
			}
			select {
			case h.lines <- strings.TrimSuffix(l, "\n"):
			case <-stop:
				return
			}
		}
	}()
	t.Cleanup(func() {
		close(stop)
		proto.Close()
		stdin.Close()
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	return h
}

// next returns the child's next answer; the test fails if it stopped
// answering or took longer than wait.
func (h *helper) next(t *testing.T, wait time.Duration) string {
	t.Helper()
	select {
	case l, ok := <-h.lines:
		require.True(t, ok, "%s ended (its report is above)", h.name)
		return l
	case <-time.After(wait):
		t.Fatalf("%s did not answer in %s", h.name, wait)
	}
	return ""
}
