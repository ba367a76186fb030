package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/testport"

	"github.com/handoff-io/handoff/internal/leakcheck"
)

// TestMain lets the test binary act as handoff-nats, so the signal path is
// tested on a real process without a separate build.
// It also fails the run when goroutines outlive the tests: every server
// started here must be shut down completely.
func TestMain(m *testing.M) {
	if os.Getenv("HANDOFF_NATS_TEST_AS_MAIN") == "1" {
		main()
		return
	}
	leakcheck.Main(m)
}

func testConfig(t *testing.T) config {
	t.Helper()
	c, err := parseServe([]string{"--port", "-1", "--http-port", "-1", "--host", "127.0.0.1",
		"--store-dir", t.TempDir(), "--server-name", "test"}, envOf(nil), io.Discard)
	require.NoError(t, err)
	return c
}

// startServe runs serve in a goroutine and returns the running server and a
// stop function that cancels it and returns serve's error.
func startServe(t *testing.T, cfg config) (*server.Server, func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	readyCh := make(chan *server.Server, 1)
	errCh := make(chan error, 1)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	go func() { errCh <- serve(ctx, cfg, log, func(s *server.Server) { readyCh <- s }) }()
	var s *server.Server
	select {
	case s = <-readyCh:
	case err := <-errCh:
		cancel()
		t.Fatalf("serve: %v", err)
	case <-time.After(30 * time.Second):
		cancel()
		t.Fatal("server not ready")
	}
	var once sync.Once
	var stopErr error
	stop := func() error {
		once.Do(func() {
			cancel()
			select {
			case stopErr = <-errCh:
			case <-time.After(30 * time.Second):
				stopErr = fmt.Errorf("serve did not return after cancel")
			}
		})
		return stopErr
	}
	t.Cleanup(func() { _ = stop() })
	return s, stop
}

func TestServeJetStreamKVAndShutdown(t *testing.T) {
	cfg := testConfig(t)
	s, stop := startServe(t, cfg)

	// The monitoring endpoint answers and the healthcheck subcommand agrees.
	url := monitorURL(s) + "/healthz"
	var out bytes.Buffer
	require.NoError(t, probe(context.Background(), url, 3*time.Second, &out))
	require.Contains(t, out.String(), "ok")

	// JetStream works well enough for handoff's discovery: a KV bucket with a
	// TTL, per-key TTL markers need server 2.11+.
	nc, err := nats.Connect(s.ClientURL())
	require.NoError(t, err)
	defer nc.Close()
	require.Equal(t, int64(8<<20), nc.MaxPayload())
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "handoff_default_instances", TTL: time.Minute, LimitMarkerTTL: time.Minute})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "decode-0", []byte("10.0.0.1:7400"))
	require.NoError(t, err)
	e, err := kv.Get(ctx, "decode-0")
	require.NoError(t, err)
	require.Equal(t, "10.0.0.1:7400", string(e.Value()))

	require.NoError(t, stop())
	require.False(t, s.Running())
	// The store survived the shutdown on disk.
	_, err = os.Stat(filepath.Join(cfg.StoreDir, "jetstream"))
	require.NoError(t, err)
}

func TestServeAuth(t *testing.T) {
	cfg := testConfig(t)
	cfg.User, cfg.Password = "handoff", "s3cret"
	s, _ := startServe(t, cfg)

	_, err := nats.Connect(s.ClientURL(), nats.MaxReconnects(0))
	require.Error(t, err)
	nc, err := nats.Connect(s.ClientURL(), nats.UserInfo("handoff", "s3cret"))
	require.NoError(t, err)
	nc.Close()
}

func TestServeCluster(t *testing.T) {
	a := testConfig(t)
	a.ServerName, a.ClusterName, a.ClusterPort, a.JetStream = "a", "handoff", -1, false
	sa, _ := startServe(t, a)
	routeA := fmt.Sprintf("nats://%s", sa.ClusterAddr().String())

	b := testConfig(t)
	b.ServerName, b.ClusterName, b.ClusterPort, b.JetStream = "b", "handoff", -1, false
	b.Routes = []string{routeA}
	sb, _ := startServe(t, b)

	require.Eventually(t, func() bool { return sa.NumRoutes() > 0 && sb.NumRoutes() > 0 },
		10*time.Second, 50*time.Millisecond, "servers never routed")

	// A message published on one server reaches a subscriber on the other.
	nca, err := nats.Connect(sa.ClientURL())
	require.NoError(t, err)
	defer nca.Close()
	ncb, err := nats.Connect(sb.ClientURL())
	require.NoError(t, err)
	defer ncb.Close()
	sub, err := nca.SubscribeSync("handoff.default.prefill.submit")
	require.NoError(t, err)
	require.NoError(t, nca.Flush())
	require.Eventually(t, func() bool {
		_ = ncb.Publish("handoff.default.prefill.submit", []byte("x"))
		_, err := sub.NextMsg(100 * time.Millisecond)
		return err == nil
	}, 10*time.Second, 10*time.Millisecond)
}

