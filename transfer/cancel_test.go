package transfer

// Handoffs that end early: a deadline or the caller cancels, and both sides
// free what they hold.

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
)

func TestHandoffTimeoutFreesBothSides(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	d := f.decoder("d1", ds, nil)
	p := f.prefiller("p1", f.fp, x, nil)
	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(300 * time.Millisecond)})
	require.ErrorIs(t, err, ErrTimeout)
	ds.requireInitial(t)
	require.Error(t, <-x.ctxErr)
	ps.requireInitial(t)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if st := p.Stats(); st.InFlight != 0 {
			return fmt.Errorf("%d in flight", st.InFlight)
		}
		return nil
	})
}

// TestHandoffCancelStopsPrefill: the caller cancels while the worker
// prefills; the cancel message stops the worker long before the deadline.
func TestHandoffCancelStopsPrefill(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	d := f.decoder("d1", ds, nil)
	p := f.prefiller("p1", f.fp, x, nil)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-x.started; cancel() }()
	_, err := ds.handoff(ctx, d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
	require.ErrorIs(t, err, ErrCancelled)
	require.ErrorIs(t, <-x.ctxErr, context.Canceled)
	ds.requireInitial(t)
	ps.requireInitial(t)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if st := p.Stats(); st.Cancelled != 1 {
			return fmt.Errorf("stats %+v", st)
		}
		return nil
	})
}

// localIDs admits each job under an id of its own in the prefill worker's
// pools, as a worker does: decoders' request ids are theirs, not global.
type localIDs struct {
	x    *testExec
	next atomic.Uint64
}

func (l *localIDs) Admit(job Job) (AdmittedJob, error) {
	job.RequestID = 1000 + l.next.Add(1)
	return l.x.Admit(job)
}

// Request ids and grant ids are per decoder, so two decoders' requests can
// share both: a cancel from one decoder stops only its own request.
func TestCancelStopsOnlyTheSendersRequest(t *testing.T) {
	f := newFixture(t)
	ds1, ds2 := newSide(t, "dec1", testHybrid(64, 8)), newSide(t, "dec2", testHybrid(64, 8))
	ps := newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	d1, d2 := f.decoder("d1", ds1, nil), f.decoder("d2", ds2, nil)
	p, err := NewPrefiller(PrefillerConfig{Instance: "p1", Namespace: f.ns, Fingerprint: f.fp, MaxDraftTokens: 2, NoRegistry: true},
		natstest.Connect(t, f.srv), ps.eng, &localIDs{x: x})
	require.NoError(t, err)
	require.NoError(t, p.Start(context.Background()))
	defer func() { require.NoError(t, p.Shutdown(context.Background())) }()

	ctx1, cancel1 := context.WithCancel(context.Background())
	defer cancel1()
	failed1 := make(chan error, 1)
	go func() {
		_, err := ds1.handoff(ctx1, d1, Request{ID: 1, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		failed1 <- err
	}()
	<-x.started
	done2 := make(chan error, 1)
	go func() {
		_, err := ds2.handoff(context.Background(), d2, Request{ID: 1, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done2 <- err
	}()
	<-x.started // both prefills run: request 1, grant 1 of each decoder
	cancel1()
	require.ErrorIs(t, <-failed1, ErrCancelled)
	require.ErrorIs(t, <-x.ctxErr, context.Canceled)
	close(x.block)
	require.NoError(t, <-done2, "d2's request was stopped by d1's cancel")
	require.NoError(t, ds2.m.Free(1))
	ds1.requireInitial(t)
	ds2.requireInitial(t)
	ps.requireInitial(t)
}

// gatedAdmit holds every Admit until gate is closed, and tells admitting
// when one began.
type gatedAdmit struct {
	x         *testExec
	admitting chan struct{}
	gate      chan struct{}
}

func (g *gatedAdmit) Admit(job Job) (AdmittedJob, error) {
	g.admitting <- struct{}{}
	<-g.gate
	return g.x.Admit(job)
}

// A cancel that reaches the worker while its executor still admits the
// request is not lost: the request ends cancelled once admitted, its lease
// released, instead of holding its slot through a prefill.
func TestCancelDuringAdmit(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{}) // a prefill runs until its ctx is done
	g := &gatedAdmit{x: x, admitting: make(chan struct{}, 1), gate: make(chan struct{})}
	d := f.decoder("d1", ds, nil)
	p, err := NewPrefiller(PrefillerConfig{Instance: "p1", Namespace: f.ns, Fingerprint: f.fp, MaxDraftTokens: 2, NoRegistry: true},
		natstest.Connect(t, f.srv), ps.eng, g)
	require.NoError(t, err)
	require.NoError(t, p.Start(context.Background()))
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(t, p.Shutdown(ctx))
	}()

	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-g.admitting; cancel() }()
	_, err = ds.handoff(ctx, d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
	require.ErrorIs(t, err, ErrCancelled)
	// The decoder published its cancel before it returned: the worker's
	// cancel subscription takes it while Admit still blocks.
	time.Sleep(100 * time.Millisecond)
	close(g.gate)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if st := p.Stats(); st.Cancelled != 1 || st.InFlight != 0 {
			return fmt.Errorf("stats %+v", st)
		}
		return nil
	})
	select {
	case err := <-x.ctxErr: // a prefill that started saw its ctx done
		require.ErrorIs(t, err, context.Canceled)
	default:
	}
	require.Equal(t, x.admits.Load(), x.releases.Load(), "lease not released")
	ds.requireInitial(t)
	ps.requireInitial(t)
}
