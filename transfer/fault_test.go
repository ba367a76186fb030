package transfer

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/internal/faultnet"
	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/wire"
)

// Data-path faults between real prefill and decode workers: the decoder's
// engine advertises a fault-injecting proxy (internal/faultnet) as its tcp
// address, so every write of every prefiller goes through it. Each test
// checks that the handoff ends within its deadline (retried, fenced, where
// the protocol allows), that no byte lands in the decoder's regions after
// the handoff returned a failure (snapshot then, compared once every
// proxied connection drained), and that both sides' pools and the decoder's
// grants return to idle.

// newSideVia is newSide over tcp, its engine advertising a proxy in front
// of its listener; the proxy closes on cleanup.
func newSideVia(t *testing.T, agent string, cfg hybrid.Config) (*side, *faultnet.Proxy) {
	t.Helper()
	var eng *rdma.Engine
	var proxy *faultnet.Proxy
	for try := 0; ; try++ {
		// The engine's listen address must be known before it starts, to
		// advertise the proxy in front of it: take a free port, and try
		// again if another process took it meanwhile.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		addr := ln.Addr().String()
		require.NoError(t, ln.Close())
		proxy = faultnet.Start(t, addr)
		eng, err = rdma.New(rdma.Config{Agent: rdma.AgentID(agent), Transports: []rdma.Transport{rdma.TransportTCP},
			TCPAddr: addr, Advertise: proxy.Addr(), Logger: slog.New(slog.DiscardHandler)})
		if err == nil {
			break
		}
		require.Less(t, try, 5, "no free port: %v", err)
		require.NoError(t, proxy.Close())
	}
	s := sideOf(t, eng, cfg)
	return s, proxy
}

// sideOf is newSideOn over an engine the caller built.
func sideOf(t *testing.T, eng *rdma.Engine, cfg hybrid.Config) *side {
	t.Helper()
	t.Cleanup(func() { _ = eng.Close() })
	m, err := hybrid.New(cfg)
	require.NoError(t, err)
	kv, err := eng.Register("kv", cfg.KV.ArenaBytes())
	require.NoError(t, err)
	mr, err := eng.Register("mamba", cfg.Mamba.ArenaBytes())
	require.NoError(t, err)
	rank, err := NewRankRegions(m, kv, mr)
	require.NoError(t, err)
	return &side{eng: eng, m: m, rank: rank, regions: map[rdma.RegionID]*rdma.Region{kv.ID(): kv, mr.ID(): mr}, initial: m.Stats()}
}

// snapshot copies every region of s.
func (s *side) snapshot() map[rdma.RegionID][]byte {
	m := make(map[rdma.RegionID][]byte, len(s.regions))
	for id, r := range s.regions {
		m[id] = bytes.Clone(r.Bytes())
	}
	return m
}

func (s *side) requireSnapshot(t *testing.T, snap map[rdma.RegionID][]byte, msg string) {
	t.Helper()
	for id, r := range s.regions {
		require.True(t, bytes.Equal(snap[id], r.Bytes()), "region %d: %s", id, msg)
	}
}

// requireIdle checks the decoder's pools are back to their initial state
// and its engine holds no grant.
func (s *side) requireIdle(t *testing.T) {
	t.Helper()
	s.requireInitial(t)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if st := s.eng.Stats(); st.GrantsOpen != 0 || st.QuarantinedBytes != 0 {
			return fmt.Errorf("engine not idle: %+v", st)
		}
		return nil
	})
}

// drain lifts every fault, closes the writers' engines and waits until the
// proxy carried every connection to its end: what it still held reached
// the receiver, which read it to the end.
func drain(t *testing.T, proxy *faultnet.Proxy, writers ...*side) {
	t.Helper()
	proxy.SetLatency(0)
	proxy.SetBandwidth(0)
	proxy.Heal()
	for _, w := range writers {
		require.NoError(t, w.eng.Close())
	}
	natstest.CheckFor(t, 10*time.Second, time.Millisecond, func() error {
		if st := proxy.Stats(); st.Live != 0 {
			return fmt.Errorf("proxied connections still open: %+v", st)
		}
		return nil
	})
}

func requirePattern(t *testing.T, ds *side, res Result, id uint64) {
	t.Helper()
	i := 0
	for _, e := range ds.dest(id).extents() {
		for _, b := range ds.bytes(e) {
			if b != pattern(id, i) {
				t.Fatalf("request %d byte %d: %#x, want %#x", id, i, b, pattern(id, i))
			}
			i++
		}
	}
}

// faultCfg is big enough that a handoff of faultTokens is many frames.
func faultCfg() hybrid.Config { return testHybrid(256, 8) }

const faultTokens = 600 // 150 KV blocks of 256 bytes, and a Mamba row

