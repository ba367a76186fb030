package transfer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/trace"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/transfer/wire"
)

// DecoderConfig configures a Decoder.
type DecoderConfig struct {
	Instance       string        // unique instance id, a token of [A-Za-z0-9_-]; required
	Namespace      string        // required, a token
	Prefix         string        // default DefaultPrefix
	Fingerprint    string        // the model's layout fingerprint; required
	MaxDraftTokens int           // width of the padding-sentinel id range (mambacache.Config.MaxDraftTokens)
	TP             int           // tensor-parallel shards per rank (PrefillRequest.TP); 0 means 1
	DefaultTimeout time.Duration // deadline when neither the Request nor ctx has one; default 30s
	MaxAttempts    int           // prefill attempts per request (retries only where safe); default 3
	// NoResponderWait is how long a request nobody serves (no prefill
	// worker subscribed: restarting, or resubscribing after a NATS
	// reconnect) is sent again with a backoff before it fails with
	// ErrNoPrefillWorker; default 5s, negative: fail at once.
	NoResponderWait time.Duration
	// DirectFirst sends the first attempt to the live prefill instance with
	// the fewest requests in flight (from the registry) instead of the queue
	// group, so the decoder knows its peer from the start and a peer that dies
	// fails the handoff at once rather than at the deadline. Falls back to the
	// queue group when the registry knows no instance.
	DirectFirst bool
	Registry    RegistryConfig
	// NoRegistry skips the instance registry (no announce, no watch, no
	// targeted retries, no peer-death detection). For tools and tests.
	NoRegistry bool
	Logger     *slog.Logger
}