func TestServeFailsOnBusyPort(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	cfg := testConfig(t)
	cfg.Port = ln.Addr().(*net.TCPAddr).Port
	done := make(chan error, 1)
	go func() {
		done <- serve(context.Background(), cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), nil)
	}()
	select {
	case err := <-done:
		require.Error(t, err)
	case <-time.After(readyTimeout + 10*time.Second):
		t.Fatal("serve did not fail on a busy port")
	}
}

func TestHealthcheck(t *testing.T) {
	status := http.StatusOK
	var mu sync.Mutex
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		w.WriteHeader(status)
		_, _ = w.Write([]byte(`{"status":"x"}`))
	}))
	defer srv.Close()

	var out bytes.Buffer
	require.Equal(t, 0, run(context.Background(), []string{"healthcheck", "--url", srv.URL}, envOf(nil), &out, &out))

	mu.Lock()
	status = http.StatusServiceUnavailable
	mu.Unlock()
	out.Reset()
	require.Equal(t, 1, run(context.Background(), []string{"healthcheck", "--url", srv.URL}, envOf(nil), &out, &out))
	require.Contains(t, out.String(), "503")

	// Nothing listening: unhealthy, not a hang.
	err := runHealthcheck(context.Background(), []string{"--url", "http://127.0.0.1:1/healthz", "--timeout", "1s"}, envOf(nil), io.Discard)
	require.ErrorIs(t, err, errUnhealthy)

	require.ErrorIs(t, runHealthcheck(context.Background(), []string{"--timeout", "0s"}, envOf(nil), io.Discard), errConfig)
	require.ErrorIs(t, runHealthcheck(context.Background(), []string{"extra"}, envOf(nil), io.Discard), errConfig)
}

func TestDefaultHealthURL(t *testing.T) {
	require.Equal(t, "http://127.0.0.1:8222/healthz", defaultHealthURL(envOf(nil)))
	require.Equal(t, "http://127.0.0.1:9333/healthz", defaultHealthURL(envOf(map[string]string{"HANDOFF_NATS_HTTP_PORT": "9333"})))
	require.Equal(t, "http://127.0.0.1:8222/healthz", defaultHealthURL(envOf(map[string]string{"HANDOFF_NATS_HTTP_PORT": "junk"})))
}

func TestVersion(t *testing.T) {
	var out bytes.Buffer
	require.Equal(t, 0, run(context.Background(), []string{"version"}, envOf(nil), &out, io.Discard))
	require.Contains(t, out.String(), "handoff-nats ")
	require.Contains(t, out.String(), "nats-server "+server.VERSION)
	require.Equal(t, 1, run(context.Background(), []string{"version", "x"}, envOf(nil), &out, io.Discard))
}

// freePort reserves a loopback port until the test ends (testport.Reserve):
// a server stopped and started again on it, or told it before it starts,
// gets it, and nothing else is handed it meanwhile.
func freePort(t *testing.T) int { return testport.Reserve(t) }