// TestReleaseBeforeReply: a prefill worker whose pools hold one request
// at a time serves requests sent back to back, each the moment the last
// was delivered: it releases a request's resources before it replies
// (CI found it replying first: the next request, arriving before the
// release, was refused for capacity and failed). Release is slowed to
// make that window wide.
func TestReleaseBeforeReply(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", faultCfg())
	ps := newSide(t, "pre", faultCfg())
	d := f.decoder("d1", ds, nil)
	x := newExec(ps)
	x.slowRelease = 50 * time.Millisecond
	p := f.prefiller("p1", f.fp, x, nil)
	for id := uint64(1); id <= 3; id++ {
		res, err := ds.handoff(context.Background(), d, Request{ID: id, Tokens: tokens(faultTokens), Deadline: time.Now().Add(10 * time.Second)})
		require.NoError(t, err, "request %d", id)
		requirePattern(t, ds, res, id)
		require.NoError(t, ds.m.Free(id))
	}
	require.Equal(t, uint64(3), p.Stats().Served)
	require.Zero(t, p.Stats().Refused)
}

// TestFaultHandoffSlowLink: added latency and a bandwidth cap on the data
// path; every handoff succeeds, whole, within its deadline.
func TestFaultHandoffSlowLink(t *testing.T) {
	f := newFixture(t)
	ds, proxy := newSideVia(t, "dec", faultCfg())
	ps := newSideOn(t, "pre", faultCfg(), rdma.TransportTCP)
	d := f.decoder("d1", ds, nil)
	p := f.prefiller("p1", f.fp, newExec(ps), nil)
	proxy.SetLatency(20 * time.Millisecond)
	proxy.SetBandwidth(256 << 10)
	for id := uint64(1); id <= 3; id++ {
		start := time.Now()
		res, err := ds.handoff(context.Background(), d, Request{ID: id, Tokens: tokens(faultTokens), Deadline: time.Now().Add(10 * time.Second)})
		require.NoError(t, err)
		require.GreaterOrEqual(t, time.Since(start), 40*time.Millisecond, "a round trip on the data path")
		requirePattern(t, ds, res, id)
		require.NoError(t, ds.m.Free(id))
	}
	require.Greater(t, proxy.Stats().UpBytes, int64(3*150*256))
	ds.requireIdle(t)
	ps.requireInitial(t)
	require.Equal(t, uint64(3), p.Stats().Served)
}

// TestFaultHandoffResetMidFrame: the connection of the serving prefill
// worker is reset inside a data frame. The decoder retries, fenced (the old
// grant revoked, a fresh one over the same blocks and row), on the other
// live worker, and the handoff succeeds well within its deadline.
func TestFaultHandoffResetMidFrame(t *testing.T) {
	f := newFixture(t)
	ds, proxy := newSideVia(t, "dec", faultCfg())
	ps1 := newSideOn(t, "pre1", faultCfg(), rdma.TransportTCP)
	ps2 := newSideOn(t, "pre2", faultCfg(), rdma.TransportTCP)
	x1, x2 := newExec(ps1), newExec(ps2)
	f.prefiller("p1", f.fp, x1, withRegistryP)
	f.prefiller("p2", f.fp, x2, withRegistryP)
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoRegistry, c.DirectFirst = false, true })
	waitKnown(t, d.Registry(), wire.RolePrefill, 2)
	// Past the hellos of both workers' pre-connects, inside the first
	// handoff's data.
	fired := proxy.ResetAfter(4096)
	start := time.Now()
	const deadline = 20 * time.Second
	res, err := ds.handoff(context.Background(), d, Request{ID: 5, Tokens: tokens(faultTokens), Deadline: time.Now().Add(deadline)})
	require.NoError(t, err)
	select {
	case <-fired:
	case <-time.After(5 * time.Second):
		t.Fatal("the reset did not happen")
	}
	require.Less(t, time.Since(start), deadline/2, "the retry waited for the deadline")
	require.Equal(t, 2, res.Attempts)
	requirePattern(t, ds, res, 5)
	landed := ds.snapshot()
	drain(t, proxy, ps1, ps2)
	ds.requireSnapshot(t, landed, "bytes landed after the handoff")
	require.NoError(t, ds.m.Free(5))
	ds.requireIdle(t)
	ps1.requireInitial(t)
	ps2.requireInitial(t)
	require.Equal(t, int64(1), proxy.Stats().Resets)
}

