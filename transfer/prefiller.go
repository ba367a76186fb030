package transfer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"go.opentelemetry.io/otel/trace"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/transfer/wire"
)

// PrefillerConfig configures a Prefiller.
type PrefillerConfig struct {
	Instance       string // unique instance id, a token; required
	Namespace      string // required, a token
	Prefix         string // default DefaultPrefix
	Fingerprint    string // the model's layout fingerprint; required
	MaxDraftTokens int    // width of the padding-sentinel id range
	// Layerwise says when a request's cache is streamed while prefill
	// computes it: LayerwiseAuto (the zero value) streams prompts of at
	// least LayerwiseMinTokens tokens (0: DefaultLayerwiseMinTokens).
	// Only jobs that are LayerwiseJobs stream.
	Layerwise          Layerwise
	LayerwiseMinTokens int
	// Capacity reports the instance's room for the registry; optional.
	Capacity func() wire.Capacity
	Registry RegistryConfig
	// NoRegistry skips the instance registry (no announce, no watch of decode
	// instances). For tools and tests.
	NoRegistry bool
	Logger     *slog.Logger
	// TracerProvider traces each request (a "prefill" span continuing the
	// decoder's trace from the request's headers); nil traces nothing.
	TracerProvider trace.TracerProvider
}

func (c *PrefillerConfig) validate() error {
	if c.Prefix == "" {
		c.Prefix = wire.DefaultPrefix
	}
	if !wire.ValidToken(c.Instance) || !wire.ValidToken(c.Namespace) || !wire.ValidToken(c.Prefix) {
		return fmt.Errorf("%w: instance %q, namespace %q and prefix %q must be tokens of [A-Za-z0-9_-]", ErrInvalidConfig, c.Instance, c.Namespace, c.Prefix)
	}
	if c.Fingerprint == "" {
		return fmt.Errorf("%w: empty layout fingerprint", ErrInvalidConfig)
	}
	if c.MaxDraftTokens < 0 {
		return fmt.Errorf("%w: draft tokens %d", ErrInvalidConfig, c.MaxDraftTokens)
	}
	if c.Layerwise > LayerwiseOff || c.LayerwiseMinTokens < 0 {
		return fmt.Errorf("%w: layerwise %s from %d tokens", ErrInvalidConfig, c.Layerwise, c.LayerwiseMinTokens)
	}
	if c.LayerwiseMinTokens == 0 {
		c.LayerwiseMinTokens = DefaultLayerwiseMinTokens
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	c.Registry.Prefix, c.Registry.Namespace = c.Prefix, c.Namespace
	if c.Registry.Logger == nil {
		c.Registry.Logger = c.Logger
	}
	return nil
}

// writerEngine is what a Prefiller needs from the data plane.
type writerEngine interface {
	Write(ctx context.Context, peer rdma.Descriptor, t rdma.Ticket, src []rdma.Extent) (rdma.Manifest, error)
	Connect(ctx context.Context, peer rdma.Descriptor) (rdma.Transport, error)
	TransportFor(agent rdma.AgentID) (rdma.Transport, bool)
	Descriptor() rdma.Descriptor
	OpenStream(ctx context.Context, peer rdma.Descriptor, t rdma.Ticket) (*rdma.Stream, error)
}

var _ writerEngine = (*rdma.Engine)(nil)

// PrefillerStats are cumulative counters.
type PrefillerStats struct {
	Received, Served, Refused, Failed, Cancelled uint64
	InFlight                                     int64
	// Published counts NATS messages the prefiller published (replies;
	// heartbeats excluded).
	Published uint64
	// KVBytes and MambaBytes are the bytes of the handoffs served (written
	// and committed); failed and cancelled writes are not counted.
	KVBytes, MambaBytes uint64
	// StreamedBytes are those of KVBytes and MambaBytes that left while
	// prefill still computed (layer-wise streaming).
	StreamedBytes uint64
}

// Prefiller is the sending side of the handoff protocol: a NATS micro service
// that admits prefill requests, runs them through a PrefillExecutor, writes the
// cache into the requester's grant, commits and replies.
type Prefiller struct {
	cfg  PrefillerConfig
	nc   *nats.Conn
	eng  writerEngine
	exec PrefillExecutor
	// tracer is cfg.TracerProvider's, nil when requests are not traced.
	tracer trace.Tracer
	svcID  string // the micro service's id (Instance.Service); set by Start

	mu       sync.Mutex
	state    int  // 0 new, 3 starting, 1 serving, 2 shut down
	stopping bool // Shutdown began
	in       intake
	reg      *Registry
	tasks    map[uint64]*task // by request id, each the head of a list (task.next)
	wg       sync.WaitGroup
	work     chan taskStart // to an idle worker; unbuffered (see dispatchLocked)
	quit     chan struct{}  // closed when intake stops: idle workers exit
	peers    wire.PeerCache // the last requester's descriptor, see wire.PeerCache
	free     sync.Pool      // *task, see freeTask

	// Pre-connection to decode instances seen in the registry, so a first
	// handoff does not pay the data plane's connection set-up.
	connected  map[string]string // decode instance id -> agent connected to
	connCtx    context.Context
	connCancel context.CancelFunc

	maxPayload int64
	draining   atomic.Bool // announced, so decoders stop addressing us
	received   atomic.Uint64
	served     atomic.Uint64
	refused    atomic.Uint64
	failed     atomic.Uint64
	cancelled  atomic.Uint64
	inflight   atomic.Int64
	published  atomic.Uint64
	kvBytes    atomic.Uint64
	mambaBytes atomic.Uint64
	streamed   atomic.Uint64
}

// NewPrefiller validates cfg; Start begins serving.
func NewPrefiller(cfg PrefillerConfig, nc *nats.Conn, eng *rdma.Engine, exec PrefillExecutor) (*Prefiller, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if exec == nil {
		return nil, fmt.Errorf("%w: nil executor", ErrInvalidConfig)
	}
	p := &Prefiller{cfg: cfg, nc: nc, eng: eng, exec: exec, tasks: map[uint64]*task{},
		work: make(chan taskStart), quit: make(chan struct{}),
		connected: map[string]string{}, maxPayload: nc.MaxPayload()}
	if cfg.TracerProvider != nil {
		p.tracer = cfg.TracerProvider.Tracer(tracerName)
	}
	p.connCtx, p.connCancel = context.WithCancel(context.Background())
	return p, nil
}

// Stats returns cumulative counters.
func (p *Prefiller) Stats() PrefillerStats {
	return PrefillerStats{
		Received: p.received.Load(), Served: p.served.Load(), Refused: p.refused.Load(), Failed: p.failed.Load(),
		Cancelled: p.cancelled.Load(), InFlight: p.inflight.Load(), Published: p.published.Load(),
		KVBytes: p.kvBytes.Load(), MambaBytes: p.mambaBytes.Load(), StreamedBytes: p.streamed.Load(),
	}
}

// Start registers the micro service (shared endpoint in queue group
// PrefillQueue and the instance's own endpoint), subscribes the cancel
// subjects and, unless NoRegistry, announces the instance and watches decode
// instances. It returns once requests can be served.
func (p *Prefiller) Start(ctx context.Context) error {
	reg, err := p.startIntake(ctx)
	if err != nil {
		return err
	}
	// The registry runs outside p.mu: watch delivers the decode instances that
	// already exist to preconnect, which takes p.mu.
	served := false
	if reg != nil {
		if err = reg.watch(ctx, wire.RoleDecode); err == nil {
			// Serving before decoders can pick us from the registry: a
			// request that comes right after the entry is taken, not refused
			// as "starting" at the cost of one of its attempts.
			if err = p.serve(); err == nil {
				served = true
				err = reg.announce(ctx, p.self)
			}
			if err == nil && p.draining.Load() {
				// A Shutdown came while the entry was put: its refresh
				// found none to refresh, and the put said serving.
				err = reg.refresh(ctx)
			}
		}
	}
	if err == nil {
		if err = p.nc.Flush(); err != nil {
			err = fmt.Errorf("transfer: flush: %w", err)
		}
	}
	if err != nil && served {
		// Requests may have been taken since serve: they end as in a
		// drain, aborted at once (decoders retry them elsewhere), their
		// replies flushed before the entry goes.
		actx, cancel := context.WithCancel(context.Background())
		cancel()
		_ = p.Shutdown(actx)
		return err
	}
	if err != nil {
		p.mu.Lock()
		in := p.stopIntakeLocked()
		p.mu.Unlock()
		_ = in.stop()
		if reg != nil {
			rctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_ = reg.close(rctx) // no more registry callbacks, so no new pre-connects
			cancel()
		}
		// Pre-connects the watch began; no request was taken.
		p.connCancel()
		p.wg.Wait()
		return err
	}
	return p.serve()
}

// serve moves a starting Prefiller to serving, once.
func (p *Prefiller) serve() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch p.state {
	case 1:
		return nil
	case 3:
		p.state = 1
		return nil
	}
	return fmt.Errorf("%w: prefiller shut down while starting", ErrClosed)
}

