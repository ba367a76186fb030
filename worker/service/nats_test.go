package service

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/testport"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/config"
)

func TestNATSAuth(t *testing.T) {
	srv := natstest.Run(t, func(o *server.Options) { o.Username, o.Password = "handoff", "s3cret" })
	log := slog.New(slog.DiscardHandler)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	nc, err := connectNATS(ctx, config.NATS{URL: srv.ClientURL(), User: "handoff", Password: "s3cret"}, "t", log)
	require.NoError(t, err)
	require.True(t, nc.IsConnected())
	nc.Close()

	// nats.go reports the refusal as ErrAuthorization or as the server's
	// "-ERR 'Authorization Violation'", depending on which it reads first.
	_, err = connectNATS(ctx, config.NATS{URL: srv.ClientURL(), User: "handoff", Password: "wrong"}, "t", log)
	require.Error(t, err)
	require.Contains(t, strings.ToLower(err.Error()), "authorization violation")
	_, err = connectNATS(ctx, config.NATS{URL: srv.ClientURL()}, "t", log)
	require.Error(t, err)
	require.Contains(t, strings.ToLower(err.Error()), "authorization violation")

	_, err = natsOptions(config.NATS{NKey: "/does/not/exist"}, "t", log)
	require.Error(t, err)

	// A whole worker with credentials serves and is ready.
	ep, _ := startWorker(t, testConfig(t, worker.RolePrefill, "--nats-url", srv.ClientURL(),
		"--nats-user", "handoff", "--nats-password", "s3cret"))
	resp, err := http.Get("http://" + ep.Admin + "/readyz")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
}

// Credentials in --nats-url never reach a log line or an error: not the
// wait for an unreachable server, not a refusal.
func TestNATSURLRedacted(t *testing.T) {
	require.Equal(t, "nats://u:xxxxx@a:4222,nats://xxxxx@b:4222,nats://c:4222",
		redactURLs("nats://u:p4ss@a:4222, nats://t0ken@b:4222,nats://c:4222"))
	// Without a scheme, as nats.go takes them too.
	require.Equal(t, "nats://u:xxxxx@a:4222,nats://xxxxx@b:4222,c:4222",
		redactURLs("u:p4ss@a:4222,t0ken@b:4222,c:4222"))
	require.Equal(t, "xxxxx", redactURLs("nats://u:p%zz@a:4222"))

	var logs strings.Builder
	log := slog.New(slog.NewTextHandler(&logs, nil))
	srv := natstest.Run(t, func(o *server.Options) { o.Username, o.Password = "handoff", "s3cret" })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	u := strings.Replace(srv.ClientURL(), "nats://", "nats://handoff:wr0ng@", 1)
	_, err := connectNATS(ctx, config.NATS{URL: u}, "t", log)
	require.Error(t, err)
	require.NotContains(t, err.Error(), "wr0ng")

	// Nothing answers: the wait logs the URL every 5 s, and its end says it.
	wctx, wcancel := context.WithTimeout(context.Background(), 5500*time.Millisecond)
	defer wcancel()
	_, err = connectNATS(wctx, config.NATS{URL: fmt.Sprintf("nats://handoff:s3cret@127.0.0.1:%d", freePort(t))}, "t", log)
	require.Error(t, err)
	require.NotContains(t, err.Error(), "s3cret")
	require.Contains(t, logs.String(), "waiting for nats")
	require.NotContains(t, logs.String(), "s3cret")
	require.NotContains(t, logs.String(), "wr0ng")
}

// freePort reserves a loopback port until the test ends (testport.Reserve):
// a server stopped and started again on it, or told it before it starts,
// gets it, and nothing else is handed it meanwhile.
func freePort(t *testing.T) int { return testport.Reserve(t) }

func readyz(t *testing.T, admin string) int {
	t.Helper()
	resp, err := http.Get("http://" + admin + "/readyz")
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestWaitsForNATS: a worker started before its NATS server is alive but
// not ready, and becomes ready once the server is up.
func TestWaitsForNATS(t *testing.T) {
	port := freePort(t)
	cfg := testConfig(t, worker.RolePrefill, "--nats-url", fmt.Sprintf("nats://127.0.0.1:%d", port),
		"--admin-addr", fmt.Sprintf("127.0.0.1:%d", freePort(t)))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	ready := make(chan Endpoints, 1)
	go func() {
		done <- RunPrefill(ctx, cfg, Options{Stderr: os.Stderr, Ready: func(ep Endpoints) { ready <- ep }, Logger: slog.New(slog.DiscardHandler)})
	}()
	require.Eventually(t, func() bool { return readyz(t, cfg.AdminAddr) == http.StatusServiceUnavailable },
		10*time.Second, 10*time.Millisecond)
	resp, err := http.Get("http://" + cfg.AdminAddr + "/livez")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)

	opts := natstest.Options(t.TempDir())
	opts.Port = port
	srv, err := natstest.Start(opts)
	require.NoError(t, err)
	defer natstest.Stop(srv)
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("worker stopped: %v", err)
	case <-time.After(15 * time.Second):
		t.Fatal("worker not serving after NATS came up")
	}
	require.Equal(t, http.StatusOK, readyz(t, cfg.AdminAddr))

	// Readiness follows the connection when the server goes away.
	natstest.Stop(srv)
	require.Eventually(t, func() bool { return readyz(t, cfg.AdminAddr) == http.StatusServiceUnavailable },
		10*time.Second, 10*time.Millisecond)
	cancel()
	require.NoError(t, <-done)
}

// TestNATSRestart: the server restarts (same port and store); both workers
// reconnect, readiness follows, and new requests succeed.
func TestNATSRestart(t *testing.T) {
	port := freePort(t)
	opts := natstest.Options(t.TempDir())
	opts.Port = port
	start := func() *server.Server {
		srv, err := natstest.Start(opts)
		require.NoError(t, err)
		return srv
	}
	srv := start()
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)
	pep, _ := startWorker(t, testConfig(t, worker.RolePrefill, "--nats-url", url, "--namespace", "restart"))
	dep, _ := startWorker(t, testConfig(t, worker.RoleDecode, "--nats-url", url, "--namespace", "restart"))
	require.Equal(t, http.StatusOK, complete(t, dep.HTTP, "before", 3, 0, 1).status)

	natstest.Stop(srv)
	for _, ep := range []Endpoints{pep, dep} {
		require.Eventually(t, func() bool { return readyz(t, ep.Admin) == http.StatusServiceUnavailable },
			10*time.Second, 10*time.Millisecond)
	}
	srv = start()
	defer natstest.Stop(srv)
	for _, ep := range []Endpoints{pep, dep} {
		require.Eventually(t, func() bool { return readyz(t, ep.Admin) == http.StatusOK },
			15*time.Second, 20*time.Millisecond)
	}
	require.Eventually(t, func() bool { return complete(t, dep.HTTP, "after", 3, 0, 1).status == http.StatusOK },
		15*time.Second, 100*time.Millisecond)
}
