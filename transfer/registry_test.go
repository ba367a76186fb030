package transfer

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/transfer/wire"
)

// An announcer whose wall clock is a minute off ours (either way) is live
// for as long as its entry is refreshed, and only as long: liveness is the
// time this host received the entry, not the announcer's timestamp.
func TestRegistryClockSkew(t *testing.T) {
	s := natstest.Run(t)
	nc := natstest.Connect(t, s)
	ctx := context.Background()
	reg, err := openRegistry(ctx, nc, RegistryConfig{Namespace: "skew", TTL: 2 * time.Second, Heartbeat: time.Second})
	require.NoError(t, err)
	defer reg.close(ctx)
	require.NoError(t, reg.watch(ctx, wire.RolePrefill))
	for _, skew := range []time.Duration{-time.Minute, time.Minute} {
		id := fmt.Sprintf("skew%d", int(skew.Minutes())+1)
		b, err := wire.EncodeInstance(wire.Instance{ID: id, Role: wire.RolePrefill, Fingerprint: "fp", Updated: time.Now().Add(skew).UnixNano()})
		require.NoError(t, err)
		_, err = reg.bucket().Put(ctx, registryKey(wire.RolePrefill, id), b)
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return len(reg.Instances(wire.RolePrefill, time.Now())) == 2 }, 5*time.Second, 10*time.Millisecond,
		"an announcer a minute off this host's clock is hidden")
	// Not refreshed: gone after the TTL, whatever its timestamps say.
	require.Eventually(t, func() bool { return len(reg.Instances(wire.RolePrefill, time.Now())) == 0 }, 10*time.Second, 50*time.Millisecond)
}

// An entry put under an id by another micro service than the one it
// replaces is another process: the instance restarted under the same id
// before its entry expired. Watchers hear the old incarnation gone, then
// the new one; a heartbeat of the same process is only a change.
func TestRegistryReportsRestartUnderSameID(t *testing.T) {
	s := natstest.Run(t)
	nc := natstest.Connect(t, s)
	ctx := context.Background()
	reg, err := openRegistry(ctx, nc, RegistryConfig{Namespace: "restart"})
	require.NoError(t, err)
	defer reg.close(ctx)
	type change struct {
		svc  string
		gone bool
	}
	changes := make(chan change, 16)
	reg.onChange(func(inst wire.Instance, gone bool) { changes <- change{inst.Service, gone} })
	require.NoError(t, reg.watch(ctx, wire.RolePrefill))
	key := registryKey(wire.RolePrefill, "p1")
	// Each put waits for the watch to report it: the bucket keeps one
	// revision per key, so a put the watch has not delivered yet is
	// replaced by the next one and never seen (as a heartbeat may be).
	for _, step := range []struct {
		svc  string
		want []change
	}{
		{"svc-a", []change{{"svc-a", false}}},
		{"svc-a", []change{{"svc-a", false}}}, // a heartbeat: only a change
		{"svc-b", []change{{"svc-a", true}, {"svc-b", false}}},
	} {
		require.NoError(t, reg.put(ctx, key, func() wire.Instance {
			return wire.Instance{ID: "p1", Role: wire.RolePrefill, Fingerprint: "fp", Service: step.svc}
		}))
		for i, w := range step.want {
			select {
			case c := <-changes:
				require.Equal(t, w, c, "put of %s: change %d", step.svc, i)
			case <-time.After(5 * time.Second):
				t.Fatalf("put of %s: change %d (%+v) not reported", step.svc, i, w)
			}
		}
	}
	select {
	case c := <-changes:
		t.Fatalf("a change no put made: %+v", c)
	default:
	}
	insts := reg.Instances(wire.RolePrefill, time.Now())
	require.Len(t, insts, 1)
	require.Equal(t, "svc-b", insts[0].Service)
}