// intake is what Start subscribed. It is stopped outside p.mu: stopping
// is NATS IO.
type intake struct {
	svc    micro.Service
	subs   []*nats.Subscription // cancels; while draining, the ping (see stopRequests)
	nc     *nats.Conn
	status chan nats.Status // reconnects, see announceReconnects
}

// stop stops everything in.
func (in *intake) stop() error {
	return errors.Join(in.stopRequests(false), in.stopControl())
}

// stopRequests stops taking requests: the micro service goes, with its
// endpoints, and announceReconnects ends. With draining set, what the
// requests in flight still need stays until stopControl: their cancels,
// and an answer to the service's ping. Decoders ping a writer whose
// data-path connections all closed to tell a reset of the path from a
// death (watchWriters): a drain that went silent would be taken for dead
// at the first reset, and its requests failed while it still serves them.
// So a stand-in answers the ping from before the service stops (one
// connection: the server subscribes it before it unsubscribes the
// service's, so no ping goes unanswered), its metadata saying draining.
func (in *intake) stopRequests(draining bool) error {
	var err error
	if in.status != nil {
		in.nc.RemoveStatusListener(in.status) // ends announceReconnects
		in.status = nil
	}
	if in.svc == nil {
		return nil
	}
	if draining {
		sub, perr := answerPing(in.nc, in.svc)
		if perr == nil {
			in.subs = append(in.subs, sub)
		}
		err = perr
	}
	err = errors.Join(err, in.svc.Stop())
	in.svc = nil
	return err
}

