package transfer

// Starting, draining, shutting down and closing the drivers, with requests
// in flight, and their configuration checks.

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/leakcheck"
	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/transfer/wire"
)

func TestPrefillerShutdownAbortsInFlight(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoResponderWait = 200 * time.Millisecond })
	p := f.prefiller("p1", f.fp, x, nil)
	done := make(chan error, 1)
	go func() {
		_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done <- err
	}()
	<-x.started
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	require.NoError(t, p.Shutdown(ctx))
	ps.requireInitial(t)
	// The aborted request is retried (fenced) elsewhere; with no other
	// worker it ends as none answering, naming the abort.
	err := <-done
	require.ErrorIs(t, err, ErrNoPrefillWorker)
	require.ErrorContains(t, err, "remote closed (p1)")
	ds.requireInitial(t)
	// After shutdown nobody serves the subject.
	_, err = ds.handoff(context.Background(), d, Request{ID: 4, Tokens: tokens(9)})
	require.ErrorIs(t, err, ErrNoPrefillWorker)
	ds.requireInitial(t)
}

// A worker whose drain runs out of time aborts the request it holds
// (reply closed): the decoder retries it, fenced, on another live worker,
// as a rolling update with a short drain needs.
func TestDrainTimeoutRetriedElsewhere(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(64, 8))
	ps1, ps2 := newSide(t, "pre1", testHybrid(64, 8)), newSide(t, "pre2", testHybrid(64, 8))
	x1 := newExec(ps1)
	x1.block = make(chan struct{})
	d := f.decoder("d1", ds, func(c *DecoderConfig) { withRegistry(c); c.DirectFirst = true })
	p1 := f.prefiller("p1", f.fp, x1, withRegistryP)
	instances := func(n int) {
		waitKnown(t, d.Registry(), wire.RolePrefill, n)
	}
	instances(1)
	type outcome struct {
		res Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done <- outcome{res, err}
	}()
	<-x1.started
	f.prefiller("p2", f.fp, newExec(ps2), withRegistryP)
	instances(2)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	require.NoError(t, p1.Shutdown(ctx))
	o := <-done
	require.NoError(t, o.err)
	require.Equal(t, "p2", o.res.Instance)
	require.Equal(t, 2, o.res.Attempts)
	require.NoError(t, ds.m.Free(3))
	ds.requireInitial(t)
	ps1.requireInitial(t)
}

func TestDecoderCloseFailsInFlight(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", f.fp, x, nil)
	done := make(chan error, 1)
	go func() {
		_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done <- err
	}()
	<-x.started
	require.NoError(t, d.Close())
	require.ErrorIs(t, <-done, ErrClosed)
	ds.requireInitial(t)
	require.ErrorIs(t, <-x.ctxErr, context.Canceled)
	ps.requireInitial(t)
	_, err := ds.handoff(context.Background(), d, Request{ID: 4, Tokens: tokens(9)})
	require.ErrorIs(t, err, ErrClosed)
}

func TestConfigValidation(t *testing.T) {
	leakcheck.Check(t)
	srv := natstest.Run(t)
	nc := natstest.Connect(t, srv)
	ds := newSide(t, "dec", testHybrid(8, 2))
	for _, cfg := range []DecoderConfig{
		{Namespace: "n", Fingerprint: "f"},
		{Instance: "a.b", Namespace: "n", Fingerprint: "f"},
		{Instance: "a", Namespace: "n"},
		{Instance: "a", Namespace: "n", Fingerprint: "f", MaxAttempts: -1},
	} {
		_, err := NewDecoder(context.Background(), cfg, nc, ds.eng)
		require.ErrorIs(t, err, ErrInvalidConfig, "%+v", cfg)
	}
	_, err := NewPrefiller(PrefillerConfig{Instance: "a", Namespace: "n", Fingerprint: "f"}, nc, ds.eng, nil)
	require.ErrorIs(t, err, ErrInvalidConfig)
	_, err = openRegistry(context.Background(), nc, RegistryConfig{Namespace: "n", TTL: time.Second, Heartbeat: 2 * time.Second})
	require.ErrorIs(t, err, ErrInvalidConfig)
	d, err := NewDecoder(context.Background(), DecoderConfig{Instance: "a", Namespace: "n", Fingerprint: "f", NoRegistry: true}, nc, ds.eng)
	require.NoError(t, err)
	_, err = d.Handoff(context.Background(), Request{ID: 1})
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.NoError(t, d.Close())
	require.NoError(t, d.Close())
}