// TestFaultHandoffResetWriterFirst is TestFaultHandoffResetMidFrame with
// the order of the two ends' news fixed: the serving worker's connection is
// reset mid-frame, but the decoder's side of it stays open and silent, so
// the worker's reply (peer_failed: its write failed) reaches the decoder
// before any failure of the grant. The cause is the same as when the grant
// fails first, and so must be the outcome: a fenced retry on the other live
// worker, within the deadline.
func TestFaultHandoffResetWriterFirst(t *testing.T) {
	f := newFixture(t)
	ds, proxy := newSideVia(t, "dec", faultCfg())
	ps1 := newSideOn(t, "pre1", faultCfg(), rdma.TransportTCP)
	ps2 := newSideOn(t, "pre2", faultCfg(), rdma.TransportTCP)
	f.prefiller("p1", f.fp, newExec(ps1), withRegistryP)
	f.prefiller("p2", f.fp, newExec(ps2), withRegistryP)
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoRegistry, c.DirectFirst = false, true })
	waitKnown(t, d.Registry(), wire.RolePrefill, 2)
	fired := proxy.ResetClientAfter(4096)
	start := time.Now()
	const deadline = 20 * time.Second
	res, err := ds.handoff(context.Background(), d, Request{ID: 5, Tokens: tokens(faultTokens), Deadline: time.Now().Add(deadline)})
	select {
	case <-fired:
	case <-time.After(5 * time.Second):
		t.Fatal("the reset did not happen")
	}
	require.NoError(t, err, "a writer's reset reported by its reply is not retried")
	require.Less(t, time.Since(start), deadline/2, "the retry waited for the deadline")
	require.Equal(t, 2, res.Attempts)
	requirePattern(t, ds, res, 5)
	landed := ds.snapshot()
	// The decoder's side of the cut connection, held open until now, is
	// reset at last: the old grant's failure arrives after the handoff.
	proxy.Reset()
	drain(t, proxy, ps1, ps2)
	ds.requireSnapshot(t, landed, "bytes landed after the handoff")
	require.NoError(t, ds.m.Free(5))
	ds.requireIdle(t)
	ps1.requireInitial(t)
	ps2.requireInitial(t)
}

// TestFaultHandoffHalfOpen: the data path of the serving worker stops
// inside a data frame without FIN or RST, sockets open. The handoff fails
// with ErrTimeout by its deadline on the decoder; the worker's write ends
// by its own deadline and it frees; when the path comes back, what it held
// lands nowhere.
func TestFaultHandoffHalfOpen(t *testing.T) {
	f := newFixture(t)
	ds, proxy := newSideVia(t, "dec", faultCfg())
	ps := newSideOn(t, "pre", faultCfg(), rdma.TransportTCP)
	x := newExec(ps)
	d := f.decoder("d1", ds, nil)
	p := f.prefiller("p1", f.fp, x, nil)
	fired := proxy.BlackholeAfter(4096)
	const deadline = 500 * time.Millisecond
	start := time.Now()
	_, err := ds.handoff(context.Background(), d, Request{ID: 6, Tokens: tokens(faultTokens), Deadline: time.Now().Add(deadline)})
	took := time.Since(start)
	snap := ds.snapshot()
	require.ErrorIs(t, err, ErrTimeout)
	require.Less(t, took, deadline+time.Second, "the handoff outlived its deadline")
	<-fired
	ds.requireIdle(t)
	ps.requireInitial(t)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if st := p.Stats(); st.InFlight != 0 {
			return fmt.Errorf("%d in flight", st.InFlight)
		}
		return nil
	})
	require.Equal(t, int64(1), x.releases.Load())

	drain(t, proxy, ps) // heals first: the held bytes arrive now
	ds.requireSnapshot(t, snap, "bytes landed after the handoff failed")
	require.Zero(t, proxy.Stats().Resets)
}

// TestFaultHandoffHalfOpenCancel: the caller cancels a handoff whose data
// path went silent inside a frame, long before its deadline. The decoder
// must fence the grant itself (its deadline is far): the handoff returns
// ErrCancelled at once, the grant is gone, the worker stops on the cancel
// message and frees, and what the path held when it comes back lands
// nowhere, although the blocks were freed.
func TestFaultHandoffHalfOpenCancel(t *testing.T) {
	f := newFixture(t)
	ds, proxy := newSideVia(t, "dec", faultCfg())
	ps := newSideOn(t, "pre", faultCfg(), rdma.TransportTCP)
	x := newExec(ps)
	d := f.decoder("d1", ds, nil)
	p := f.prefiller("p1", f.fp, x, nil)
	fired := proxy.BlackholeAfter(4096)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-fired
		cancel()
	}()
	start := time.Now()
	_, err := ds.handoff(ctx, d, Request{ID: 7, Tokens: tokens(faultTokens), Deadline: time.Now().Add(time.Minute)})
	snap := ds.snapshot()
	require.ErrorIs(t, err, ErrCancelled)
	require.Less(t, time.Since(start), 5*time.Second)
	ds.requireIdle(t)
	ps.requireInitial(t)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if st := p.Stats(); st.InFlight != 0 {
			return fmt.Errorf("%d in flight", st.InFlight)
		}
		return nil
	})

	drain(t, proxy, ps)
	ds.requireSnapshot(t, snap, "bytes landed after the handoff was cancelled")
}
