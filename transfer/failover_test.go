package transfer

// A worker dies (or looks dead) mid-handoff: the decoder fails or retries
// on another worker, the prefiller stops when its decoder dies, and a live
// writer that replaces a connection is not taken for dead.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/transfer/wire"
)

// TestHandoffPrefillDeath: the serving worker disappears from the registry
// mid-prefill; the decoder fails at once with ErrPeerFailed.
func TestHandoffPrefillDeath(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	p := f.prefiller("p1", f.fp, x, withRegistryP)
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoRegistry, c.DirectFirst = false, true })
	waitKnown(t, d.Registry(), wire.RolePrefill, 1)
	go func() {
		<-x.started
		// What expiry of the worker's entry looks like to watchers.
		require.NoError(t, p.registry().kv.Delete(context.Background(), registryKey(wire.RolePrefill, "p1")))
	}()
	start := time.Now()
	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
	require.ErrorIs(t, err, ErrPeerFailed)
	require.Less(t, time.Since(start), 30*time.Second)
	ds.requireInitial(t)
	// The worker is alive after all: it gets the cancel and stops.
	require.ErrorIs(t, <-x.ctxErr, context.Canceled)
	ps.requireInitial(t)
}

// TestPrefillerStopsOnDecodeDeath: the requesting decode instance leaves the
// registry; the worker stops its prefill, frees and replies peer_failed.
// The decoder was alive after all: the worker replied, so it lives too, and
// it serves the fenced retry (the only instance, through the queue group).
func TestPrefillerStopsOnDecodeDeath(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	p := f.prefiller("p1", f.fp, x, withRegistryP)
	d := f.decoder("d1", ds, withRegistry)
	waitKnown(t, p.registry(), wire.RoleDecode, 1)
	// The worker pre-connected its data plane to the decode instance it saw.
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if tr, ok := ps.eng.TransportFor("dec"); !ok || tr != rdma.TransportInproc {
			return fmt.Errorf("not connected (%q)", tr)
		}
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := ds.handoff(ctx, d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done <- err
	}()
	<-x.started
	require.NoError(t, d.Registry().kv.Delete(context.Background(), registryKey(wire.RoleDecode, "d1")))
	require.ErrorIs(t, <-x.ctxErr, context.Canceled)
	// The fenced retry reaches the same worker, which serves it.
	require.Equal(t, uint64(3), <-x.started)
	close(x.block)
	err := <-done
	cancel()
	require.NoError(t, err)
	require.Equal(t, uint64(1), p.Stats().Served)
	require.Equal(t, uint64(1), p.Stats().Failed, "the stopped prefill")
	ps.requireInitial(t)
	require.NoError(t, ds.m.Free(3))
	ds.requireInitial(t)
}

// restartedDecoder is a decode instance's config for a test where another
// process takes its id over while it lives: it must not heartbeat its entry
// back over the new incarnation's while the test runs (a dead one would
// not).
func restartedDecoder(c *DecoderConfig) {
	c.NoRegistry, c.Registry.Heartbeat = false, 25*time.Second
}