// A prefill worker that starts after a decode instance is already announced
// receives it from the registry's initial values while Start is still running;
// Start must not hold the lock that pre-connecting takes.
func TestPrefillerStartsAfterDecoderAnnounced(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	d := f.decoder("d1", ds, withRegistry)
	started := make(chan *Prefiller, 1)
	go func() { started <- f.prefiller("p1", f.fp, newExec(ps), withRegistryP) }()
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("Prefiller.Start did not return with a decode instance already registered")
	}
	res, err := ds.handoff(context.Background(), d, Request{ID: 1, Tokens: tokens(9), Deadline: time.Now().Add(5 * time.Second)})
	require.NoError(t, err)
	require.Equal(t, "p1", res.Instance)
	require.NoError(t, ds.m.Free(1))
}

// slowConnect is a writer engine whose pre-connects block until cancelled;
// its first pre-connect also cancels the ctx of the Start that triggered it.
type slowConnect struct {
	writerEngine
	cancelStart context.CancelFunc
	connecting  chan struct{}
	returned    chan struct{}
}

func (s *slowConnect) Descriptor() rdma.Descriptor {
	select { // Start announces after the watch delivered the decode instance
	case <-s.connecting:
	case <-time.After(5 * time.Second):
	}
	return s.writerEngine.Descriptor()
}

func (s *slowConnect) Connect(ctx context.Context, _ rdma.Descriptor) (rdma.Transport, error) {
	s.cancelStart()
	close(s.connecting)
	<-ctx.Done()
	close(s.returned)
	return "", ctx.Err()
}

// A Start that fails after the registry delivered a decode instance stops the
// pre-connect it began before returning, as Shutdown would.
func TestPrefillerFailedStartStopsPreconnect(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	f.decoder("d1", ds, withRegistry)
	p, err := NewPrefiller(PrefillerConfig{Instance: "p1", Namespace: f.ns, Fingerprint: f.fp,
		Registry: RegistryConfig{TTL: 30 * time.Second}}, natstest.Connect(t, f.srv), ps.eng, newExec(ps))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	eng := &slowConnect{writerEngine: ps.eng, cancelStart: cancel, connecting: make(chan struct{}), returned: make(chan struct{})}
	p.eng = eng
	require.Error(t, p.Start(ctx))
	select {
	case <-eng.returned:
	default:
		t.Fatal("Start returned an error with its pre-connect still running")
	}
	require.NoError(t, p.Shutdown(context.Background()))
}

// fakeRequest is a micro.Request that keeps the reply.
type fakeRequest struct {
	micro.Request
	data  []byte
	reply []byte
}

func (r *fakeRequest) Data() []byte  { return r.data }
func (r *fakeRequest) Reply() string { return "_INBOX.test" }
func (r *fakeRequest) Respond(b []byte, _ ...micro.RespondOpt) error {
	r.reply = b
	return nil
}
func (r *fakeRequest) Error(_, _ string, b []byte, _ ...micro.RespondOpt) error {
	r.reply = b
	return nil
}

// A request that reaches a prefiller already shutting down (dispatched before
// its endpoints stopped) is refused as capacity, which the decoder retries on
// another worker, not failed as closed.
func TestPrefillerNotServingRefusesAsCapacity(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	p := f.prefiller("p1", f.fp, x, nil)
	require.NoError(t, p.Shutdown(context.Background()))
	dest, err := ds.prepare(1, 9)
	require.NoError(t, err)
	defer ds.m.Free(1)
	kvb, mb := dest.bytes()
	deadline := time.Now().Add(5 * time.Second)
	g, err := ds.eng.OpenGrant(rdma.GrantSpec{RequestID: 1, Extents: dest.extents(), Deadline: deadline})
	require.NoError(t, err)
	defer g.Revoke()
	b, err := wire.EncodePrefillRequest(wire.PrefillRequest{RequestID: 1, From: "d1", Fingerprint: f.fp, Tokens: tokens(9),
		Deadline: deadline.UnixNano(), Peer: wire.PeerOf(ds.eng.Descriptor()),
		Ticket: g.Ticket(), KVBytes: kvb, MambaBytes: mb}, 0)
	require.NoError(t, err)
	r := &fakeRequest{data: b}
	p.handle(r)
	rep, err := wire.DecodePrefillReply(r.reply)
	require.NoError(t, err)
	require.Equal(t, session.CodeCapacityRefused, rep.Code, rep.Msg)
	require.ErrorIs(t, &RemoteError{Code: rep.Code}, ErrCapacityRefused)
	require.Zero(t, x.admits.Load())
	ps.requireInitial(t)
}

