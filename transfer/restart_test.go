package transfer

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/leakcheck"
	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/transfer/wire"
)

// The registry's bucket lives in memory on the NATS server: a restarted
// server has none. Announcers recreate it and announce again, and watchers
// watch it again, so discovery recovers without restarting the workers.
func TestRegistryRecoversAfterServerRestart(t *testing.T) {
	leakcheck.Check(t)
	opts := natstest.Options(t.TempDir())
	srv, err := natstest.Start(opts)
	require.NoError(t, err)
	opts.Port = srv.Addr().(*net.TCPAddr).Port
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	reconnect := []nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(50 * time.Millisecond)}
	ctx := context.Background()
	var logs syncBuffer // the worker's logger carries its role and instance
	cfg := RegistryConfig{Namespace: "t1", TTL: 2 * time.Second, Heartbeat: 200 * time.Millisecond,
		Logger: slog.New(slog.NewJSONHandler(&logs, nil)).With("role", "decode", "instance", "d1")}
	watcher, err := openRegistry(ctx, natstest.Connect(t, srv, reconnect...), cfg)
	require.NoError(t, err)
	defer watcher.close(ctx)
	require.NoError(t, watcher.watch(ctx, wire.RolePrefill))
	live, err := openRegistry(ctx, natstest.Connect(t, srv, reconnect...), cfg)
	require.NoError(t, err)
	defer live.close(ctx)
	require.NoError(t, live.announce(ctx, func() wire.Instance { return wire.Instance{ID: "p1", Role: wire.RolePrefill, Fingerprint: "fp"} }))
	seen := func() error {
		if n := len(watcher.Instances(wire.RolePrefill, time.Now())); n != 1 {
			return fmt.Errorf("%d instances", n)
		}
		return nil
	}
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, seen)

	// Restart: same port, empty memory store.
	srv.Shutdown()
	srv.WaitForShutdown()
	opts.StoreDir = t.TempDir()
	srv, err = natstest.Start(opts)
	require.NoError(t, err)
	time.Sleep(cfg.TTL) // the entry seen before the restart is now too old to count
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, seen)

	// And the watch follows the new bucket: an instance announced now is seen.
	late, err := openRegistry(ctx, natstest.Connect(t, srv, reconnect...), cfg)
	require.NoError(t, err)
	defer late.close(ctx)
	require.NoError(t, late.announce(ctx, func() wire.Instance { return wire.Instance{ID: "p2", Role: wire.RolePrefill, Fingerprint: "fp"} }))
	natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if n := len(watcher.Instances(wire.RolePrefill, time.Now())); n != 2 {
			return fmt.Errorf("%d instances", n)
		}
		return nil
	})
	require.Contains(t, logs.String(), "registry watch restarted on a new bucket")
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		require.Empty(t, duplicateKeys(t, line), line)
	}
}