// TestPrefillerStopsOnDecodeRestart: the requesting decode instance restarts
// under the same id (a pod keeps $POD_NAME) before its entry expired. The
// new incarnation's entry is the old one's death, as a deletion is
// (TestPrefillerStopsOnDecodeDeath): the worker stops the old one's prefill
// at once, not at its deadline a minute later, and serves the new one.
func TestPrefillerStopsOnDecodeRestart(t *testing.T) {
	f := newFixture(t)
	ds, ds2, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "dec2", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	p := f.prefiller("p1", f.fp, x, withRegistryP)
	old := f.decoder("d1", ds, restartedDecoder)
	waitKnown(t, p.registry(), wire.RoleDecode, 1)
	oldDone := ds.handoffAsync(old, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
	require.Equal(t, uint64(3), <-x.started)
	fresh := f.decoder("d1", ds2, withRegistry)
	select {
	case err := <-x.ctxErr:
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(5 * time.Second):
		t.Fatal("the old incarnation's prefill still runs 5s after its decode instance restarted under its id")
	}
	// The old incarnation, alive in this test, retries (fenced) as after
	// any death, and is served.
	require.Equal(t, uint64(3), <-x.started)
	close(x.block)
	res, err := ds2.handoff(context.Background(), fresh, Request{ID: 4, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
	require.NoError(t, err)
	require.Equal(t, 1, res.Attempts)
	ds2.requirePattern(t, 4)
	out := <-oldDone
	require.NoError(t, out.err)
	require.Equal(t, uint64(1), p.Stats().Failed, "the stopped prefill")
	ps.requireInitial(t)
	require.NoError(t, ds.m.Free(3))
	require.NoError(t, ds2.m.Free(4))
	ds.requireInitial(t)
	ds2.requireInitial(t)
}

// TestDecodeRestartSparesNewIncarnation: the restarted decode instance's
// request reaches the worker before its registry entry does (the watch lags
// behind). When the entry comes, the old incarnation's prefill is stopped,
// but not the new one's: its replies go to the new incarnation's inbox, and
// aborting it would cost the new process a retry for nothing.
func TestDecodeRestartSparesNewIncarnation(t *testing.T) {
	f := newFixture(t)
	ds, ds2, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "dec2", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	p := f.prefiller("p1", f.fp, x, withRegistryP)
	old := f.decoder("d1", ds, restartedDecoder)
	waitKnown(t, p.registry(), wire.RoleDecode, 1)
	oldDone := ds.handoffAsync(old, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
	require.Equal(t, uint64(3), <-x.started)
	// The new incarnation announces nothing itself: its entry is put by
	// hand once its request runs, which orders the two.
	fresh := f.decoder("d1", ds2, nil)
	freshDone := ds2.handoffAsync(fresh, Request{ID: 4, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
	require.Equal(t, uint64(4), <-x.started)
	b, err := wire.EncodeInstance(fresh.self())
	require.NoError(t, err)
	_, err = p.registry().bucket().Put(context.Background(), registryKey(wire.RoleDecode, "d1"), b)
	require.NoError(t, err)
	select {
	case err := <-x.ctxErr:
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(5 * time.Second):
		t.Fatal("the old incarnation's prefill still runs 5s after its decode instance restarted under its id")
	}
	close(x.block)
	out := <-freshDone
	require.NoError(t, out.err)
	require.Equal(t, 1, out.res.Attempts, "the new incarnation's prefill was stopped too")
	ds2.requirePattern(t, 4)
	out = <-oldDone
	require.NoError(t, out.err)
	require.Equal(t, uint64(1), p.Stats().Failed, "the old incarnation's stopped prefill")
	ps.requireInitial(t)
	require.NoError(t, ds.m.Free(3))
	require.NoError(t, ds2.m.Free(4))
	ds.requireInitial(t)
	ds2.requireInitial(t)
}

// TestHandoffPrefillDeathRetried: the worker that took the request leaves the
// registry before any commit; the decoder revokes the grant, opens a fresh one
// over the same blocks and row, and the other worker serves the request. The
// "dead" worker was only partitioned: a write with its old ticket is refused
// and changes no byte.
func TestHandoffPrefillDeathRetried(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(64, 8))
	ps := map[string]*side{"p1": newSide(t, "pre1", testHybrid(64, 8)), "p2": newSide(t, "pre2", testHybrid(64, 8))}
	xs := map[string]*testExec{}
	pre := map[string]*Prefiller{}
	for _, name := range []string{"p1", "p2"} {
		xs[name] = newExec(ps[name])
		xs[name].block = make(chan struct{})
		pre[name] = f.prefiller(name, f.fp, xs[name], withRegistryP)
	}
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoRegistry, c.DirectFirst = false, true })
	waitKnown(t, d.Registry(), wire.RolePrefill, 2)
	// Every request addressed to an instance, as sent.
	nc := natstest.Connect(t, f.srv)
	sent := make(chan wire.PrefillRequest, 8)
	sub, err := nc.Subscribe(wire.Subject(wire.DefaultPrefix, f.ns, wire.SubjectInstancePrefill, "*"), func(m *nats.Msg) {
		if r, err := wire.DecodePrefillRequest(m.Data); err == nil {
			sent <- r
		}
	})
	require.NoError(t, err)
	defer sub.Unsubscribe()
	require.NoError(t, nc.Flush())

	type out struct {
		res Result
		err error
	}
	done := make(chan out, 1)
	go func() {
		res, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done <- out{res, err}
	}()
	var dead, live string
	select {
	case <-xs["p1"].started:
		dead, live = "p1", "p2"
	case <-xs["p2"].started:
		dead, live = "p2", "p1"
	}
	first := <-sent
	require.Equal(t, uint8(1), first.Attempt)
	// What expiry of the worker's entry looks like to watchers.
	require.NoError(t, pre[dead].registry().kv.Delete(context.Background(), registryKey(wire.RolePrefill, dead)))
	<-xs[live].started
	second := <-sent
	require.Equal(t, uint8(2), second.Attempt)
	require.NotEqual(t, first.Ticket.Grant, second.Ticket.Grant, "the retry writes into a fresh grant")
	close(xs[live].block)
	o := <-done
	require.NoError(t, o.err)
	require.Equal(t, live, o.res.Instance)
	require.Equal(t, 2, o.res.Attempts)
	require.Equal(t, int32(3), o.res.FirstToken)
	checkPattern := func() { ds.requirePattern(t, 3) }
	checkPattern()
	// The dead worker was alive after all: it got the cancel and stopped.
	require.ErrorIs(t, <-xs[dead].ctxErr, context.Canceled)

	// A late write with the dead worker's ticket is refused by the data plane.
	old := first.Ticket
	src, err := ps[dead].prepare(99, 9)
	require.NoError(t, err)
	for _, e := range src.extents() {
		for j, b := 0, ps[dead].bytes(e); j < len(b); j++ {
			b[j] = 0xEE
		}
	}
	_, err = ps[dead].eng.Write(context.Background(), first.Peer.Descriptor(), old, src.extents())
	require.Error(t, err)
	require.Equal(t, session.CodeCancelled, rdmaCode(err), "late write: %v", err) // revoked, unknown or stale grant
	require.NoError(t, ps[dead].m.Free(99))
	checkPattern()

	require.NoError(t, ds.m.Free(3))
	ds.requireInitial(t)
	ps["p1"].requireInitial(t)
	ps["p2"].requireInitial(t)
	require.Equal(t, uint64(1), d.Stats().Retries)
}

// TestHandoffWriterGoneRetried: the prefill worker serving a handoff is
// killed (its NATS connection and its engine close, as the kernel closes a
// killed process's sockets) while its registry entry stays fresh. The
// decoder learns it from its own engine, finds that the worker does not
// answer on the control plane either, fences the grant and retries on the
// other worker.
func TestHandoffWriterGoneRetried(t *testing.T) {
	f := newFixture(t)
	ds := newSideOn(t, "dec", testHybrid(64, 8), rdma.TransportTCP)
	ps := map[string]*side{
		"p1": newSideOn(t, "p1", testHybrid(64, 8), rdma.TransportTCP),
		"p2": newSideOn(t, "p2", testHybrid(64, 8), rdma.TransportTCP),
	}
	xs := map[string]*testExec{}
	pfs := map[string]*Prefiller{}
	for _, name := range []string{"p1", "p2"} {
		xs[name] = newExec(ps[name])
		xs[name].block = make(chan struct{})
		pfs[name] = f.prefiller(name, f.fp, xs[name], withRegistryP)
	}
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoRegistry, c.DirectFirst = false, true })
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := len(d.Registry().Instances(wire.RolePrefill, time.Now())); n != 2 {
			return fmt.Errorf("%d prefill instances known", n)
		}
		for name, p := range ps { // pre-connected at discovery
			if _, ok := p.eng.TransportFor(ds.eng.Agent()); !ok {
				return fmt.Errorf("%s not connected to the decoder yet", name)
			}
		}
		return nil
	})
	type out struct {
		res Result
		err error
	}
	done := make(chan out, 1)
	go func() {
		res, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done <- out{res, err}
	}()
	var dead, live string
	select {
	case <-xs["p1"].started:
		dead, live = "p1", "p2"
	case <-xs["p2"].started:
		dead, live = "p2", "p1"
	}
	// Without the report the handoff would wait for its deadline: the dead
	// worker's registry entry stays fresh.
	pfs[dead].nc.Close()
	require.NoError(t, ps[dead].eng.Close())
	<-xs[live].started
	close(xs[live].block)
	o := <-done
	require.NoError(t, o.err)
	require.Equal(t, live, o.res.Instance)
	require.Equal(t, 2, o.res.Attempts)
	ds.requirePattern(t, 3)
	// The killed worker's goroutines linger in this process, where a real
	// kill ends them: abort them, as nothing could cancel them any more.
	aborted, abort := context.WithCancel(context.Background())
	abort()
	_ = pfs[dead].Shutdown(aborted) // its connection is closed: it cannot deregister
	require.ErrorIs(t, <-xs[dead].ctxErr, context.Canceled)
	require.NoError(t, ds.m.Free(3))
	ds.requireInitial(t)
	ps[live].requireInitial(t)
	ps[dead].requireInitial(t)
}

