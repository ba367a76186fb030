package transfer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

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
	// PrefixAffinity sends a prompt that continues one a prefill instance
	// prefilled to that instance first, while it has a free row, where its
	// prefix cache holds the earlier prompt's state (affinity.go).
	PrefixAffinity bool
	// States, when set, routes each request's first attempt by where its
	// longest state lives, from the instances' cache events
	// (route_state.go); PrefixAffinity then applies only where no
	// instance holds any of the prompt.
	States   StateIndex
	Registry RegistryConfig
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
	// CacheKey groups requests that share a prefix (prompt_cache_key): with
	// PrefixAffinity, a request whose prompt continues none remembered goes
	// where the key's last request was prefilled.
	CacheKey string
	// Drafts is the most draft tokens the caller verifies in its first
	// decode step (speculative decoding; 0: none, at most
	// wire.MaxDrafts): the prefill worker drafts up to this many and a
	// reply with more is refused as a bad message.
	Drafts int
	// Skip is how many leading KV blocks of the prompt the caller holds
	// already (its prefix cache's, pinned for the request): Dest's KV
	// extents cover the blocks after them only, and the prefill worker
	// writes only those and the state row (a delta handoff). It must be
	// fewer than the prompt's blocks; 0: the whole prompt.
	Skip int
	// Holder, when set, is the one instance the request goes to: no
	// routing, and a refusal or failure is final (no retry elsewhere).
	// While its subject has no subscriber (restarting, or not subscribed
	// yet) it is asked again with the backoff of NoResponderWait, within
	// it. A state is pulled from the instance that holds it (StatePrefix).
	Holder string
}

// StatePrefix is the subject prefix on which conversation states travel
// back from the decode instances that hold them to prefill instances (a
// wire.StateOffer, then a handoff with the roles swapped: the prefill
// instance's Decoder addresses the holder's Prefiller by Request.Holder),
// in the same namespace, so they never mix with its prefill requests.
func StatePrefix(prefix string) string {
	if prefix == "" {
		prefix = wire.DefaultPrefix
	}
	return prefix + "-state"
}

// Result describes a completed handoff: the request's cache is in its
// Dest, ready for decoding.
type Result struct {
	FirstToken int32
	Logprobs   []byte        // the first token's logprobs, when asked (PrefillReply.Logprobs)
	Cached     int           // prompt tokens the prefill worker's prefix cache served
	Instance   string        // the prefill instance that served it
	Attempts   int           // prefill requests sent
	Prefill    time.Duration // prefill compute time, measured by the prefill worker
	Transfer   time.Duration // write and commit time, measured by the prefill worker
	Total      time.Duration // handoff wall time at the decoder
	KVBytes    uint64
	MambaBytes uint64
	// Drafts are the prefill worker's draft tokens after FirstToken, at
	// most Request.Drafts, each >= 0 (PrefillReply.Drafts); the caller
	// checks them against its vocabulary.
	Drafts []int32
}

// DecoderStats are cumulative counters.
type DecoderStats struct {
	Started, Delivered, Failed uint64
	Retries                    uint64
	InFlight                   int64
	// Published counts NATS messages the decoder published (requests and
	// cancels; heartbeats excluded).
	Published uint64
	// ByState and ByAffinity count first attempts sent to an instance
	// for the state it holds (route_state.go) or by prefix affinity
	// (affinity.go); the others went by load or to the queue group.
	ByState, ByAffinity uint64
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
	stateCost  float64       // c of state-aware routing (route_state.go), under mu
	aff        *affinity     // PrefixAffinity's memory; nil without it

	mu    sync.Mutex
	calls map[string]*call // by reply token
	// gone holds prefill instances reported gone by the data plane
	// (watchWriters) with the heartbeat time of their registry entry then:
	// pick passes them over until the entry is refreshed (a live instance
	// heartbeats again, or a new incarnation took the id over) or expires.
	// Only an incarnation found dead is recorded (writerGone), so one that
	// restarted under the id is usable at once.
	gone map[string]int64
	// watching holds the writers watchWriter pings (under mu).
	watching map[rdma.AgentID]bool
	closed   bool
	done     chan struct{}
	wg       sync.WaitGroup

	maxPayload int64
	started    atomic.Uint64
	delivered  atomic.Uint64
	failed     atomic.Uint64
	retries    atomic.Uint64
	byState    atomic.Uint64
	byAffinity atomic.Uint64
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
	if cfg.PrefixAffinity {
		d.aff = newAffinity(cfg.Fingerprint, affinityEntries)
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
			_ = d.resub.Unsubscribe()
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
	// Close with a ctx of its own: ctx may be what ended the start, and the
	// entry just announced must still be deleted.
	closeReg := func() {
		cctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_ = reg.close(cctx)
		cancel()
	}
	if err := reg.announce(ctx, d.self); err != nil {
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

// self is the decoder's registry entry. Its Service is the reply inbox,
// new in every process: it names the incarnation, as a prefill instance's
// micro service does, so that prefill workers take a restart under the
// same id for the old incarnation's death (Registry.apply) and tell its
// requests, whose replies go to that inbox, from the new one's.
func (d *Decoder) self() wire.Instance {
	return wire.Instance{ID: d.cfg.Instance, Role: wire.RoleDecode, Fingerprint: d.cfg.Fingerprint, Peer: d.peer,
		Capacity: wire.Capacity{Inflight: int(d.inflight.Load())}, Service: d.inbox}
}

// Registry returns the decoder's registry (nil with NoRegistry).
func (d *Decoder) Registry() *Registry { return d.reg }

// Stats returns cumulative counters.
func (d *Decoder) Stats() DecoderStats {
	return DecoderStats{
		Started: d.started.Load(), Delivered: d.delivered.Load(), Failed: d.failed.Load(),
		Retries: d.retries.Load(), InFlight: d.inflight.Load(), Published: d.published.Load(),
		ByState: d.byState.Load(), ByAffinity: d.byAffinity.Load(),
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