// stopControl ends the cancel subscriptions and the ping's stand-in.
func (in *intake) stopControl() error {
	var err error
	for _, s := range in.subs {
		if e := s.Unsubscribe(); e != nil && !errors.Is(e, nats.ErrConnectionClosed) {
			err = errors.Join(err, e)
		}
	}
	in.subs = nil
	return err
}

// answerPing subscribes svc's ping subject (micro.PingVerb, by its id) on
// nc and answers as svc would, with "draining" in its metadata.
func answerPing(nc *nats.Conn, svc micro.Service) (*nats.Subscription, error) {
	info := svc.Info()
	subj, err := micro.ControlSubject(micro.PingVerb, info.Name, info.ID)
	if err != nil {
		return nil, fmt.Errorf("transfer: ping subject: %w", err)
	}
	id := info.ServiceIdentity
	id.Metadata = maps.Clone(id.Metadata)
	if id.Metadata == nil {
		id.Metadata = map[string]string{}
	}
	id.Metadata["draining"] = "true"
	pong, err := json.Marshal(micro.Ping{ServiceIdentity: id, Type: micro.PingResponseType})
	if err != nil {
		return nil, fmt.Errorf("transfer: ping response: %w", err)
	}
	sub, err := nc.Subscribe(subj, func(m *nats.Msg) { _ = m.Respond(pong) })
	if err != nil {
		return nil, fmt.Errorf("transfer: ping while draining: %w", err)
	}
	return sub, nil
}