func (c *DecoderConfig) validate() error {
	if c.Prefix == "" {
		c.Prefix = wire.DefaultPrefix
	}
	if !wire.ValidToken(c.Instance) || !wire.ValidToken(c.Namespace) || !wire.ValidToken(c.Prefix) {
		return fmt.Errorf("%w: instance %q, namespace %q and prefix %q must be tokens of [A-Za-z0-9_-]", ErrInvalidConfig, c.Instance, c.Namespace, c.Prefix)
	}
	if c.Fingerprint == "" {
		return fmt.Errorf("%w: empty layout fingerprint", ErrInvalidConfig)
	}
	if c.TP < 0 || c.TP > 1<<16-1 {
		return fmt.Errorf("%w: TP %d", ErrInvalidConfig, c.TP)
	}
	if c.DefaultTimeout == 0 {
		c.DefaultTimeout = 30 * time.Second
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 3
	}
	if c.NoResponderWait == 0 {
		c.NoResponderWait = 5 * time.Second
	}
	if c.DefaultTimeout < 0 || c.MaxAttempts < 1 || c.MaxDraftTokens < 0 {
		return fmt.Errorf("%w: timeout %v, attempts %d, draft tokens %d", ErrInvalidConfig, c.DefaultTimeout, c.MaxAttempts, c.MaxDraftTokens)
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

// Request is one handoff a Decoder performs.
type Request struct {
	ID       uint64 // never 0 nor a padding sentinel
	Tokens   []int32
	Sampling wire.Sampling
	Deadline time.Time // zero: ctx's deadline, else now + DefaultTimeout
	// Dest is where the cache lands: the request's KV runs and Mamba row in
	// this decoder's registered regions (RankRegions.Resolve). The caller
	// allocated them and frees them once Handoff returned: at once on
	// success when the request finishes, on failure at once too, except
	// for a QuarantinedError, whose Released channel says when.
	Dest CacheExtents
}

// Result describes a completed handoff: the request's cache is in its
// Dest, ready for decoding.
type Result struct {
	FirstToken int32
	Logprobs   []byte        // the first token's logprobs, when asked (PrefillReply.Logprobs)
	Instance   string        // the prefill instance that served it
	Attempts   int           // prefill requests sent
	Prefill    time.Duration // prefill compute time, measured by the prefill worker
	Transfer   time.Duration // write and commit time, measured by the prefill worker
	Total      time.Duration // handoff wall time at the decoder
	KVBytes    uint64
	MambaBytes uint64
}

// DecoderStats are cumulative counters.
type DecoderStats struct {
	Started, Delivered, Failed uint64
	Retries                    uint64
	InFlight                   int64
	// Published counts NATS messages the decoder published (requests and
	// cancels; heartbeats excluded).
	Published uint64
}

// publisher is what a Decoder needs from NATS on the request path
// (*nats.Conn; a recorder in tests). Like *nats.Conn, which copies a message
// into its write buffer, it must not keep data after returning: the decoder
// reuses the buffer.
type publisher interface {
	PublishRequest(subj, reply string, data []byte) error
	Publish(subj string, data []byte) error
}

var _ publisher = (*nats.Conn)(nil)

// receiverEngine is what a Decoder needs from the data plane.
type receiverEngine interface {
	OpenGrant(spec rdma.GrantSpec) (*rdma.Grant, error)
	Descriptor() rdma.Descriptor
	WriterConnected(agent rdma.AgentID) bool // writer watch (writergone.go)
}

var _ receiverEngine = (*rdma.Engine)(nil)

// Decoder is the receiving side of the handoff protocol: for a destination its
// caller allocated, it opens a grant, asks a prefill worker over NATS to fill it and
// accepts the cache only when the reply and the commit agree. Safe for
// concurrent use: one Handoff per request.
type Decoder struct {
	cfg  DecoderConfig
	nc   *nats.Conn
	pub  publisher
	eng  receiverEngine
	peer wire.Peer // our descriptor, encoded once
	reg  *Registry

	inbox      string
	sub        *nats.Subscription
	resub      *nats.Subscription // prefill instances' reconnect notices
	status     chan nats.Status   // this connection's reconnects (watchReconnects)
	prefillSub string             // the shared prefill subject
	unwatch    func()             // stops the writer-gone reports (watchWriters)
	seq        atomic.Uint64
	picks      atomic.Uint64 // round-robin offset of pick

	mu    sync.Mutex
	calls map[string]*call // by reply token
	// gone holds prefill instances reported gone by the data plane
	// (watchWriters) with the heartbeat time of their registry entry then:
	// pick passes them over until the entry is refreshed (a live instance
	// heartbeats again, or a new incarnation took the id over) or expires.
	// Only an incarnation found dead is recorded (writerGone), so one that
	// restarted under the id is usable at once.
	gone   map[string]int64
	closed bool
	done   chan struct{}
	wg     sync.WaitGroup

	maxPayload int64
	started    atomic.Uint64
	delivered  atomic.Uint64
	failed     atomic.Uint64
	retries    atomic.Uint64
	inflight   atomic.Int64
	published  atomic.Uint64
}

// call is one Handoff's mailbox, written by NATS and registry callbacks.
type call struct {
	replies chan *nats.Msg // size 2: a reply and one duplicate; more are dropped
	// died signals that dead or lost holds instances (size 1: one pending
	// signal covers any number of notes). Every note is kept, not only the
	// first: an unrelated instance may die just before the one this call
	// waits on.
	died chan struct{}
	dead []string // prefill instances that left since the last take (under Decoder.mu)
	// lost holds the instances whose NATS connection dropped and came back
	// since the last take, "" for this decoder's own (under Decoder.mu).
	lost   []string
	target string // the instance addressed directly, if any (under Decoder.mu)
	// svc is the micro service (the incarnation: Instance.Service) target's
	// registry entry named when it was addressed, anyIncarnation when not
	// known (under Decoder.mu): the death of another incarnation under the
	// same id is not this call's.
	svc string
}

func (c *call) init() {
	c.replies, c.died = make(chan *nats.Msg, 2), make(chan struct{}, 1)
}

// takeNotes returns and clears what c was told of, as session events:
// deaths, then control connections lost.
func (d *Decoder) takeNotes(c *call) []session.Event {
	d.mu.Lock()
	defer d.mu.Unlock()
	var evs []session.Event
	for _, inst := range c.dead {
		evs = append(evs, session.Event{Kind: session.EvPeerDied, Instance: inst})
	}
	for _, inst := range c.lost {
		evs = append(evs, session.Event{Kind: session.EvLost, Instance: inst})
	}
	c.dead, c.lost = nil, nil
	return evs
}

// NewDecoder subscribes the decoder's reply inbox and, unless NoRegistry,
// announces the instance and watches prefill instances. Close undoes it.
func NewDecoder(ctx context.Context, cfg DecoderConfig, nc *nats.Conn, eng *rdma.Engine) (*Decoder, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	d := &Decoder{
		cfg: cfg, nc: nc, pub: nc, eng: eng, peer: wire.PeerOf(eng.Descriptor()),
		inbox: nats.NewInbox(), calls: map[string]*call{}, done: make(chan struct{}),
		maxPayload: nc.MaxPayload(), prefillSub: wire.Subject(cfg.Prefix, cfg.Namespace, wire.SubjectPrefill, ""),
	}
	sub, err := nc.Subscribe(d.inbox+".*", d.onReply)
	if err != nil {
		return nil, fmt.Errorf("transfer: decoder inbox: %w", err)
	}
	d.sub = sub
	if d.resub, err = nc.Subscribe(wire.Subject(cfg.Prefix, cfg.Namespace, wire.SubjectInstanceReconnected, "*"), d.onReconnected); err != nil {
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("transfer: decoder reconnect notices: %w", err)
	}
	if !cfg.NoRegistry {
		if err := d.startRegistry(ctx); err != nil {
			_ = sub.Unsubscribe()
			return nil, err
		}
	}
	if err := nc.Flush(); err != nil {
		d.Close()
		return nil, fmt.Errorf("transfer: decoder flush: %w", err)
	}
	d.watchWriters(eng)
	d.status = nc.StatusChanged(nats.RECONNECTING, nats.CONNECTED)
	d.wg.Go(d.watchReconnects)
	return d, nil
}

// watchReconnects notes, each time this decoder's NATS connection came back
// after a loss, that every handoff's request or reply in flight may have been
// lost with it: their sessions resend, fenced, what is still unanswered
// rather than wait for the deadline. Runs until Close removes the listener.
func (d *Decoder) watchReconnects() {
	down := false
	for st := range d.status {
		switch st {
		case nats.RECONNECTING:
			down = true
		case nats.CONNECTED:
			if down {
				down = false
				d.cfg.Logger.Info("NATS connection back: resending the prefill requests still unanswered")
				d.controlLost("")
			}
		}
	}
}

// onReconnected takes a prefill instance's notice that its NATS connection
// came back (Prefiller.announceReconnects).
func (d *Decoder) onReconnected(m *nats.Msg) {
	// <prefix>.<ns>.inst.<id>.reconnected
	parts := strings.Split(m.Subject, ".")
	if len(parts) < 2 || !wire.ValidToken(parts[len(parts)-2]) {
		return
	}
	d.controlLost(parts[len(parts)-2])
}

// controlLost tells every handoff in flight that instance's control
// connection ("" this decoder's own) was lost and is back.
func (d *Decoder) controlLost(instance string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range d.calls {
		if !slices.Contains(c.lost, instance) {
			c.lost = append(c.lost, instance)
		}
		select {
		case c.died <- struct{}{}:
		default:
		}
	}
}

func (d *Decoder) startRegistry(ctx context.Context) error {
	reg, err := openRegistry(ctx, d.nc, d.cfg.Registry)
	if err != nil {
		return err
	}
	reg.onChange(func(inst wire.Instance, gone bool) {
		if inst.Role != wire.RolePrefill {
			return
		}
		d.mu.Lock()
		if at, ok := d.gone[inst.ID]; ok && (gone || inst.Updated != at) {
			delete(d.gone, inst.ID) // expired, or heartbeating again
		}
		d.mu.Unlock()
		if gone {
			// Expired or deleted, or taken over by a new incarnation (the
			// registry reports the old one gone first): the handoffs that
			// addressed the new one are not told.
			d.incarnationDied(inst.ID, inst.Service)
		}
	})
	self := func() wire.Instance {
		return wire.Instance{ID: d.cfg.Instance, Role: wire.RoleDecode, Fingerprint: d.cfg.Fingerprint, Peer: d.peer,
			Capacity: wire.Capacity{Inflight: int(d.inflight.Load())}}
	}
	// Close with a ctx of its own: ctx may be what ended the start, and the
	// entry just announced must still be deleted.
	closeReg := func() {
		cctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_ = reg.close(cctx)
		cancel()
	}
	if err := reg.announce(ctx, self); err != nil {
		closeReg()
		return err
	}
	if err := reg.watch(ctx, wire.RolePrefill); err != nil {
		closeReg()
		return err
	}
	d.reg = reg
	return nil
}

// Registry returns the decoder's registry (nil with NoRegistry).
func (d *Decoder) Registry() *Registry { return d.reg }

// Stats returns cumulative counters.
func (d *Decoder) Stats() DecoderStats {
	return DecoderStats{
		Started: d.started.Load(), Delivered: d.delivered.Load(), Failed: d.failed.Load(),
		Retries: d.retries.Load(), InFlight: d.inflight.Load(), Published: d.published.Load(),
	}
}

func (d *Decoder) onReply(m *nats.Msg) {
	tok, _ := replyToken(m.Subject[len(d.inbox)+1:])
	d.mu.Lock()
	defer d.mu.Unlock()
	c := d.calls[tok]
	if c == nil {
		return // late reply of a finished handoff
	}
	select {
	case c.replies <- m:
	default: // a third copy: the session ignores duplicates anyway
	}
}

// anyIncarnation, as the service of incarnationDied, stands for every
// incarnation of the instance. Not a micro service id (those are nuids).
const anyIncarnation = "*"

// peerDied tells every handoff in flight that instance died, whichever
// incarnation of it it addressed.
func (d *Decoder) peerDied(instance string) { d.incarnationDied(instance, anyIncarnation) }

// incarnationDied tells the handoffs in flight that the incarnation of
// instance whose micro service is svc (Instance.Service; anyIncarnation:
// whichever) died. A handoff that addressed another incarnation under the
// same id is not told: that one lives (a restart took the id over, and the
// handoff was addressed to the new process). Every other one is; its
// session acts on it only where it waits on instance. A request sent
// through the queue group names its incarnation nowhere: one the new
// incarnation answered and whose commit is still on its way is told too,
// and costs a fenced retry, never a wrong byte.
func (d *Decoder) incarnationDied(instance, svc string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range d.calls {
		if c.target == instance && svc != anyIncarnation && c.svc != anyIncarnation && c.svc != svc {
			continue
		}
		if !slices.Contains(c.dead, instance) {
			c.dead = append(c.dead, instance)
		}
		select {
		case c.died <- struct{}{}:
		default: // a signal is pending; the taker sees this death too
		}
	}
}

// Close fails in-flight handoffs with ErrClosed (each revokes and frees before
// its Handoff returns), waits for them, and removes the subscription and the
// registry entry. Idempotent.
func (d *Decoder) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	close(d.done)
	d.mu.Unlock()
	if d.unwatch != nil {
		d.unwatch()
	}
	d.nc.RemoveStatusListener(d.status) // ends watchReconnects
	d.wg.Wait()
	err := errors.Join(d.sub.Unsubscribe(), d.resub.Unsubscribe())
	if errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrBadSubscription) {
		err = nil
	}
	if d.reg != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err = errors.Join(err, d.reg.close(ctx))
		cancel()
	}
	return err
}

