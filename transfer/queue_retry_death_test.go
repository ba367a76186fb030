package transfer

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/wire"
)

// gatedExec is a PrefillExecutor over a side's pools whose n-th Prefill
// (n <= len(gates)) reports n on gated and waits on gates[n-1] (or ctx).
// Each admission holds its own resources (under an id of its own, as the
// real worker's scheduler does), so two attempts of one request coexist.
type gatedExec struct {
	s     *side
	gates []chan struct{}
	calls atomic.Int64
	keys  atomic.Uint64
	gated chan int64
}

func (x *gatedExec) Admit(job Job) (AdmittedJob, error) {
	key := 1000 + x.keys.Add(1)
	d, err := x.s.prepare(key, len(job.Tokens))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCapacityRefused, err)
	}
	return &gatedLease{x: x, job: job, key: key, d: d}, nil
}

type gatedLease struct {
	x        *gatedExec
	job      Job
	key      uint64
	d        CacheExtents
	released atomic.Bool
}

func (l *gatedLease) Prefill(ctx context.Context) (Prefilled, error) {
	if n := l.x.calls.Add(1); int(n) <= len(l.x.gates) {
		l.x.gated <- n
		select {
		case <-l.x.gates[n-1]:
		case <-ctx.Done():
			return Prefilled{}, ctx.Err()
		}
	}
	return l.x.s.prefilled(l.job.RequestID, l.d), nil
}

func (l *gatedLease) Release() {
	if !l.released.Swap(true) {
		_ = l.x.s.m.Free(l.key)
	}
}

// TestQueueGroupRetryDeathFailsOver: the only prefill instance's write is
// cut by a data-path reset (its grant fails peer_failed). Since e0ade6b the
// decoder retries fenced with p1 excluded but not dead; pick knows no other
// instance, so attempt 2 goes to the queue group, where p1 takes it. p1 is
// then killed (SIGKILL: its NATS connection and engine close) while it
// computes attempt 2. The decoder learns of the death within milliseconds
// (writer gone, ping unanswered, p1 in d.gone) and feeds EvPeerDied{p1} to
// the session, which drops it: the outstanding attempt's target is ""
// (queue group), and EvPeerDied only acts on s.target or the reply's
// instance. The handoff then waits for its deadline
// instead of failing over at once: with the default --request-timeout of
// 30 s the decode request holds its blocks and row that long and ends 504
// (a timeout is no fallback reason for --prefill auto).
func TestQueueGroupRetryDeathFailsOver(t *testing.T) {
	f := newFixture(t)
	ds, proxy := newSideVia(t, "dec", testHybrid(64, 8))
	ps := newSideOn(t, "p1", testHybrid(64, 8), rdma.TransportTCP)
	x := &gatedExec{s: ps, gates: []chan struct{}{make(chan struct{}), make(chan struct{})}, gated: make(chan int64, 4)}
	cfg := PrefillerConfig{Instance: "p1", Namespace: f.ns, Fingerprint: f.fp, MaxDraftTokens: 2,
		Registry: RegistryConfig{TTL: 30 * time.Second}}
	nc := natstest.Connect(t, f.srv)
	pf, err := NewPrefiller(cfg, nc, ps.eng, x)
	require.NoError(t, err)
	require.NoError(t, pf.Start(context.Background()))
	d := f.decoder("d1", ds, func(c *DecoderConfig) {
		c.NoRegistry, c.DirectFirst = false, true
		if testing.Verbose() {
			c.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
		}
	})
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
	const deadline = 6 * time.Second
	start := time.Now()
	done := ds.handoffAsync(d, Request{ID: 3, Tokens: tokens(9), Deadline: start.Add(deadline)})
	require.Equal(t, int64(1), <-x.gated) // attempt 1, addressed to p1
	proxy.ResetAfter(200)                 // its write is cut mid-way
	close(x.gates[0])
	require.Equal(t, int64(2), <-x.gated) // attempt 2 reached p1 through the queue group
	nc.Close()                            // kill p1
	require.NoError(t, ps.eng.Close())
	killed := time.Now()
	// The decoder hears of the death at once: writer gone, ping unanswered.
	natstest.CheckFor(t, 2*time.Second, 5*time.Millisecond, func() error {
		d.mu.Lock()
		defer d.mu.Unlock()
		if _, ok := d.gone["p1"]; !ok {
			return fmt.Errorf("p1 not taken for dead yet")
		}
		return nil
	})
	t.Logf("p1 taken for dead %v after the kill", time.Since(killed))
	var o handoffOut
	select {
	case o = <-done:
	case <-time.After(deadline + 5*time.Second):
		t.Fatal("handoff never ended")
	}
	took := time.Since(killed)
	t.Logf("handoff ended %v after the kill: %v", took, o.err)
	aborted, abort := context.WithCancel(context.Background())
	abort()
	_ = pf.Shutdown(aborted) // the killed worker's goroutines linger in this process
	require.Less(t, took, 2*time.Second, "the serving instance's death was known within ms, but the handoff ignored it")
	require.ErrorIs(t, o.err, ErrPeerFailed)
}