// TestHandoffSurvivesLiveWriterDroppingItsConnection: a prefill worker that
// lives breaks its only data-path connection to the decoder, as its engine
// does after a write whose context ended (another request cancelled while
// its bytes were sent). The worker connects again before letting the broken
// connection go, so the decoder hears of no death, and the handoff it is
// computing completes on its first attempt.
func TestHandoffSurvivesLiveWriterDroppingItsConnection(t *testing.T) {
	f := newFixture(t)
	ds := newSideOn(t, "dec", testHybrid(64, 8), rdma.TransportTCP)
	ps := newSideOn(t, "p1", testHybrid(64, 8), rdma.TransportTCP)
	x := newExec(ps)
	x.block = make(chan struct{})
	f.prefiller("p1", f.fp, x, withRegistryP)
	gone := make(chan rdma.AgentID, 8)
	stop := ds.eng.OnWriterGone(func(a rdma.AgentID) { gone <- a })
	defer stop()
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoRegistry, c.DirectFirst = false, true })
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := len(d.Registry().Instances(wire.RolePrefill, time.Now())); n != 1 {
			return fmt.Errorf("%d prefill instances known", n)
		}
		if _, ok := ps.eng.TransportFor(ds.eng.Agent()); !ok {
			return fmt.Errorf("p1 not connected to the decoder yet")
		}
		return nil
	})
	done := ds.handoffAsync(d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
	require.Equal(t, uint64(3), <-x.started)

	// Another request's write from p1 whose context ended: the writer drops
	// the connection it used, its only one to the decoder.
	dst, err := ds.prepare(5, 9)
	require.NoError(t, err)
	g, err := ds.eng.OpenGrant(rdma.GrantSpec{RequestID: 5, Extents: dst.extents(), Deadline: time.Now().Add(time.Minute)})
	require.NoError(t, err)
	src, err := ps.prepare(5, 9)
	require.NoError(t, err)
	cctx, cancel := context.WithCancel(context.Background())
	cancel()
	// Whether the bytes got out before the cancel took hold or not, a
	// connection whose deadline the cancel may have moved is not reused.
	_, _ = ps.eng.Write(cctx, ds.eng.Descriptor(), g.Ticket(), src.extents())
	g.Revoke()
	require.NoError(t, ds.m.Free(5))
	require.NoError(t, ps.m.Free(5))
	select {
	case a := <-gone:
		t.Fatalf("%s reported gone while it lives", a)
	case <-time.After(100 * time.Millisecond):
	}

	// p1 lives and finishes the handoff it was computing.
	close(x.block)
	o := <-done
	require.NoError(t, o.err)
	require.Equal(t, "p1", o.res.Instance)
	require.Equal(t, 1, o.res.Attempts)
	require.NoError(t, ds.m.Free(3))
	ds.requireInitial(t)
	ps.requireInitial(t)
}