// handoff is the driver state of one Handoff: the session plus the IO handles
// its actions need. Owned by the Handoff goroutine.
type handoff struct {
	d        *Decoder
	req      Request
	start    time.Time // Handoff's start: a monotonic reading, see now
	deadline time.Time
	sess     session.RecvSession
	reply    string // the reply subject of attempt 1: the inbox and tok
	tok      string // the call's token, a suffix of reply
	attempt  int    // the attempt last sent
	c        *call
	mailbox  call       // what c points to: one allocation for the handoff
	span     trace.Span // the handoff's span when traced (see trace.go), else nil

	kvB    uint64
	mB     uint64
	grant  *rdma.Grant
	doneCh <-chan struct{} // the grant's Done while it is watched, else nil
	// failCh is the grant's Failed while it is watched, else nil. Until an
	// OK reply arrives the handoff waits on failCh, not doneCh: a commit
	// alone decides nothing (the reply must agree), so it need not wake the
	// handoff; a grant that fails still does.
	failCh  <-chan struct{}
	replied bool // an OK reply arrived: the commit is what is awaited now
	// held is the Done of a revoked grant left quarantined (a live writer
	// still inside a copy into the destination), nil otherwise: the
	// destination stays out of use until it closes.
	held <-chan struct{}

	cause error // the most specific error behind a failure
	ok    wire.PrefillReply
}

