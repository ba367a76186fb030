package agent

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/rdma"
)

// TestMetrics: what two agents' metrics say after a send that landed, a
// grant revoked, a send refused by its ticket and a reserved row refused:
// each counted once, by its result, with the bytes of what landed only.
func TestMetrics(t *testing.T) {
	regA, regB := prometheus.NewRegistry(), prometheus.NewRegistry()
	sockA, agA, _ := serveAgent(t, Config{Name: "a", Transports: []rdma.Transport{rdma.TransportSHM}, Registerer: regA}, nil)
	sockB, agB, _ := serveAgent(t, Config{Name: "b", Transports: []rdma.Transport{rdma.TransportSHM}, Registerer: regB}, nil)
	a, b := register(t, sockA, tinyLayout()), register(t, sockB, tinyLayout())
	ma, mb := agA.m, agB.m
	ctx := ctxT(t)

	g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 7, Blocks: []int{9, 3}, Row: Row(1)}, nil)
	require.NoError(t, err)
	require.Equal(t, 1.0, testutil.ToFloat64(mb.openGrant))
	_, err = a.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{0, 1}, Row: Row(4)}, nil)
	require.NoError(t, err)
	sent := event(t, a, EvSendDone).Bytes
	require.Equal(t, sent, event(t, b, EvGrantDone).Bytes)
	want := 2*uint64(a.p.kv.BlockBytes()) + uint64(a.p.mamba.RowBytes())
	require.Equal(t, want, sent)

	g2, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 8, Blocks: []int{4}}, nil)
	require.NoError(t, err)
	_, err = b.c.Call(ctx, Request{Op: OpRevoke, Grant: g2.Grant}, nil)
	require.NoError(t, err)
	event(t, b, EvGrantFailed)
	// The ticket names one block and no row: a send of two is refused.
	_, err = a.c.Call(ctx, Request{Op: OpSend, Ticket: g2.Ticket, Blocks: []int{0, 1}}, nil)
	require.ErrorIs(t, err, ErrBadRequest)
	_, err = b.c.Call(ctx, Request{Op: OpGrant, RequestID: 9, Blocks: []int{1}, Row: Row(5)}, nil)
	require.ErrorIs(t, err, ErrReserved)
	// A send with wait is counted by its outcome, answered when it ends.
	_, err = a.c.Call(ctx, Request{Op: OpSend, Ticket: g2.Ticket, Blocks: []int{0}, Wait: true}, nil)
	var re *RemoteError
	require.ErrorAs(t, err, &re)
	require.Equal(t, 1.0, testutil.ToFloat64(ma.requests.WithLabelValues(OpSend, re.Code)), re.Code)

	for _, c := range []struct {
		name string
		c    prometheus.Collector
		want float64
	}{
		{"a: engines", ma.engines, 1},
		{"a: sends ok", ma.sends.WithLabelValues("ok"), 1},
		{"a: bytes sent", ma.bytes.WithLabelValues(dirSent), float64(want)},
		{"a: send requests ok", ma.requests.WithLabelValues(OpSend, "ok"), 1},
		{"a: send requests refused", ma.requests.WithLabelValues(OpSend, "bad_request"), 1},
		{"b: grants open", mb.openGrant, 0},
		{"b: grants ok", mb.grants.WithLabelValues("ok"), 1},
		{"b: grants revoked", mb.grants.WithLabelValues("revoked"), 1},
		{"b: bytes received", mb.bytes.WithLabelValues(dirReceived), float64(want)},
		{"b: grant requests ok", mb.requests.WithLabelValues(OpGrant, "ok"), 2},
		{"b: grant requests reserved", mb.requests.WithLabelValues(OpGrant, "reserved"), 1},
		{"b: revoke requests ok", mb.requests.WithLabelValues(OpRevoke, "ok"), 1},
	} {
		require.Equal(t, c.want, testutil.ToFloat64(c.c), c.name)
	}
	require.Zero(t, testutil.CollectAndCount(ma.grants), "a grants nothing")
	require.Zero(t, testutil.CollectAndCount(mb.sends), "b sends nothing")
	require.EqualValues(t, 2, sendsTimed(t, regA)) // the send, and the send with wait
	// What the registry exports is what the collectors hold.
	n, err := testutil.GatherAndCount(regB, "handoff_agent_grants_total", "handoff_agent_requests_total")
	require.NoError(t, err)
	require.Equal(t, 2+5, n) // ok and revoked; grant ok and reserved, hello, register, revoke

	// An engine that leaves is counted no longer.
	a.c.Close()
	require.Eventually(t, func() bool { return testutil.ToFloat64(ma.engines) == 0 }, 5*time.Second, 5*time.Millisecond)
}

// sendsTimed is how many sends the registry's duration histogram holds.
func sendsTimed(t *testing.T, reg prometheus.Gatherer) uint64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == "handoff_agent_send_duration_seconds" {
			return mf.GetMetric()[0].GetHistogram().GetSampleCount()
		}
	}
	t.Fatal("no handoff_agent_send_duration_seconds")
	return 0
}

// TestMetricsOneAgentPerRegistry: a second agent given a registry that
// holds the first's metrics is refused with an error (not a panic) before
// it makes its socket.
func TestMetricsOneAgentPerRegistry(t *testing.T) {
	reg := prometheus.NewRegistry()
	serveAgent(t, Config{Name: "a", Registerer: reg}, nil)
	sock := filepath.Join(t.TempDir(), "b", "b.sock")
	_, err := New(Config{Name: "b", Socket: sock, Registerer: reg, Logger: quiet()}, nil)
	require.ErrorContains(t, err, "agent: metrics")
	require.NoFileExists(t, sock)
}
