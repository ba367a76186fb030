package agent

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/rdma"
)

// TestPeerOfAnotherUserRefused: even with the socket's directory and mode
// opened up, a process of another uid is disconnected at once
// (SO_PEERCRED). Needs root, to run the client as nobody.
func TestPeerOfAnotherUserRefused(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to connect as another user")
	}
	sock := startAgent(t, "a", rdma.TransportSHM)
	for d := filepath.Dir(sock); d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		require.NoError(t, os.Chmod(d, 0o777)) // the t.TempDir tree, up to the temp dir
	}
	require.NoError(t, os.Chmod(sock, 0o666))
	// The test binary, where nobody may run it.
	dir, err := os.MkdirTemp("", "handoff-agent-peercred-")
	require.NoError(t, err)
	defer os.RemoveAll(dir)
	require.NoError(t, os.Chmod(dir, 0o755))
	bin, err := os.ReadFile(os.Args[0])
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "agent.test"), bin, 0o755))
	cmd := exec.Command(filepath.Join(dir, "agent.test"), "-test.run=^TestHelperDialAsOther$", "-test.v")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "HANDOFF_AGENT_HELPER_SOCKET="+sock)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Skipf("cannot run a process as nobody here (a noexec temp dir?): %v", err)
	}
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "HELPER: refused")

	// The agent's own user is served.
	c, err := Dial(ctxT(t), sock)
	require.NoError(t, err)
	c.Close()
}

// TestHelperDialAsOther is TestPeerOfAnotherUserRefused's client process.
func TestHelperDialAsOther(t *testing.T) {
	sock := os.Getenv("HANDOFF_AGENT_HELPER_SOCKET")
	if sock == "" {
		t.Skip("a helper process")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := Dial(ctx, sock)
	var ne *net.OpError
	switch {
	case err == nil:
		t.Fatal("HELPER: served")
	case errors.As(err, &ne) && ne.Op == "dial":
		t.Fatalf("HELPER: could not even connect: %v", err)
	}
	os.Stdout.WriteString("HELPER: refused: " + err.Error() + "\n")
}