// Handoff runs one request's handoff and returns once it is delivered or
// failed. On failure the grant is revoked before it returns, so no byte lands
// in req.Dest any more and the caller may free it, except when the error is
// a *QuarantinedError (a live writer may still copy into it: free it once
// Released is closed). The error wraps one of the package sentinels; a
// remote refusal is a *RemoteError.
func (d *Decoder) Handoff(ctx context.Context, req Request) (Result, error) {
	start := time.Now()
	if req.Dest.Mamba.Length == 0 || len(req.Tokens) == 0 {
		return Result{}, fmt.Errorf("%w: request %d without destination or tokens", ErrInvalidConfig, req.ID)
	}
	deadline := req.Deadline
	if dl, ok := ctx.Deadline(); ok && (deadline.IsZero() || dl.Before(deadline)) {
		deadline = dl
	}
	if deadline.IsZero() {
		deadline = start.Add(d.cfg.DefaultTimeout)
	} else {
		// On the monotonic clock from here on, as every time this handoff
		// compares against it (a wall-clock step must not move it).
		deadline = start.Add(deadline.Sub(start))
	}
	h := new(handoff)
	h.mailbox.init()
	h.d, h.req, h.start, h.deadline = d, req, start, deadline
	h.kvB, h.mB = req.Dest.bytes()
	h.sess.Reset(session.RecvParams{
		RequestID: req.ID, MaxDraftTokens: d.cfg.MaxDraftTokens, Deadline: deadline, MaxAttempts: d.cfg.MaxAttempts,
		QuietWait: max(d.cfg.NoResponderWait, 0),
	})
	var sb [64]byte
	h.reply = string(strconv.AppendUint(append(append(sb[:0], d.inbox...), '.'), d.seq.Add(1), 36))
	h.tok = h.reply[len(d.inbox)+1:]
	h.c = &h.mailbox
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return Result{}, ErrClosed
	}
	d.calls[h.tok] = h.c
	d.wg.Add(1)
	d.mu.Unlock()
	d.started.Add(1)
	d.inflight.Add(1)
	defer func() {
		d.mu.Lock()
		delete(d.calls, h.tok)
		d.mu.Unlock()
		d.inflight.Add(-1)
		d.wg.Done()
	}()

	h.span = startHandoffSpan(ctx, &req)
	res, err := h.run(ctx, start)
	if h.span != nil {
		endHandoffSpan(h.span, &res, h.sess.Attempts(), err)
	}
	if err != nil {
		d.failed.Add(1)
		return Result{}, err
	}
	d.delivered.Add(1)
	return res, nil
}