// TestHandoffSurvivesDataPathReset: something between a live prefill
// worker and the decoder resets every data-path connection while the worker
// computes. The decoder's engine reports the writer gone, as it would for a
// killed one; the decoder asks the worker's service over NATS, hears it
// answer, and does not take it for dead. The worker connects again for its
// write and the handoff completes, though it is the only prefill instance
// (taken for dead, the request would have no live instance to go to).
func TestHandoffSurvivesDataPathReset(t *testing.T) {
	f := newFixture(t)
	ds, proxy := newSideVia(t, "dec", testHybrid(64, 8))
	gone := make(chan rdma.AgentID, 8)
	stop := ds.eng.OnWriterGone(func(a rdma.AgentID) { gone <- a })
	defer stop()
	ps := newSideOn(t, "p1", testHybrid(64, 8), rdma.TransportTCP)
	x := newExec(ps)
	x.block = make(chan struct{})
	f.prefiller("p1", f.fp, x, withRegistryP)
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoRegistry, c.DirectFirst = false, true })
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		insts := d.Registry().Instances(wire.RolePrefill, time.Now())
		if len(insts) != 1 || insts[0].Service == "" {
			return fmt.Errorf("prefill instances known: %+v", insts)
		}
		if _, ok := ps.eng.TransportFor(ds.eng.Agent()); !ok {
			return fmt.Errorf("p1 not connected to the decoder yet")
		}
		return nil
	})
	done := ds.handoffAsync(d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(30 * time.Second)})
	<-x.started
	proxy.Reset()
	require.Equal(t, rdma.AgentID("p1"), <-gone)
	// The decoder's check takes a round trip; a wrong verdict would end
	// the handoff now, with no live instance left to retry on.
	time.Sleep(2 * writerProbe)
	select {
	case o := <-done:
		t.Fatalf("the handoff ended before the worker wrote: %v", o.err)
	default:
	}
	d.mu.Lock()
	require.Empty(t, d.gone, "a live worker taken for dead")
	d.mu.Unlock()
	close(x.block)
	o := <-done
	require.NoError(t, o.err)
	require.Equal(t, "p1", o.res.Instance)
	ds.requirePattern(t, 3)
	require.NoError(t, ds.m.Free(3))
	ds.requireInitial(t)
	ps.requireInitial(t)
}