// startIntake registers the endpoints and cancel subscriptions and opens the
// registry (without watching or announcing yet). Requests that arrive before
// Start finished are refused (state 3).
func (p *Prefiller) startIntake(ctx context.Context) (reg *Registry, err error) {
	p.mu.Lock()
	if p.state != 0 {
		p.mu.Unlock()
		return nil, fmt.Errorf("%w: prefiller already started", ErrClosed)
	}
	p.state = 3
	p.mu.Unlock()
	c := p.cfg
	var in intake
	defer func() {
		if err != nil {
			_ = in.stop()
		}
	}()
	// One service name for every Prefiller, so that a decoder's ping of
	// an instance ($SRV.PING.<ServiceName>.<id>, writergone.go) reaches a
	// state server too; its subject prefix (metadata) and description
	// tell a decode worker's state server from a prefill worker in
	// `nats micro ls`.
	desc := "prefills prompts and writes their cache into the requester's grant"
	if c.Prefix != wire.DefaultPrefix {
		desc = "serves the states its worker holds (prefill jobs from its cache) on " + c.Prefix + " subjects"
	}
	svc, err := micro.AddService(p.nc, micro.Config{
		Name: wire.ServiceName, Version: wire.ServiceVersion,
		Description: desc,
		Metadata:    map[string]string{"instance": c.Instance, "namespace": c.Namespace, "fingerprint": c.Fingerprint, "prefix": c.Prefix},
	})
	if err != nil {
		return nil, fmt.Errorf("transfer: micro service: %w", err)
	}
	in.svc = svc
	p.svcID = svc.Info().ID // read by self, which the registry calls only after Start announced
	h := micro.HandlerFunc(p.handle)
	if err := svc.AddEndpoint("prefill", h, micro.WithEndpointSubject(wire.Subject(c.Prefix, c.Namespace, wire.SubjectPrefill, "")),
		micro.WithEndpointQueueGroup(wire.PrefillQueue)); err != nil {
		return nil, fmt.Errorf("transfer: prefill endpoint: %w", err)
	}
	if err := svc.AddEndpoint("prefill-direct", h, micro.WithEndpointSubject(wire.Subject(c.Prefix, c.Namespace, wire.SubjectInstancePrefill, c.Instance)),
		micro.WithEndpointQueueGroupDisabled()); err != nil {
		return nil, fmt.Errorf("transfer: prefill endpoint: %w", err)
	}
	for _, subj := range []string{wire.Subject(c.Prefix, c.Namespace, wire.SubjectInstanceCancel, c.Instance), wire.Subject(c.Prefix, c.Namespace, wire.SubjectCancel, "")} {
		sub, err := p.nc.Subscribe(subj, p.onCancel)
		if err != nil {
			return nil, fmt.Errorf("transfer: cancel subscription: %w", err)
		}
		in.subs = append(in.subs, sub)
	}
	in.nc, in.status = p.nc, p.nc.StatusChanged(nats.RECONNECTING, nats.CONNECTED)
	if !c.NoRegistry {
		if reg, err = openRegistry(ctx, p.nc, c.Registry); err != nil {
			return nil, err
		}
		reg.onChange(func(inst wire.Instance, gone bool) {
			if inst.Role != wire.RoleDecode {
				return
			}
			if gone {
				// Deleted or expired, or taken over by a new incarnation
				// (a restart under the same id), which the registry
				// holds already: requests of the new one that came
				// before its entry live on.
				keep := ""
				if now, ok := reg.instance(inst.ID); ok && now.Service != inst.Service {
					keep = now.Service
				}
				p.abortFrom(inst.ID, keep, session.CodePeerFailed)
			}
			p.preconnect(inst, gone)
		})
	}
	p.mu.Lock()
	if p.state != 3 { // Shutdown came while subscribing: it found nothing to stop
		p.mu.Unlock()
		if reg != nil {
			rctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_ = reg.close(rctx)
			cancel()
		}
		return nil, fmt.Errorf("%w: prefiller shut down while starting", ErrClosed)
	}
	p.in, p.reg = in, reg
	// Under p.mu in state 3: Shutdown has not begun waiting for p.wg.
	p.wg.Go(func() { p.announceReconnects(in.status) })
	p.mu.Unlock()
	return reg, nil
}

// announceReconnects tells the decoders each time this instance's NATS
// connection came back after a loss: a request routed to it, or a reply it
// sent, while the connection was down is gone, and nothing else would tell
// the decoder waiting for it before its deadline. Decoders resend, fenced,
// what they still await from this instance. Runs until status is closed.
func (p *Prefiller) announceReconnects(status <-chan nats.Status) {
	down := false
	subj := wire.Subject(p.cfg.Prefix, p.cfg.Namespace, wire.SubjectInstanceReconnected, p.cfg.Instance)
	for st := range status {
		switch st {
		case nats.RECONNECTING:
			down = true
		case nats.CONNECTED:
			if !down {
				continue
			}
			down = false
			if err := p.nc.Publish(subj, nil); err != nil {
				p.cfg.Logger.Warn("announce reconnect", "err", err)
				continue
			}
			p.cfg.Logger.Info("NATS connection back: decoders resend what they still await from this instance")
		}
	}
}

// preconnect connects the data plane to a decode instance when it appears (or
// its agent changes), in the background, bounded by 10 s and by Shutdown.
func (p *Prefiller) preconnect(inst wire.Instance, gone bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if gone {
		delete(p.connected, inst.ID)
		return
	}
	if p.state == 2 || p.connected[inst.ID] == inst.Peer.Agent {
		return
	}
	p.connected[inst.ID] = inst.Peer.Agent
	desc := inst.Peer.Descriptor()
	p.wg.Go(func() {
		ctx, cancel := context.WithTimeout(p.connCtx, 10*time.Second)
		defer cancel()
		tr, err := p.eng.Connect(ctx, desc)
		if err != nil {
			p.cfg.Logger.Warn("pre-connect to decode instance", "peer", inst.ID, "peer_agent", desc.Agent, "err", err)
			p.mu.Lock()
			if p.connected[inst.ID] == inst.Peer.Agent {
				delete(p.connected, inst.ID) // retried on its next heartbeat
			}
			p.mu.Unlock()
			return
		}
		p.cfg.Logger.Info("pre-connected to decode instance", "peer", inst.ID, "peer_agent", desc.Agent, "transport", tr)
	})
}