// The mirror holds an entry by the id its value names, and a deletion
// names only its key: an entry whose value names another id or role than
// its key (a faulty or foreign writer) could never be removed nor reported
// gone once mirrored. It is refused, with a warning, and reported neither
// when it appears nor when it is deleted.
func TestRegistryRefusesEntryNotItsKeys(t *testing.T) {
	s := natstest.Run(t)
	nc := natstest.Connect(t, s)
	ctx := context.Background()
	var logs syncBuffer
	reg, err := openRegistry(ctx, nc, RegistryConfig{Namespace: "mismatch", Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	defer reg.close(ctx)
	type change struct {
		id   string
		gone bool
	}
	changes := make(chan change, 16)
	reg.onChange(func(inst wire.Instance, gone bool) { changes <- change{inst.ID, gone} })
	require.NoError(t, reg.watch(ctx, wire.RoleDecode))
	put := func(key string, inst wire.Instance) {
		b, err := wire.EncodeInstance(inst)
		require.NoError(t, err)
		_, err = reg.bucket().Put(ctx, key, b)
		require.NoError(t, err)
	}
	// The watch delivers the puts in their order: once the valid entry put
	// last (z) is reported, the ones before it were applied.
	reported := func(want change) {
		t.Helper()
		select {
		case c := <-changes:
			require.Equal(t, want, c, "only the valid entry's changes are reported")
		case <-time.After(5 * time.Second):
			t.Fatalf("%+v not reported", want)
		}
	}
	badID, badRole := registryKey(wire.RoleDecode, "a"), registryKey(wire.RoleDecode, "c")
	put(badID, wire.Instance{ID: "b", Role: wire.RoleDecode, Fingerprint: "fp"})
	put(badRole, wire.Instance{ID: "c", Role: wire.RolePrefill, Fingerprint: "fp"})
	put(registryKey(wire.RoleDecode, "z"), wire.Instance{ID: "z", Role: wire.RoleDecode, Fingerprint: "fp"})
	reported(change{"z", false})
	insts := reg.Instances(wire.RoleDecode, time.Now())
	require.Len(t, insts, 1)
	require.Equal(t, "z", insts[0].ID)
	require.Contains(t, logs.String(), "registry entry refused")
	for _, key := range []string{badID, badRole, registryKey(wire.RoleDecode, "z")} {
		require.NoError(t, reg.bucket().Delete(ctx, key))
	}
	reported(change{"z", true})
	reg.mu.Lock()
	defer reg.mu.Unlock()
	require.Empty(t, reg.entries, "an entry outlived its key's deletion")
}

// An old incarnation that finishes its drain after a new one announced
// itself under the same id deletes only its own entry: the new one's stays.
func TestRegistryCloseSparesNewIncarnation(t *testing.T) {
	s := natstest.Run(t)
	ctx := context.Background()
	open := func() *Registry {
		reg, err := openRegistry(ctx, natstest.Connect(t, s), RegistryConfig{Namespace: "incarnations"})
		require.NoError(t, err)
		return reg
	}
	self := func(svc string) func() wire.Instance {
		return func() wire.Instance {
			return wire.Instance{ID: "p1", Role: wire.RolePrefill, Fingerprint: "fp", Service: svc}
		}
	}
	old, fresh := open(), open()
	defer fresh.close(ctx)
	require.NoError(t, old.announce(ctx, self("svc-old")))
	require.NoError(t, fresh.announce(ctx, self("svc-new")))
	require.NoError(t, old.close(ctx))
	e, err := fresh.bucket().Get(ctx, registryKey(wire.RolePrefill, "p1"))
	require.NoError(t, err, "the old incarnation's close deleted the new one's entry")
	inst, err := wire.DecodeInstance(e.Value())
	require.NoError(t, err)
	require.Equal(t, "svc-new", inst.Service)
}

// On a single server the bucket has one replica (auto), and asking for
// more is refused by name.
func TestRegistryReplicasStandalone(t *testing.T) {
	s := natstest.Run(t)
	nc := natstest.Connect(t, s)
	ctx := context.Background()
	reg, err := openRegistry(ctx, nc, RegistryConfig{Namespace: "r1"})
	require.NoError(t, err)
	defer reg.close(ctx)
	require.Equal(t, 1, bucketReplicas(t, reg))
	_, err = openRegistry(ctx, nc, RegistryConfig{Namespace: "r3", Replicas: 3})
	require.ErrorContains(t, err, "replicas")
	_, err = openRegistry(ctx, nc, RegistryConfig{Namespace: "r9", Replicas: 9})
	require.ErrorIs(t, err, ErrInvalidConfig)
}

func bucketReplicas(t *testing.T, reg *Registry) int {
	t.Helper()
	st, err := reg.bucket().Status(context.Background())
	require.NoError(t, err)
	return st.(*jetstream.KeyValueBucketStatus).StreamInfo().Config.Replicas
}

// startCluster starts n JetStream servers routed to each other on loopback
// and returns them with their client URLs.
func startCluster(t *testing.T, n int) ([]*server.Server, []string) {
	t.Helper()
	ports := make([]int, 2*n)
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		ports[i] = l.Addr().(*net.TCPAddr).Port
		l.Close()
	}
	var routes []string
	for i := range n {
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", ports[n+i]))
	}
	servers := make([]*server.Server, n)
	urls := make([]string, n)
	for i := range n {
		opts := natstest.Options(t.TempDir())
		opts.ServerName = fmt.Sprintf("n%d", i+1)
		opts.Port = ports[i]
		opts.Cluster = server.ClusterOpts{Name: "handoff-test", Host: "127.0.0.1", Port: ports[n+i]}
		opts.Routes = server.RoutesFromStr(fmt.Sprintf("%s,%s,%s", routes[0], routes[1%n], routes[2%n]))
		s, err := natstest.Start(opts)
		require.NoError(t, err)
		t.Cleanup(func() { natstest.Stop(s) })
		servers[i], urls[i] = s, s.ClientURL()
	}
	return servers, urls
}

// On a 3-node cluster the bucket is replicated (auto), and discovery keeps
// working on the surviving nodes when the node a client was connected to
// dies.
func TestRegistryReplicatedOnCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a 3-node cluster")
	}
	servers, urls := startCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	connect := func(first int) *nats.Conn {
		nc, err := nats.Connect(urls[first]+","+urls[(first+1)%3]+","+urls[(first+2)%3],
			nats.DontRandomize(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
		require.NoError(t, err)
		t.Cleanup(nc.Close)
		return nc
	}
	announcer, watcher := connect(0), connect(1)
	var reg *Registry
	require.Eventually(t, func() bool { // the cluster elects its meta leader first
		actx, acancel := context.WithTimeout(ctx, 2*time.Second)
		defer acancel()
		var err error
		reg, err = openRegistry(actx, announcer, RegistryConfig{Namespace: "ha", TTL: 3 * time.Second, Heartbeat: 500 * time.Millisecond})
		return err == nil
	}, 20*time.Second, 200*time.Millisecond)
	defer reg.close(context.Background())
	require.Equal(t, 3, bucketReplicas(t, reg))
	require.NoError(t, reg.announce(ctx, func() wire.Instance { return wire.Instance{ID: "p1", Role: wire.RolePrefill, Fingerprint: "fp"} }))
	w, err := openRegistry(ctx, watcher, RegistryConfig{Namespace: "ha", TTL: 3 * time.Second, Heartbeat: 500 * time.Millisecond})
	require.NoError(t, err)
	defer w.close(context.Background())
	require.NoError(t, w.watch(ctx, wire.RolePrefill))
	require.Eventually(t, func() bool { return len(w.Instances(wire.RolePrefill, time.Now())) == 1 }, 10*time.Second, 20*time.Millisecond)

	// Stop the node that leads the bucket's stream (with one replica, the
	// only one holding it).
	st, err := reg.bucket().Status(ctx)
	require.NoError(t, err)
	leader := st.(*jetstream.KeyValueBucketStatus).StreamInfo().Cluster.Leader
	stopped := false
	for _, s := range servers {
		if s.Name() == leader {
			natstest.Stop(s)
			stopped = true
		}
	}
	require.True(t, stopped, "no server named %q", leader)
	// Both clients reconnect to a survivor where they need to; the entry
	// stays fresh and the watcher keeps seeing it well past the TTL.
	var lost time.Duration
	var lostAt time.Time
	for end := time.Now().Add(8 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		n := len(w.Instances(wire.RolePrefill, time.Now()))
		switch {
		case n == 0 && lostAt.IsZero():
			lostAt = time.Now()
		case n == 1 && !lostAt.IsZero():
			lost += time.Since(lostAt)
			t.Logf("discovery lost for %v", time.Since(lostAt))
			lostAt = time.Time{}
		}
	}
	require.True(t, lostAt.IsZero(), "discovery lost since %v with one node of three gone", time.Since(lostAt))
	// A blip while the cluster elects the stream's new leader (puts wait
	// for it), not an outage.
	require.Less(t, lost, 2*time.Second, "discovery lost for %v in all", lost)
	require.Equal(t, 3, bucketReplicas(t, w))
}

// A decoder whose wall clock is a minute off the prefill worker's: the
// request's absolute deadline is a minute in the past (or future) on the
// worker's clock, but the time it had left travels with it (Budget), and
// the worker serves it within that, by its own clock.
func TestPrefillDeadlineIgnoresClockSkew(t *testing.T) {
	for _, skew := range []time.Duration{-time.Minute, time.Minute} {
		t.Run(skew.String(), func(t *testing.T) {
			f := newFixture(t)
			ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
			x := newExec(ps)
			f.prefiller("p1", f.fp, x, nil)
			dest, err := ds.prepare(7, 9)
			require.NoError(t, err)
			defer ds.m.Free(7)
			g, err := ds.eng.OpenGrant(rdma.GrantSpec{RequestID: 7, Extents: dest.extents(), Deadline: time.Now().Add(10 * time.Second)})
			require.NoError(t, err)
			kv, mb := dest.bytes()
			req := wire.PrefillRequest{RequestID: 7, From: "d1", Attempt: 1, Fingerprint: f.fp, Tokens: tokens(9),
				Deadline: time.Now().Add(skew + 10*time.Second).UnixNano(), Budget: int64(10 * time.Second),
				Peer: wire.PeerOf(ds.eng.Descriptor()), Ticket: g.Ticket(), KVBytes: kv, MambaBytes: mb}
			b, err := wire.EncodePrefillRequest(req, 0)
			require.NoError(t, err)
			nc := natstest.Connect(t, f.srv)
			m, err := nc.Request(wire.Subject(wire.DefaultPrefix, f.ns, wire.SubjectPrefill, ""), b, 10*time.Second)
			require.NoError(t, err)
			rep, err := wire.DecodePrefillReply(m.Data)
			require.NoError(t, err)
			require.Equal(t, session.CodeOK, rep.Code, rep.Msg)
			_, err = g.Wait(context.Background())
			require.NoError(t, err)
		})
	}
}