func (h *handoff) run(ctx context.Context, start time.Time) (Result, error) {
	timer := time.NewTimer(h.deadline.Sub(start))
	defer timer.Stop()
	// The queue of actions to execute; a Step's actions are copied in at once
	// (the session reuses its slice).
	var queue [8]session.Action
	acts := append(queue[:0], h.step(session.Event{Kind: session.EvStart, Now: start})...)
	armed := h.deadline // what timer fires at
	for {
		for len(acts) > 0 {
			a := acts[0]
			acts = acts[1:]
			switch a.Kind {
			case session.ActDeliver:
				if log := h.d.cfg.Logger; log.Enabled(ctx, slog.LevelDebug) {
					log.Debug("handoff delivered", "seq", h.req.ID, "peer", h.sess.Instance())
				}
				return Result{
					FirstToken: h.ok.FirstToken, Logprobs: h.ok.Logprobs, Instance: h.ok.Instance, Attempts: h.sess.Attempts(),
					Prefill: time.Duration(h.ok.PrefillNanos), Transfer: time.Duration(h.ok.WriteNanos),
					Total: time.Since(start), KVBytes: h.kvB, MambaBytes: h.mB,
				}, nil
			case session.ActFail:
				err := h.failure(a.Code)
				if log := h.d.cfg.Logger; log.Enabled(ctx, slog.LevelDebug) {
					log.Debug("handoff failed", "seq", h.req.ID, "err", err)
				}
				return Result{}, err
			default:
				if ev, ok := h.exec(a); ok {
					acts = append(acts, h.step(ev)...)
				}
			}
		}
		var ev session.Event
		var early []session.Action // outcomes of events taken along with ev
		grantCh := h.failCh
		if h.replied {
			grantCh = h.doneCh
			// The writer commits before it replies, so the grant is usually
			// done once the reply is in: take it without the full select.
			select {
			case <-grantCh: // nil once taken: never ready
				ev = h.grantEvent()
				ev.Now = h.now()
				acts = append(queue[:0], h.step(ev)...) // acts was drained
				continue
			default:
			}
		}
		select {
		case m := <-h.c.replies:
			ev = h.replyEvent(m)
		case <-grantCh:
			ev = h.grantEvent()
		case <-h.c.died:
			notes := h.d.takeNotes(h.c)
			if len(notes) == 0 {
				continue // taken with an earlier signal
			}
			// A reply or commit already delivered came before the death or
			// loss was seen (a draining worker replies, then leaves the
			// registry): apply it first, or a handoff that succeeded would
			// fail.
			early = h.delivered()
			for _, n := range notes[:len(notes)-1] {
				n.Now = h.now()
				early = append(early, h.step(n)...)
			}
			ev = notes[len(notes)-1]
		case <-timer.C:
			ev = session.Event{Kind: session.EvTick}
		case <-ctx.Done():
			h.setCause(context.Cause(ctx))
			ev = session.Event{Kind: session.EvCancel, Code: session.CodeCancelled}
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				ev.Code = session.CodeTimeout
			}
		case <-h.d.done:
			ev = session.Event{Kind: session.EvCancel, Code: session.CodeClosed}
		}
		ev.Now = h.now()
		acts = append(append(queue[:0], early...), h.step(ev)...) // acts was drained
		// Tick when the session wants it; re-arm after a tick that came
		// early.
		want := h.sess.WakeAt()
		if (!want.Equal(armed) || ev.Kind == session.EvTick) && !h.sess.State().Terminal() {
			timer.Reset(time.Until(want))
			armed = want
		}
	}
}