func (p *Prefiller) self() wire.Instance {
	inst := wire.Instance{ID: p.cfg.Instance, Role: wire.RolePrefill, Fingerprint: p.cfg.Fingerprint, Peer: wire.PeerOf(p.eng.Descriptor()), Service: p.svcID}
	if p.cfg.Capacity != nil {
		inst.Capacity = p.cfg.Capacity()
	}
	inst.Capacity.Inflight = int(p.inflight.Load())
	inst.Draining = p.draining.Load()
	return inst
}

// Registry returns the prefiller's registry (nil with NoRegistry or before Start).
func (p *Prefiller) registry() *Registry {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.reg
}

// Shutdown stops intake (in-flight requests keep running), waits for them
// until ctx is done, then aborts the rest (each releases its lease and replies
// ErrClosed) and waits for them to finish. Idempotent.
//
// Until they are done the instance stays registered (marked draining),
// hears cancels and answers its service's ping (see intake.stopRequests),
// so that decoders neither lose their cancels nor take it for dead.
func (p *Prefiller) Shutdown(ctx context.Context) (err error) {
	p.mu.Lock()
	if p.state == 2 || p.stopping {
		p.mu.Unlock()
		return nil
	}
	p.stopping = true
	reg, serving := p.reg, p.state == 1
	p.mu.Unlock()
	// Decoders hear that we drain before intake stops, and stop picking us;
	// what they sent meanwhile is served (and drained). Stopping first
	// refused it, or, sent through another server of a cluster, lost it on
	// the way (a server answers no-responders to its own clients only):
	// each cost the request one of its attempts. We stay registered for the
	// requests in flight, marked draining.
	if reg != nil && serving && ctx.Err() == nil {
		p.draining.Store(true)
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		if rerr := reg.refresh(rctx); rerr != nil && !errors.Is(rerr, ErrClosed) {
			p.cfg.Logger.Warn("announce draining", "err", rerr)
		}
		cancel()
	}
	p.mu.Lock()
	in := p.stopIntakeLocked()
	p.mu.Unlock()
	err = in.stopRequests(true)
	defer func() { err = errors.Join(err, in.stopControl()) }()
	p.connCancel()

	drained := make(chan struct{})
	go func() { p.wg.Wait(); close(drained) }()
	select {
	case <-drained:
	case <-ctx.Done():
		p.mu.Lock()
		for _, t := range p.tasks {
			for ; t != nil; t = t.next {
				t.abort(session.CodeClosed)
			}
		}
		p.mu.Unlock()
		<-drained
	}
	if reg != nil {
		// The last replies reach the server before the entry goes: a decoder
		// that hears of the deletion has the reply in hand already, and does
		// not fail a handoff that was served.
		_ = p.nc.FlushTimeout(2 * time.Second) // best effort: the connection may be gone
		rctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err = errors.Join(err, reg.close(rctx))
		cancel()
	}
	return err
}

// stopIntakeLocked ends intake (state 2) and hands over what is to be
// stopped, once, for the caller to stop after unlocking. The registry stays
// open until after the drain, so decoders keep seeing us meanwhile.
func (p *Prefiller) stopIntakeLocked() intake {
	if p.state != 2 {
		close(p.quit) // no task is dispatched any more
	}
	p.state = 2
	in := p.in
	p.in = intake{}
	return in
}

func (p *Prefiller) onCancel(m *nats.Msg) {
	c, err := wire.DecodeCancel(m.Data)
	if err != nil {
		p.cfg.Logger.Warn("bad cancel", "err", err)
		return
	}
	code := c.Code
	if code == session.CodeOK {
		code = session.CodeCancelled
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for t := p.tasks[c.RequestID]; t != nil; t = t.next {
		if (c.From == "" || c.From == t.msg.From) && (c.Grant == 0 || c.Grant == t.ticket.Grant) {
			t.abort(code)
		}
	}
}

// abortFrom aborts the requests of the decode instance, except those
// whose replies go to the inbox keep (Instance.Service of a decode
// instance; "": none): the incarnation that took the id over.
func (p *Prefiller) abortFrom(instance, keep string, code session.Code) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, t := range p.tasks {
		for ; t != nil; t = t.next {
			if t.msg.From == instance && !repliesTo(t.reply, keep) {
				t.abort(code)
			}
		}
	}
}

// repliesTo reports whether reply is a subject under inbox ("": none).
func repliesTo(reply, inbox string) bool {
	return inbox != "" && len(reply) > len(inbox) && reply[len(inbox)] == '.' && strings.HasPrefix(reply, inbox)
}
