package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"path/filepath"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/agent"
)

// lockedBuffer is the command's stderr, read while it writes.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestAdminEndpoints: with --admin-addr the agent serves /livez, /readyz
// (200 while it serves engines) and /metrics, whose handoff_agent_engines
// counts an engine connected, beside the Go runtime's collectors.
func TestAdminEndpoints(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "a", "x.sock")
	ctx, cancel := context.WithCancel(context.Background())
	var stderr lockedBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--name", "x", "--socket", sock, "--admin-addr", "127.0.0.1:0"}, &stderr)
	}()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done, stderr.String())
	})
	addr := regexp.MustCompile(`admin listening" addr=(\S+)`)
	var base string
	require.Eventually(t, func() bool {
		m := addr.FindStringSubmatch(stderr.String())
		if m != nil {
			base = "http://" + m[1]
		}
		return m != nil
	}, 10*time.Second, 10*time.Millisecond, stderr.String())
	get := func(path string) (int, string) {
		resp, err := http.Get(base + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}
	code, _ := get("/livez")
	require.Equal(t, http.StatusOK, code)
	require.Eventually(t, func() bool { code, _ := get("/readyz"); return code == http.StatusOK }, 10*time.Second, 10*time.Millisecond)

	c, err := agent.Dial(ctx, sock)
	require.NoError(t, err)
	defer c.Close()
	require.Eventually(t, func() bool {
		_, body := get("/metrics")
		return regexp.MustCompile(`(?m)^handoff_agent_engines 1$`).MatchString(body)
	}, 10*time.Second, 10*time.Millisecond)
	_, body := get("/metrics")
	require.Contains(t, body, `handoff_agent_requests_total{op="hello",result="ok"} 1`)
	require.Contains(t, body, "go_goroutines ")
}