// now reads the clock as the monotonic time since the handoff's start: half
// the cost of time.Now (one clock read, not two), and as good for the
// deadline checks, which compare monotonic readings.
func (h *handoff) now() time.Time { return h.start.Add(time.Since(h.start)) }

// grantEvent is the event of the grant's end (h.doneCh or h.failCh closed).
func (h *handoff) grantEvent() session.Event {
	h.doneCh, h.failCh = nil, nil
	if err := h.grant.Err(); err != nil { // failed: Done may wait on a quarantine
		h.setCause(err)
		return session.Event{Kind: session.EvGrantFailed, Code: rdmaCode(err)}
	}
	m, err := h.grant.Wait(context.Background()) // committed: returns at once
	if err != nil {
		h.setCause(err)
		return session.Event{Kind: session.EvGrantFailed, Code: rdmaCode(err)}
	}
	return session.Event{Kind: session.EvCommitted, Manifest: session.Manifest(m)}
}

// delivered steps the replies and the grant's end that are already there,
// without waiting, and returns the actions.
func (h *handoff) delivered() []session.Action {
	var acts []session.Action
	for {
		select {
		case m := <-h.c.replies:
			ev := h.replyEvent(m)
			ev.Now = time.Now()
			acts = append(acts, h.step(ev)...)
			continue
		case <-h.doneCh: // nil once taken: never ready
			ev := h.grantEvent()
			ev.Now = time.Now()
			acts = append(acts, h.step(ev)...)
			continue
		default:
		}
		return acts
	}
}

// exec performs a non-terminal action. It returns the outcome event of
// synchronous actions.
func (h *handoff) exec(a session.Action) (session.Event, bool) {
	now := h.now
	switch a.Kind {
	case session.ActOpenGrant:
		// A re-grant after a dead peer: the old grant is revoked already, and
		// what it carried (its end, an OK reply of its attempt) is dropped.
		h.grant, h.doneCh, h.failCh, h.replied, h.ok = nil, nil, nil, false, wire.PrefillReply{}
		exts := h.req.Dest.extents()
		g, err := h.d.eng.OpenGrant(rdma.GrantSpec{RequestID: h.req.ID, Extents: exts, Deadline: h.deadline})
		if err != nil {
			h.setCause(err)
			return session.Event{Kind: session.EvGranted, Now: now(), Code: rdmaCode(err)}, true
		}
		h.grant = g
		expected := make([]uint64, len(exts))
		for i, e := range exts {
			expected[i] = e.Length
		}
		h.doneCh, h.failCh = g.Done(), g.Failed()
		return session.Event{Kind: session.EvGranted, Now: now(), Expected: expected}, true
	case session.ActSendRequest:
		target, err := h.send(a)
		if err != nil {
			h.setCause(err)
			return session.Event{Kind: session.EvSent, Now: now(), Code: codeOf(err)}, true
		}
		if a.Attempt > 1 {
			h.d.retries.Add(1)
		}
		return session.Event{Kind: session.EvSent, Now: now(), Instance: target}, true
	case session.ActPublishCancel:
		subj := wire.Subject(h.d.cfg.Prefix, h.d.cfg.Namespace, wire.SubjectCancel, "")
		if a.Instance != "" {
			subj = wire.Subject(h.d.cfg.Prefix, h.d.cfg.Namespace, wire.SubjectInstanceCancel, a.Instance)
		}
		var grant uint64
		if h.grant != nil {
			grant = h.grant.Ticket().Grant
		}
		b, err := wire.EncodeCancel(wire.Cancel{RequestID: h.req.ID, Grant: grant, Code: a.Code, From: h.d.cfg.Instance})
		if err == nil {
			err = h.d.pub.Publish(subj, b)
			h.d.published.Add(1)
		}
		if err != nil { // best effort: the revoke that follows is the fence
			h.d.cfg.Logger.Warn("publish cancel", "seq", h.req.ID, "err", err)
		}
	case session.ActRevoke:
		if h.grant != nil {
			h.grant.Revoke()
			if h.grant.Quarantined() {
				h.held = h.grant.Done()
			}
		}
	}
	return session.Event{}, false
}

