package service

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/transfer/wire"
	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/config"
)

// Conversation state both ways (--state-return, worker/state.go): a decode
// worker keeps each remotely prefilled conversation's end-of-turn state and
// offers it to the prefill instance that prefilled it (stateOffers, a
// wire.StateOffer on that instance's offer subject); the prefill instance
// adopts it (stateAdopter): it pulls the state with a handoff of its own,
// the roles swapped, on transfer.StatePrefix, from the decode worker's
// stateServer, a transfer.Prefiller whose jobs are served from the decode
// worker's cache. Push-at-finish, pulled off the critical path: by the time
// the conversation's next turn arrives the prefill instance usually holds
// the state after the last reply, and its prefill computes only the new
// message. A next turn that comes first is prefilled as without the return
// (from the previous prompt's state), so a return that is late, refused or
// lost costs a recompute and never a wrong answer.

// statePullTimeout bounds an adoption: a pull moves one row and a reply's
// blocks, served at once or refused, so one that takes longer has lost its
// holder (killed or partitioned mid-transfer: the puller is not watching
// the holder's registry entry); it is revoked then, and the prefill row it
// holds is freed, rather than held for a whole request's timeout.
func statePullTimeout(cfg config.Config) time.Duration {
	return min(cfg.RequestTimeout, 5*time.Second)
}

// stateReturn reports whether cfg returns states (both roles ask it).
func stateReturn(cfg config.Config) bool {
	return cfg.PrefixCache == "on" && cfg.StateReturn == "on"
}

// stateOffers publishes a decode worker's offers (worker.StateOffers).
type stateOffers struct {
	nc      *nats.Conn
	cfg     config.Config
	fp      string
	log     *slog.Logger
	stopped atomic.Bool // the state server stopped: offers would only cost their takers a pull
}

// stop ends the offers (before the state server stops).
func (o *stateOffers) stop() { o.stopped.Store(true) }

func (o *stateOffers) Offer(instance string, tokens []int32) {
	if o.stopped.Load() || !wire.ValidToken(instance) {
		return
	}
	b, err := wire.EncodeStateOffer(wire.StateOffer{From: o.cfg.InstanceID, Fingerprint: o.fp, Tokens: tokens}, o.nc.MaxPayload())
	if err == nil {
		err = o.nc.Publish(wire.Subject(wire.DefaultPrefix, o.cfg.Namespace, wire.SubjectInstanceStateOffer, instance), b)
	}
	if err != nil { // an optimisation: the next turn recomputes instead
		o.log.Debug("state offer not sent", "to", instance, "tokens", len(tokens), "err", err)
	}
}

// startStateServer serves the states a decode worker holds to the prefill
// instances that pull them, until the returned stop (which drains).
func startStateServer(ctx context.Context, nc *nats.Conn, cfg config.Config, n *node, sched *worker.Scheduler, m *worker.Metrics, log *slog.Logger) (*prefillExec, func(context.Context), error) {
	pe := &prefillExec{sched: sched, n: n, m: m, state: true}
	pf, err := transfer.NewPrefiller(transfer.PrefillerConfig{
		Instance: cfg.InstanceID, Namespace: cfg.Namespace, Prefix: transfer.StatePrefix(""), Fingerprint: n.fingerprint,
		Capacity: n.capacity, Logger: log.With("part", "state-server"), Layerwise: transfer.LayerwiseOff,
		// Pulled by name (transfer.Request.Holder): nothing to discover.
		NoRegistry: true,
	}, nc, n.data, pe)
	if err != nil {
		return nil, nil, err
	}
	pe.pf = pf
	if err := pf.Start(ctx); err != nil {
		return nil, nil, err
	}
	return pe, func(ctx context.Context) {
		if err := pf.Shutdown(ctx); err != nil {
			log.Warn("state server shutdown", "err", err)
		}
		pe.syncStats()
	}, nil
}

// stateAdopter takes a prefill worker's state offers to its scheduler.
type stateAdopter struct {
	sched   *worker.Scheduler
	fp      string
	timeout time.Duration
	log     *slog.Logger
	m       *worker.Metrics

	ctx    context.Context // ends at shutdown: every adoption with it
	cancel context.CancelFunc
	sub    *nats.Subscription
	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup // the adoptions queued
}

// startStateAdopter subscribes to the instance's state offers.
func startStateAdopter(nc *nats.Conn, cfg config.Config, fp string, sched *worker.Scheduler, m *worker.Metrics, log *slog.Logger) (*stateAdopter, error) {
	a := &stateAdopter{sched: sched, fp: fp, timeout: statePullTimeout(cfg), log: log, m: m}
	a.ctx, a.cancel = context.WithCancel(context.Background())
	sub, err := nc.Subscribe(wire.Subject(wire.DefaultPrefix, cfg.Namespace, wire.SubjectInstanceStateOffer, cfg.InstanceID), a.onOffer)
	if err != nil {
		a.cancel()
		return nil, err
	}
	a.sub = sub
	return a, nil
}

// onOffer adopts an offered state: never blocks the NATS dispatch (Adopt
// queues), and refuses a malformed offer or another layout's by name.
func (a *stateAdopter) onOffer(msg *nats.Msg) {
	role := string(worker.RolePrefill)
	o, err := wire.DecodeStateOffer(msg.Data)
	if err != nil {
		a.m.StateReturns.WithLabelValues(role, "malformed").Inc()
		a.log.Warn("state offer refused", "err", err)
		return
	}
	if o.Fingerprint != a.fp {
		a.m.StateReturns.WithLabelValues(role, "layout_mismatch").Inc()
		a.log.Warn("state offer refused: another layout", "from", o.From, "layout", o.Fingerprint, "this worker's", a.fp)
		return
	}
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return
	}
	a.wg.Add(1)
	a.mu.Unlock()
	ctx, cancel := context.WithTimeout(a.ctx, a.timeout)
	err = a.sched.Adopt(ctx, worker.AdoptRequest{
		Tokens: o.Tokens, Holder: o.From,
		Done: func(err error) {
			cancel()
			a.wg.Done()
			if err != nil {
				a.log.Debug("state not adopted", "from", o.From, "tokens", len(o.Tokens), "err", err)
			}
		},
	})
	if err != nil {
		cancel()
		a.wg.Done()
		a.log.Debug("state offer not queued", "from", o.From, "err", err) // counted by the scheduler
	}
}

// stop ends the subscription and every adoption, and waits for them.
func (a *stateAdopter) stop() {
	a.mu.Lock()
	a.closed = true
	a.mu.Unlock()
	_ = a.sub.Unsubscribe()
	a.cancel()
	a.wg.Wait()
}