// TestHandoffPrefillRestartedUnderSameID: the prefill worker serving a
// handoff dies and comes back at once under the same instance id (a pod
// restarted in place keeps $POD_NAME), long before its registry entry
// could expire. Its host vanished, so no data-path connection closes to
// tell the decoder. The new incarnation's entry names another micro
// service under the same key: the decoder takes that for the old
// incarnation's death, fences the grant and retries on the other worker at
// once, not at the deadline; and it addresses the new incarnation at once.
func TestHandoffPrefillRestartedUnderSameID(t *testing.T) {
	f := newFixture(t)
	ds := newSideOn(t, "dec", testHybrid(64, 8), rdma.TransportTCP)
	old := newSideOn(t, "p1", testHybrid(64, 8), rdma.TransportTCP)
	xOld := newExec(old)
	xOld.block = make(chan struct{})
	pOld := f.prefiller("p1", f.fp, xOld, withRegistryP)
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoRegistry, c.DirectFirst = false, true })
	service := func(id string) string {
		for _, inst := range d.Registry().Instances(wire.RolePrefill, time.Now()) {
			if inst.ID == id {
				return inst.Service
			}
		}
		return ""
	}
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if service("p1") == "" {
			return fmt.Errorf("p1 not known with its service")
		}
		return nil
	})
	oldService := service("p1")
	const deadline = 20 * time.Second
	done := ds.handoffAsync(d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(deadline)})
	require.Equal(t, uint64(3), <-xOld.started)

	// The worker that takes the retry.
	ps2 := newSideOn(t, "p2", testHybrid(64, 8), rdma.TransportTCP)
	x2 := newExec(ps2)
	f.prefiller("p2", f.fp, x2, withRegistryP)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if service("p2") == "" {
			return fmt.Errorf("p2 not known yet")
		}
		return nil
	})

	// p1 vanishes with its NATS connection (its micro service goes with it)
	// while its data-path connections stay open, and comes back at once.
	pOld.nc.Close()
	restarted := time.Now()
	fresh := newSideOn(t, "p1", testHybrid(64, 8), rdma.TransportTCP)
	xNew := newExec(fresh)
	f.prefiller("p1", f.fp, xNew, withRegistryP)
	o := <-done
	require.NoError(t, o.err)
	require.Less(t, time.Since(restarted), deadline/4, "failed over at the restart, not at the deadline")
	require.Equal(t, "p2", o.res.Instance)
	require.Equal(t, 2, o.res.Attempts)
	ds.requirePattern(t, 3)
	require.NoError(t, ds.m.Free(3))
	require.NotEqual(t, oldService, service("p1"), "the new incarnation is known")

	// New handoffs reach the new incarnation at once: with p2 refusing,
	// only it can serve them.
	x2.refuse.Store(true)
	for _, id := range []uint64{5, 6} {
		o = <-ds.handoffAsync(d, Request{ID: id, Tokens: tokens(9), Deadline: time.Now().Add(deadline)})
		require.NoError(t, o.err)
		require.Equal(t, "p1", o.res.Instance)
		require.Equal(t, id, <-xNew.started)
		ds.requirePattern(t, id)
		require.NoError(t, ds.m.Free(id))
	}

	// The old incarnation's goroutines linger in this process, where a real
	// kill ends them: abort them, as nothing could cancel them any more.
	aborted, abort := context.WithCancel(context.Background())
	abort()
	_ = pOld.Shutdown(aborted)
	require.ErrorIs(t, <-xOld.ctxErr, context.Canceled)
	ds.requireInitial(t)
	old.requireInitial(t)
	fresh.requireInitial(t)
	ps2.requireInitial(t)
}

