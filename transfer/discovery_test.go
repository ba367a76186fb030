package transfer

// How decoders find prefill workers over NATS: the micro service listing,
// registry expiry and watch, and a worker that is resubscribing.

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/leakcheck"
	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/transfer/wire"
)

// A prefill worker that is not there yet (restarting, or resubscribing
// after a NATS reconnect) when a request is sent serves it once it is: the
// request is sent again with a backoff instead of failing at once.
func TestHandoffWaitsForPrefillWorker(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoResponderWait = 10 * time.Second })
	type out struct {
		res Result
		err error
	}
	done := make(chan out, 1)
	go func() {
		res, err := ds.handoff(context.Background(), d, Request{ID: 4, Tokens: tokens(9), Deadline: time.Now().Add(20 * time.Second)})
		done <- out{res, err}
	}()
	time.Sleep(400 * time.Millisecond)
	f.prefiller("p1", f.fp, newExec(ps), nil)
	o := <-done
	require.NoError(t, o.err)
	require.Equal(t, int32(4), o.res.FirstToken)
	require.Greater(t, o.res.Attempts, 1)
	require.NoError(t, ds.m.Free(4))
	ds.requireInitial(t)
	ps.requireInitial(t)
}

func TestMicroServiceListed(t *testing.T) {
	f := newFixture(t)
	ps := newSide(t, "pre", testHybrid(64, 8))
	f.prefiller("p1", f.fp, newExec(ps), nil)
	nc := natstest.Connect(t, f.srv)
	m, err := nc.Request("$SRV.INFO."+wire.ServiceName, nil, 5*time.Second)
	require.NoError(t, err)
	s := string(m.Data)
	require.Contains(t, s, `"name":"handoff-prefill"`)
	require.Contains(t, s, wire.Subject(wire.DefaultPrefix, f.ns, wire.SubjectPrefill, ""))
	require.Contains(t, s, `"queue_group":"prefill"`)
	require.Contains(t, s, wire.Subject(wire.DefaultPrefix, f.ns, wire.SubjectInstancePrefill, "p1"))
	require.Contains(t, s, `"fingerprint":"fp-tiny"`)
}

func TestRegistryExpiry(t *testing.T) {
	leakcheck.Check(t)
	srv := natstest.Run(t)
	nc := natstest.Connect(t, srv)
	ctx := context.Background()
	cfg := RegistryConfig{Namespace: "t1", TTL: time.Second}
	watcher, err := openRegistry(ctx, nc, cfg)
	require.NoError(t, err)
	defer watcher.close(ctx)
	gone := make(chan string, 4)
	watcher.onChange(func(inst wire.Instance, g bool) {
		if g {
			gone <- inst.ID
		}
	})
	require.NoError(t, watcher.watch(ctx, wire.RolePrefill))

	// A live instance, refreshed by heartbeats, and one that stops.
	live, err := openRegistry(ctx, natstest.Connect(t, srv), RegistryConfig{Namespace: "t1", TTL: time.Second, Heartbeat: 200 * time.Millisecond})
	require.NoError(t, err)
	defer live.close(ctx)
	require.NoError(t, live.announce(ctx, func() wire.Instance { return wire.Instance{ID: "p-live", Role: wire.RolePrefill, Fingerprint: "fp"} }))
	dead, err := openRegistry(ctx, natstest.Connect(t, srv), cfg)
	require.NoError(t, err)
	require.NoError(t, dead.put(ctx, registryKey(wire.RolePrefill, "p-dead"), func() wire.Instance {
		return wire.Instance{ID: "p-dead", Role: wire.RolePrefill, Fingerprint: "fp"}
	}))
	require.NoError(t, dead.close(ctx))
	waitKnown(t, watcher, wire.RolePrefill, 2)
	// The stopped one expires: locally by its age, then by the server's marker.
	select {
	case id := <-gone:
		require.Equal(t, "p-dead", id)
	case <-time.After(10 * time.Second):
		t.Fatal("no expiry seen")
	}
	got := watcher.Instances(wire.RolePrefill, time.Now())
	require.Len(t, got, 1)
	require.Equal(t, "p-live", got[0].ID)
	require.Empty(t, watcher.Instances(wire.RoleDecode, time.Now()))
	require.Empty(t, watcher.Instances(wire.RolePrefill, time.Now().Add(2*time.Second)), "local ttl check")
}

// nats.go ends a KV watch when the context it was created with ends, so the
// registry must not create it with watch's ctx, which only bounds the wait for
// the initial entries.
func TestRegistryWatchOutlivesItsContext(t *testing.T) {
	leakcheck.Check(t)
	srv := natstest.Run(t)
	cfg := RegistryConfig{Namespace: "t1", TTL: 30 * time.Second}
	watcher, err := openRegistry(context.Background(), natstest.Connect(t, srv), cfg)
	require.NoError(t, err)
	defer watcher.close(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	require.NoError(t, watcher.watch(ctx, wire.RolePrefill))
	cancel()

	time.Sleep(50 * time.Millisecond) // let a watch bound to ctx end
	late, err := openRegistry(context.Background(), natstest.Connect(t, srv), cfg)
	require.NoError(t, err)
	defer late.close(context.Background())
	require.NoError(t, late.announce(context.Background(), func() wire.Instance {
		return wire.Instance{ID: "p-late", Role: wire.RolePrefill, Fingerprint: "fp"}
	}))
	waitKnown(t, watcher, wire.RolePrefill, 1)
}