// send publishes the prefill request for attempt a. Retries go to a live
// prefill instance that has not refused this request, when the registry knows
// one; otherwise to the queue group.
func (h *handoff) send(a session.Action) (string, error) {
	d := h.d
	subj := d.prefillSub
	target, svc := a.Instance, anyIncarnation // the session names no incarnation
	if target == "" && (a.Attempt > 1 || d.cfg.DirectFirst || a.Live) && d.reg != nil {
		inst := d.pick(a.Exclude)
		target, svc = inst.ID, inst.Service
	}
	if target == "" && a.Live {
		// The queue group could hand the request back to the instance reported
		// dead (it may only be partitioned): only a known live one will do.
		return "", fmt.Errorf("%w: no other live prefill instance (excluded %v)", ErrPeerFailed, a.Exclude)
	}
	if target != "" {
		subj = wire.Subject(d.cfg.Prefix, d.cfg.Namespace, wire.SubjectInstancePrefill, target)
	}
	d.mu.Lock()
	h.c.target, h.c.svc = target, svc // "" after a fall-back to the queue group: pick stops counting it
	d.mu.Unlock()
	tk := h.grant.Ticket()
	msg := wire.PrefillRequest{
		RequestID: h.req.ID, From: d.cfg.Instance, Attempt: uint8(min(a.Attempt, 255)), Fingerprint: d.cfg.Fingerprint,
		Tokens: h.req.Tokens, Sampling: h.req.Sampling, Deadline: h.deadline.UnixNano(), Budget: int64(time.Until(h.deadline)), Peer: d.peer,
		Ticket: tk, KVBytes: h.kvB, MambaBytes: h.mB, TP: wireTP(d.cfg.TP),
	}
	buf := getMsgBuf()
	b, err := wire.AppendPrefillRequest(*buf, &msg, d.maxPayload)
	if err != nil {
		putMsgBuf(buf, *buf)
		return "", err
	}
	d.published.Add(1)
	h.attempt = a.Attempt
	reply := h.reply
	if a.Attempt > 1 {
		// Each retry has a reply subject of its own, so that an answer is
		// told apart from the earlier attempts' (replyToken): a
		// no-responders names nothing else.
		reply += "-" + strconv.Itoa(a.Attempt)
	}
	err = h.publishRequest(subj, reply, b)
	putMsgBuf(buf, b) // the publisher copied it
	if err != nil {
		if errors.Is(err, nats.ErrMaxPayload) {
			return "", fmt.Errorf("%w: %w", ErrPayloadTooLarge, err)
		}
		return "", fmt.Errorf("%w: publish: %w", ErrClosed, err)
	}
	return target, nil
}

// pick chooses the live prefill instance with the same layout, not draining
// and not in exclude, with the least load: the requests it announced in flight (as of its
// last heartbeat) plus the ones this decoder addressed to it since. Ties go
// round-robin, so a burst between two heartbeats spreads out. It returns
// the instance's registry entry, or the zero Instance when none will do.
func (d *Decoder) pick(exclude []string) wire.Instance {
	insts := d.reg.Instances(wire.RolePrefill, time.Now())
	if len(insts) == 0 {
		return wire.Instance{}
	}
	d.mu.Lock()
	mine := make(map[string]int, len(insts))
	for _, c := range d.calls {
		if c.target != "" {
			mine[c.target]++
		}
	}
	var gone map[string]int64
	if len(d.gone) > 0 {
		gone = maps.Clone(d.gone)
	}
	d.mu.Unlock()
	var target wire.Instance
	best := 0
	off := int(d.picks.Add(1))
	for i := range insts {
		inst := insts[(off+i)%len(insts)]
		if inst.Fingerprint != d.cfg.Fingerprint || inst.Draining || containsStr(exclude, inst.ID) {
			continue
		}
		if at, ok := gone[inst.ID]; ok && inst.Updated == at {
			continue // reported gone, no heartbeat since
		}
		if load := inst.Capacity.Inflight + mine[inst.ID]; target.ID == "" || load < best {
			target, best = inst, load
		}
	}
	return target
}

func containsStr(xs []string, s string) bool {
	for _, x := range xs {
		if x == s {
			return true
		}
	}
	return false
}

// replyToken splits the last token of a reply subject into the call's
// token and the attempt it answers: "tok" is attempt 1, "tok-N" attempt N.
func replyToken(s string) (tok string, attempt int) {
	i := strings.LastIndexByte(s, '-')
	if i < 0 {
		return s, 1
	}
	n, err := strconv.Atoi(s[i+1:])
	if err != nil || n < 2 {
		return s, -1 // not a subject this decoder made: no call has this token
	}
	return s[:i], n
}