// TestDrainingWorkerSurvivesDataPathReset: a prefill worker that drains (a
// rolling update) still serves the request it computes, and something
// resets every data-path connection meanwhile. The decoder's ping must
// still reach the worker's service: taken for dead, the handoff would fail
// with no live instance left, though the worker would have written it.
// Its cancels still reach it too: a second request it computes during the
// drain ends as soon as its decoder cancels it, not when it would be done.
func TestDrainingWorkerSurvivesDataPathReset(t *testing.T) {
	f := newFixture(t)
	ds, proxy := newSideVia(t, "dec", testHybrid(64, 8))
	gone := make(chan rdma.AgentID, 8)
	stop := ds.eng.OnWriterGone(func(a rdma.AgentID) { gone <- a })
	defer stop()
	ps := newSideOn(t, "p1", testHybrid(64, 8), rdma.TransportTCP)
	x := newExec(ps)
	x.block = make(chan struct{})
	p := f.prefiller("p1", f.fp, x, withRegistryP)
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoRegistry, c.DirectFirst = false, true })
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		insts := d.Registry().Instances(wire.RolePrefill, time.Now())
		if len(insts) != 1 || insts[0].Service == "" {
			return fmt.Errorf("prefill instances known: %+v", insts)
		}
		if _, ok := ps.eng.TransportFor(ds.eng.Agent()); !ok {
			return fmt.Errorf("p1 not connected to the decoder yet")
		}
		return nil
	})
	done := ds.handoffAsync(d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(30 * time.Second)})
	require.Equal(t, uint64(3), <-x.started)
	cctx, cancel := context.WithCancel(context.Background())
	cancelled := make(chan error, 1)
	go func() {
		_, err := ds.handoff(cctx, d, Request{ID: 4, Tokens: tokens(9), Deadline: time.Now().Add(30 * time.Second)})
		cancelled <- err
	}()
	require.Equal(t, uint64(4), <-x.started)

	drained := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		drained <- p.Shutdown(ctx)
	}()
	natstest.CheckFor(t, 5*time.Second, time.Millisecond, func() error {
		insts := d.Registry().Instances(wire.RolePrefill, time.Now())
		if len(insts) != 1 || !insts[0].Draining {
			return fmt.Errorf("p1 not seen draining: %+v", insts)
		}
		return nil
	})
	// The ping is answered, and says so once the service has handed it to
	// its stand-in (the registry hears of the drain first; until the
	// service stops, both answer, and the first answer wins).
	nc := natstest.Connect(t, f.srv)
	pingSubj, err := micro.ControlSubject(micro.PingVerb, wire.ServiceName, p.svcID)
	require.NoError(t, err)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		pong, err := nc.Request(pingSubj, nil, 5*time.Second)
		require.NoError(t, err, "a ping while draining went unanswered")
		if !strings.Contains(string(pong.Data), `"draining":"true"`) || !strings.Contains(string(pong.Data), `"instance":"p1"`) {
			return fmt.Errorf("ping answered %s", pong.Data)
		}
		return nil
	})
	// A new request is not taken by the draining worker: no other serves.
	_, err = ds.handoff(context.Background(), d, Request{ID: 5, Tokens: tokens(9), Deadline: time.Now().Add(2 * time.Second)})
	require.Error(t, err)

	proxy.Reset()
	require.Equal(t, rdma.AgentID("p1"), <-gone)
	time.Sleep(2 * writerProbe)
	select {
	case o := <-done:
		t.Fatalf("the handoff ended before the draining worker wrote: %v", o.err)
	default:
	}
	d.mu.Lock()
	require.Empty(t, d.gone, "a live, draining worker taken for dead")
	d.mu.Unlock()

	// The decoder's cancel reaches the draining worker, which stops.
	cancel()
	require.ErrorIs(t, <-cancelled, context.Canceled)
	select {
	case err := <-x.ctxErr:
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(5 * time.Second):
		t.Fatal("the draining worker did not hear the cancel")
	}
	close(x.block)
	o := <-done
	require.NoError(t, o.err)
	require.Equal(t, "p1", o.res.Instance)
	ds.requirePattern(t, 3)
	require.NoError(t, <-drained)
	// Unanswered after the drain (a timeout while the server has not yet
	// processed the unsubscribe).
	_, err = nc.Request(pingSubj, nil, 500*time.Millisecond)
	require.True(t, errors.Is(err, nats.ErrNoResponders) || errors.Is(err, nats.ErrTimeout), "the ping is answered after the drain: %v", err)
	require.NoError(t, ds.m.Free(3))
	ds.requireInitial(t)
	ps.requireInitial(t)
}