// TestProcessSIGTERM runs the real main in a child process, waits until the
// healthcheck passes, sends SIGTERM and expects a clean exit with status 0.
func TestProcessSIGTERM(t *testing.T) {
	port, httpPort := freePort(t), freePort(t)
	cmd := exec.Command(os.Args[0], "--host", "127.0.0.1", "--port", strconv.Itoa(port), "--log-format", "text")
	cmd.Env = append(os.Environ(),
		"HANDOFF_NATS_TEST_AS_MAIN=1",
		"HANDOFF_NATS_HTTP_PORT="+strconv.Itoa(httpPort),
		"HANDOFF_NATS_STORE_DIR="+t.TempDir(),
	)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	// The healthcheck subcommand finds the port through the same env.
	env := map[string]string{"HANDOFF_NATS_HTTP_PORT": strconv.Itoa(httpPort)}
	require.Eventually(t, func() bool {
		return run(context.Background(), []string{"healthcheck", "--timeout", "500ms"}, envOf(env), io.Discard, io.Discard) == 0
	}, 30*time.Second, 100*time.Millisecond, "never healthy: %s", &stderr)

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	waitErr := make(chan error, 1)
	go func() { waitErr <- cmd.Wait() }()
	select {
	case err := <-waitErr:
		require.NoError(t, err, "exit after SIGTERM: %s", stderr.String())
	case <-time.After(20 * time.Second):
		t.Fatalf("no exit after SIGTERM: %s", stderr.String())
	}
	require.True(t, strings.Contains(stderr.String(), "msg=stopped"), stderr.String())
}

// TestServeDropsSilentClients checks that --ping-interval and --max-pings-out
// reach the server: a client that stops answering pings (its host vanished)
// is disconnected, which removes its queue subscriptions.
func TestServeDropsSilentClients(t *testing.T) {
	cfg := testConfig(t)
	cfg.PingEvery, cfg.MaxPingsOut = time.Second, 1
	s, _ := startServe(t, cfg)

	conn, err := net.Dial("tcp", s.Addr().String())
	require.NoError(t, err)
	defer conn.Close()
	_, err = conn.Write([]byte("CONNECT {\"verbose\":false}\r\nSUB handoff.default.prefill.submit prefill 1\r\n"))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return s.NumSubscriptions() > 0 }, 5*time.Second, 20*time.Millisecond)

	// Read everything (INFO, PINGs) and answer nothing, until the server closes.
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(10*time.Second)))
	start := time.Now()
	_, err = io.Copy(io.Discard, conn)
	require.NoError(t, err, "the server should close the connection, not time out")
	require.Less(t, time.Since(start), 8*time.Second)
	require.Eventually(t, func() bool { return s.NumClients() == 0 }, 5*time.Second, 20*time.Millisecond)
}

// TestServeJetStreamCluster runs the Kubernetes shape in miniature: three
// servers, each given the same route list (itself included), JetStream on,
// then a discovery bucket replicated on all three that survives losing one.
func TestServeJetStreamCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three servers")
	}
	ports := []int{freePort(t), freePort(t), freePort(t)}
	var routes []string
	for _, p := range ports {
		routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", p))
	}
	servers := make([]*server.Server, 3)
	stops := make([]func() error, 3)
	for i := range servers {
		c := testConfig(t)
		c.ServerName = fmt.Sprintf("nats-%d", i)
		c.ClusterName, c.ClusterHost, c.ClusterPort, c.Routes = "handoff", "127.0.0.1", ports[i], routes
		servers[i], stops[i] = startServe(t, c)
	}
	nc, err := nats.Connect(servers[0].ClientURL() + "," + servers[1].ClientURL())
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)

	var kv jetstream.KeyValue
	require.Eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		kv, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "handoff_default_instances", Replicas: 3, TTL: time.Minute})
		return err == nil
	}, 30*time.Second, 200*time.Millisecond, "no R3 bucket: %v", err)

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err = kv.Put(ctx, "prefill-0", []byte("10.0.0.2:7400"))
	require.NoError(t, err)

	// Lose one server; the bucket stays readable and writable (2 of 3).
	require.NoError(t, stops[2]())
	require.Eventually(t, func() bool {
		c, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err = kv.Put(c, "prefill-1", []byte("10.0.0.3:7400"))
		return err == nil
	}, 20*time.Second, 200*time.Millisecond, "bucket not writable after losing one server: %v", err)
	e, err := kv.Get(ctx, "prefill-0")
	require.NoError(t, err)
	require.Equal(t, "10.0.0.2:7400", string(e.Value()))
}

// A stop asked for while the server starts (a large store takes a while to
// recover) ends it with status 0, as a stop once it serves does, and as
// the workers do: a supervisor that stops it must not see a failure.
func TestStoppedDuringStartUp(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var stderr bytes.Buffer
	code := run(ctx, []string{"--host", "127.0.0.1", "--port", strconv.Itoa(freePort(t)), "--http-port", "0", "--store-dir", t.TempDir()},
		envOf(nil), io.Discard, &stderr)
	require.Equal(t, 0, code, stderr.String())
	require.Contains(t, stderr.String(), "stopped during start-up")
}