func (h *handoff) replyEvent(m *nats.Msg) session.Event {
	_, attempt := replyToken(m.Subject[len(h.d.inbox)+1:])
	if attempt != h.attempt {
		// An answer to an earlier attempt: the session drops it, and
		// nothing of it may stand as this attempt's reply or cause.
		return session.Event{Kind: session.EvReply, Code: session.CodeBadMessage, Attempt: attempt}
	}
	if m.Header.Get("Status") == "503" {
		return session.Event{Kind: session.EvNoResponders, Attempt: attempt}
	}
	r, err := wire.DecodePrefillReply(m.Data)
	if err != nil || r.RequestID != h.req.ID {
		if err == nil {
			err = fmt.Errorf("%w: reply names request %d", ErrBadMessage, r.RequestID)
		}
		h.setCause(err)
		return session.Event{Kind: session.EvReply, Code: session.CodeBadMessage}
	}
	if r.Code == session.CodeOK && !h.sess.Ignores(r.Instance) {
		h.ok = r
		h.replied = true
	} else {
		h.setCause(&RemoteError{Code: r.Code, Msg: r.Msg, Instance: r.Instance})
	}
	return session.Event{Kind: session.EvReply, Code: r.Code, Instance: r.Instance, Manifest: session.Manifest(r.Manifest), Attempt: attempt}
}

func (h *handoff) setCause(err error) { h.cause = err }

// failure builds the error Handoff returns for code. It wraps the most
// specific cause seen (a remote refusal, a data-plane or pool error, the
// context's) unless that cause belongs to another class (say, an earlier
// attempt's refusal behind a final no-responders): then it is only quoted,
// so that the error matches exactly one of the package's sentinels.
func (h *handoff) failure(code session.Code) error {
	err := h.failureErr(code)
	if h.held != nil {
		select {
		case <-h.held:
		default:
			return &QuarantinedError{Err: err, released: h.held}
		}
	}
	return err
}

func (h *handoff) failureErr(code session.Code) error {
	if h.cause == nil {
		return fmt.Errorf("transfer: request %d: %w", h.req.ID, codeErr(code))
	}
	if errors.Is(h.cause, codeErr(code)) {
		return fmt.Errorf("transfer: request %d: %w", h.req.ID, h.cause)
	}
	for c := session.Code(1); c < session.NumCodes; c++ {
		if c != code && errors.Is(h.cause, codeErr(c)) {
			return fmt.Errorf("transfer: request %d: %w (after: %v)", h.req.ID, codeErr(code), h.cause)
		}
	}
	return fmt.Errorf("transfer: request %d: %w: %w", h.req.ID, codeErr(code), h.cause)
}

// rdmaCode classifies a data-plane error.
func rdmaCode(err error) session.Code {
	switch {
	case err == nil:
		return session.CodeOK
	case errors.Is(err, rdma.ErrBadRequestID), errors.Is(err, rdma.ErrForbidden):
		return session.CodeDummyRequest
	case errors.Is(err, rdma.ErrDeadline), errors.Is(err, context.DeadlineExceeded):
		return session.CodeTimeout
	case errors.Is(err, rdma.ErrRevoked), errors.Is(err, rdma.ErrUnknownGrant),
		errors.Is(err, rdma.ErrStaleEpoch), errors.Is(err, rdma.ErrBadToken), errors.Is(err, context.Canceled):
		return session.CodeCancelled
	case errors.Is(err, rdma.ErrManifestMismatch):
		return session.CodeIntegrity
	case errors.Is(err, rdma.ErrOutOfRange):
		return session.CodeLayoutMismatch
	case errors.Is(err, rdma.ErrClosed):
		return session.CodeClosed
	default:
		return session.CodePeerFailed
	}
}

// step applies ev to the session and returns its actions; at debug level
// it logs the transition (the request's trace through its session).
func (h *handoff) step(ev session.Event) []session.Action {
	acts := h.sess.Step(ev)
	if log := h.d.cfg.Logger; log.Enabled(context.Background(), slog.LevelDebug) {
		log.Debug("handoff step", "seq", h.req.ID, "event", ev.Kind.String(), "code", ev.Code.String(),
			"peer", ev.Instance, "attempt", ev.Attempt, "state", h.sess.State().String(), "actions", fmt.Sprint(acts))
	}
	return acts
}