// Shutdown may come at any point of Start: both return, Start with nil or
// ErrClosed, and nothing stays subscribed or running.
func TestPrefillerShutdownDuringStart(t *testing.T) {
	f := newFixture(t)
	ps := newSide(t, "pre", testHybrid(64, 8))
	nc := natstest.Connect(t, f.srv)
	_, err := nc.Request("$JS.API.INFO", nil, 5*time.Second) // the connection's reply mux subscribes once
	require.NoError(t, err)
	baseline := nc.NumSubscriptions()
	for i := range 8 {
		p, err := NewPrefiller(PrefillerConfig{Instance: fmt.Sprintf("p%d", i), Namespace: f.ns, Fingerprint: f.fp,
			Registry: RegistryConfig{TTL: 30 * time.Second}}, nc, ps.eng, newExec(ps))
		require.NoError(t, err)
		started := make(chan error, 1)
		go func() { started <- p.Start(context.Background()) }()
		time.Sleep(time.Duration(i) * time.Millisecond)
		require.NoError(t, p.Shutdown(context.Background()))
		if err := <-started; err != nil {
			require.ErrorIs(t, err, ErrClosed)
		}
		require.NoError(t, p.Shutdown(context.Background()))
	}
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := nc.NumSubscriptions(); n != baseline {
			return fmt.Errorf("%d subscriptions left, want %d", n, baseline)
		}
		return nil
	})
}

// A decoder whose registry cannot start (here its context is already
// done, as when JetStream is not ready yet and the caller gives up) leaves
// nothing subscribed, however often it is tried.
func TestNewDecoderFailureLeavesNoSubscription(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(8, 2))
	nc := natstest.Connect(t, f.srv)
	_, err := nc.Request("$JS.API.INFO", nil, 5*time.Second) // the connection's reply mux subscribes once
	require.NoError(t, err)
	baseline := nc.NumSubscriptions()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for range 3 {
		_, err := NewDecoder(ctx, DecoderConfig{Instance: "d", Namespace: f.ns, Fingerprint: f.fp}, nc, ds.eng)
		require.Error(t, err)
	}
	require.Equal(t, baseline, nc.NumSubscriptions())
}

// A prefiller that shuts down stays registered for its requests in flight
// but announces it is draining: decoders stop addressing it at once instead
// of spending an attempt on it.
func TestDrainingPrefillerNotAddressed(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(64, 8))
	ps1, ps2 := newSide(t, "pre1", testHybrid(64, 8)), newSide(t, "pre2", testHybrid(64, 8))
	x1, x2 := newExec(ps1), newExec(ps2)
	x1.block, x2.block = make(chan struct{}), make(chan struct{})
	d := f.decoder("d1", ds, func(c *DecoderConfig) { withRegistry(c); c.DirectFirst = true })
	p1 := f.prefiller("p1", f.fp, x1, withRegistryP)
	f.prefiller("p2", f.fp, x2, withRegistryP)
	waitKnown(t, d.Registry(), wire.RolePrefill, 2)
	type outcome struct {
		res Result
		err error
	}
	results := make(chan outcome, 4)
	handoff := func(id uint64) {
		res, err := ds.handoff(context.Background(), d, Request{ID: id, Tokens: tokens(5), Deadline: time.Now().Add(time.Minute)})
		results <- outcome{res, err}
	}
	// Load: one request blocked on p1, two on p2, so p1 is the least loaded.
	go handoff(1)
	go handoff(2)
	go handoff(3)
	for range 3 {
		select {
		case <-x1.started:
		case <-x2.started:
		}
	}
	require.Equal(t, int64(1), x1.admits.Load())

	shut := make(chan error, 1)
	go func() { shut <- p1.Shutdown(context.Background()) }() // drains its blocked request
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		for _, inst := range d.Registry().Instances(wire.RolePrefill, time.Now()) {
			if inst.ID == "p1" && inst.Draining {
				return nil
			}
		}
		return errors.New("p1 not seen draining")
	})
	go handoff(4)
	<-x2.started
	close(x1.block)
	close(x2.block)
	require.NoError(t, <-shut)
	for range 4 {
		o := <-results
		require.NoError(t, o.err)
		if o.res.FirstToken == 4 { // the test executor's first token is the request id
			require.Equal(t, "p2", o.res.Instance)
			require.Equal(t, 1, o.res.Attempts, "request 4 spent an attempt on the draining instance")
		}
	}
	for id := uint64(1); id <= 4; id++ {
		require.NoError(t, ds.m.Free(id))
	}
	ds.requireInitial(t)
}
