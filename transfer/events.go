package transfer

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/kvevents"
	"github.com/handoff-io/handoff/prefix"
	"github.com/handoff-io/handoff/transfer/wire"
)

// Cache events over NATS: a worker publishes what each rank's prefix cache
// holds as it changes (EventPublisher), and a decoder keeps an index of
// every instance's (EventSubscriber) to send a prompt where its longest
// state lives (pickByState).
//
// Each rank is a stream of kvevents batches on the instance's
// SubjectInstanceEvents, numbered with no gap, starting with a snapshot. A consumer that
// joins, sees a gap (a batch lost in a NATS reconnect or a slow-consumer
// drop), or overflows its bounds asks the instance for a snapshot on
// SubjectInstanceEventsSync (the request names the rank: 4 bytes, big
// endian) and applies the later batches on top of it. The snapshot comes
// back in one or more messages to the request's inbox, all but the last
// with the header EventsMore; its sequence number is the last batch
// published before it, and what changed while it was taken is in the
// batches after it (applying those again changes nothing: a store or a
// removal sets, it does not toggle). An idle rank publishes an empty batch
// every EventHeartbeat, so a consumer notices a lost batch within that
// time even when nothing changes.

// EventsMore is the header of a snapshot message that more follow;
// EventsError that of the answer to a request for a rank the instance does
// not have.
const (
	EventsMore  = "Handoff-Events-More"
	EventsError = "Handoff-Events-Error"
)

// EventHeartbeat is the longest an idle rank goes without a batch.
const EventHeartbeat = 2 * time.Second

// CacheJournal is a rank's prefix cache as the publisher reads it
// (hybrid.Manager).
type CacheJournal interface {
	RecordEvents(max int)
	TakeEvents(e *hybrid.Events)
	Snapshot(e *hybrid.Events)
}

// EventRank is one rank's cache to publish.
type EventRank struct {
	Rank      int
	Cache     CacheJournal
	Root      prefix.Hash // the root of the rank's block names
	BlockSize int         // tokens per KV block
	Medium    string      // kvevents.MediumGPU or MediumCPU
}

// EventPublisherConfig configures an EventPublisher.
type EventPublisherConfig struct {
	Instance  string // required, a token
	Namespace string // required, a token
	Prefix    string // default wire.DefaultPrefix
	Ranks     []EventRank
	// Interval is how often each rank's journal is taken and published;
	// default 50ms.
	Interval time.Duration
	// Journal bounds the events a rank keeps between takes; past it the
	// rank publishes a snapshot instead. Default 65536.
	Journal int
	Logger  *slog.Logger
}

// EventPublisher publishes the cache events of a worker's ranks.
type EventPublisher struct {
	cfg     EventPublisherConfig
	nc      *nats.Conn
	subject string
	sub     *nats.Subscription
	syncs   chan *nats.Msg
	stop    context.CancelFunc
	done    chan struct{}
}

// StartEventPublisher starts recording the ranks' events and publishing
// them; Close stops it.
func StartEventPublisher(nc *nats.Conn, cfg EventPublisherConfig) (*EventPublisher, error) {
	if cfg.Prefix == "" {
		cfg.Prefix = wire.DefaultPrefix
	}
	if !wire.ValidToken(cfg.Instance) || !wire.ValidToken(cfg.Namespace) || !wire.ValidToken(cfg.Prefix) {
		return nil, fmt.Errorf("%w: event publisher: instance %q, namespace %q, prefix %q", ErrInvalidConfig, cfg.Instance, cfg.Namespace, cfg.Prefix)
	}
	if cfg.Interval <= 0 {
		cfg.Interval = 50 * time.Millisecond
	}
	if cfg.Journal <= 0 {
		cfg.Journal = 1 << 16
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	p := &EventPublisher{cfg: cfg, nc: nc, syncs: make(chan *nats.Msg, 64), done: make(chan struct{}),
		subject: wire.Subject(cfg.Prefix, cfg.Namespace, wire.SubjectInstanceEvents, cfg.Instance)}
	sub, err := nc.Subscribe(wire.Subject(cfg.Prefix, cfg.Namespace, wire.SubjectInstanceEventsSync, cfg.Instance), func(m *nats.Msg) {
		select {
		case p.syncs <- m:
		default: // a flood of requests: the requester asks again
		}
	})
	if err != nil {
		return nil, fmt.Errorf("transfer: event publisher: %w", err)
	}
	p.sub = sub
	for _, r := range cfg.Ranks {
		r.Cache.RecordEvents(cfg.Journal)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p.stop = cancel
	go p.run(ctx)
	return p, nil
}

// Close stops publishing (a last take is published first) and recording.
func (p *EventPublisher) Close() {
	_ = p.sub.Unsubscribe()
	p.stop()
	<-p.done
	for _, r := range p.cfg.Ranks {
		r.Cache.RecordEvents(0)
	}
}

// pubRank is the publisher loop's state of one rank.
type pubRank struct {
	EventRank
	seq   uint64
	fresh bool      // nothing published yet: the first batch is a snapshot
	last  time.Time // when its last batch went out
	take  hybrid.Events
}

func (p *EventPublisher) run(ctx context.Context) {
	defer close(p.done)
	// A stream's numbers start at the microseconds of the publisher's
	// start, so that a restarted instance's batches come after the ones of
	// its previous life (whose numbers count batches, at most one per
	// Interval) instead of being taken for old ones; the first batch is a
	// snapshot.
	ranks := make([]*pubRank, len(p.cfg.Ranks))
	first := uint64(time.Now().UnixMicro())
	for i, r := range p.cfg.Ranks {
		ranks[i] = &pubRank{EventRank: r, seq: first, fresh: true}
	}
	tick := time.NewTicker(p.cfg.Interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			for _, r := range ranks {
				p.publish(r, time.Now())
			}
			return
		case now := <-tick.C:
			for _, r := range ranks {
				p.publish(r, now)
			}
		case m := <-p.syncs:
			p.answerSync(ranks, m)
		}
	}
}

// publish takes r's journal and publishes it: as batches, as a snapshot
// when the journal overflowed, or as an empty batch when r was idle for
// EventHeartbeat.
func (p *EventPublisher) publish(r *pubRank, now time.Time) {
	r.Cache.TakeEvents(&r.take)
	snapshot := r.take.Overflow || r.fresh
	r.fresh = false
	if snapshot {
		r.Cache.Snapshot(&r.take)
	}
	if len(r.take.Blocks) == 0 && len(r.take.States) == 0 && !snapshot && now.Sub(r.last) < EventHeartbeat {
		return
	}
	evs := kvevents.FromCache(nil, &r.take, r.BlockSize, r.Medium, snapshot)
	// A snapshot in parts: the first replaces what a consumer knew, the
	// others add to it, each the stream's next batch.
	for i, part := range p.parts(r, evs) {
		r.seq++
		p.send(p.subject, r.batch(part, snapshot && i == 0, now), false)
	}
	r.last = now
}

func (r *pubRank) batch(evs []kvevents.Event, snapshot bool, now time.Time) *kvevents.Batch {
	return &kvevents.Batch{TS: float64(now.UnixNano()) / 1e9, Events: evs, Rank: r.Rank, Seq: r.seq,
		Root: r.Root, Snapshot: snapshot}
}

// parts splits evs into runs whose batches fit in a NATS message (at
// least one run, maybe empty).
func (p *EventPublisher) parts(r *pubRank, evs []kvevents.Event) [][]kvevents.Event {
	limit := p.nc.MaxPayload() / 2
	if limit <= 0 {
		limit = 512 << 10
	}
	var out [][]kvevents.Event
	var split func(evs []kvevents.Event)
	split = func(evs []kvevents.Event) {
		if len(evs) > 1 {
			b, err := kvevents.Encode(r.batch(evs, false, time.Time{}))
			if err != nil || int64(len(b)) > limit {
				split(evs[:len(evs)/2])
				split(evs[len(evs)/2:])
				return
			}
		}
		out = append(out, evs)
	}
	split(evs)
	return out
}

// answerSync sends the snapshot of the rank m asks for to m's inbox, after
// publishing what its journal holds (so the snapshot is as of the
// stream's last batch).
func (p *EventPublisher) answerSync(ranks []*pubRank, m *nats.Msg) {
	if m.Reply == "" || len(m.Data) != 4 {
		return
	}
	want := int(binary.BigEndian.Uint32(m.Data))
	var r *pubRank
	for _, x := range ranks {
		if x.Rank == want {
			r = x
		}
	}
	if r == nil {
		_ = p.nc.PublishMsg(&nats.Msg{Subject: m.Reply, Header: nats.Header{EventsError: []string{fmt.Sprintf("no rank %d", want)}}})
		return
	}
	now := time.Now()
	p.publish(r, now)
	var snap hybrid.Events
	r.Cache.Snapshot(&snap)
	parts := p.parts(r, kvevents.FromCache(nil, &snap, r.BlockSize, r.Medium, true))
	for i, part := range parts {
		b := r.batch(part, true, now)
		p.send(m.Reply, b, i < len(parts)-1)
	}
}

func (p *EventPublisher) send(subject string, b *kvevents.Batch, more bool) {
	b.Instance = p.cfg.Instance
	data, err := kvevents.Encode(b)
	if err == nil {
		msg := &nats.Msg{Subject: subject, Data: data}
		if more {
			msg.Header = nats.Header{EventsMore: []string{"1"}}
		}
		err = p.nc.PublishMsg(msg)
	}
	if err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
		p.cfg.Logger.Warn("publish cache events", "rank", b.Rank, "seq", b.Seq, "err", err)
	}
}

// EventSubscriberConfig configures an EventSubscriber.
type EventSubscriberConfig struct {
	Namespace string // required, a token
	Prefix    string // default wire.DefaultPrefix
	// MaxBlocks and MaxStates bound what one rank's stream may hold in the
	// index (kvevents.Index); defaults 1<<20 and 1<<16.
	MaxBlocks, MaxStates int
	// SyncTimeout bounds a snapshot request; default 2s.
	SyncTimeout time.Duration
	Logger      *slog.Logger
}

// EventSubscriber keeps an index of what every instance's ranks hold,
// from their cache events.
type EventSubscriber struct {
	cfg  EventSubscriberConfig
	nc   *nats.Conn
	sub  *nats.Subscription
	reqs chan subKey
	stop context.CancelFunc
	done chan struct{}

	mu      sync.Mutex
	idx     *kvevents.Index
	streams map[subKey]*subStream
	stats   EventStats
}

// EventStats counts what a subscriber did.
type EventStats struct {
	Applied, Stale, Malformed, Gaps, Syncs, SyncFailures uint64
}

type subKey struct {
	instance string
	rank     int
}

type subStream struct {
	seen     time.Time // last batch
	syncing  bool      // a snapshot was asked for
	lastSync time.Time
	pending  []kvevents.Batch // batches that came while syncing
}

// subPending bounds the batches kept per stream while its snapshot comes.
const subPending = 256

// StartEventSubscriber subscribes to every instance's cache events in the
// namespace; Close stops it.
func StartEventSubscriber(nc *nats.Conn, cfg EventSubscriberConfig) (*EventSubscriber, error) {
	if cfg.Prefix == "" {
		cfg.Prefix = wire.DefaultPrefix
	}
	if !wire.ValidToken(cfg.Namespace) || !wire.ValidToken(cfg.Prefix) {
		return nil, fmt.Errorf("%w: event subscriber: namespace %q, prefix %q", ErrInvalidConfig, cfg.Namespace, cfg.Prefix)
	}
	if cfg.MaxBlocks <= 0 {
		cfg.MaxBlocks = 1 << 20
	}
	if cfg.MaxStates <= 0 {
		cfg.MaxStates = 1 << 16
	}
	if cfg.SyncTimeout <= 0 {
		cfg.SyncTimeout = 2 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &EventSubscriber{cfg: cfg, nc: nc, reqs: make(chan subKey, 64), done: make(chan struct{}),
		idx: kvevents.NewIndex(cfg.MaxBlocks, cfg.MaxStates), streams: map[subKey]*subStream{}}
	sub, err := nc.Subscribe(wire.Subject(cfg.Prefix, cfg.Namespace, wire.SubjectInstanceEvents, "*"), s.receive)
	if err != nil {
		return nil, fmt.Errorf("transfer: event subscriber: %w", err)
	}
	// A router is a consumer of bursts: let them queue rather than drop.
	_ = sub.SetPendingLimits(1<<16, 256<<20)
	s.sub = sub
	ctx, cancel := context.WithCancel(context.Background())
	s.stop = cancel
	go s.run(ctx)
	return s, nil
}

// Close unsubscribes and waits for the snapshot requests in flight.
func (s *EventSubscriber) Close() {
	_ = s.sub.Unsubscribe()
	s.stop()
	<-s.done
}

// Stats returns the subscriber's counts.
func (s *EventSubscriber) Stats() EventStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats
}

// Hits returns, for every instance the subscriber can tell about, the
// longest prefix of tokens one of its ranks can resume from. An instance
// is left out unless every stream of it is in sync and was heard from
// within 2 x EventHeartbeat: a router weighs it by its load alone.
func (s *EventSubscriber) Hits(tokens []int32) map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.idx.Hits(tokens)
	now := time.Now()
	for k, st := range s.streams {
		if st.syncing || now.Sub(st.seen) > 2*EventHeartbeat {
			delete(out, k.instance)
		}
	}
	return out
}

// Longest is Hits for one instance: its hit, and whether the subscriber
// can tell.
func (s *EventSubscriber) Longest(instance string, tokens []int32) (L int, ok bool) {
	L, ok = s.Hits(tokens)[instance]
	return L, ok
}

// receive takes a batch (on the subscription's goroutine).
func (s *EventSubscriber) receive(m *nats.Msg) {
	b, err := kvevents.Decode(m.Data)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil || !wire.ValidToken(b.Instance) ||
		m.Subject != wire.Subject(s.cfg.Prefix, s.cfg.Namespace, wire.SubjectInstanceEvents, b.Instance) {
		s.stats.Malformed++
		return
	}
	k := subKey{b.Instance, b.Rank}
	st := s.streams[k]
	if st == nil {
		st = &subStream{}
		s.streams[k] = st
	}
	st.seen = time.Now()
	if st.syncing {
		if len(st.pending) < subPending {
			st.pending = append(st.pending, b)
		}
		return
	}
	s.applyLocked(k, st, &b)
}

// applyLocked applies b to the index and asks for a snapshot when the
// stream lost track.
func (s *EventSubscriber) applyLocked(k subKey, st *subStream, b *kvevents.Batch) {
	switch v, _ := s.idx.Apply(b); v {
	case kvevents.Applied:
		s.stats.Applied++
	case kvevents.Stale:
		s.stats.Stale++
	default:
		s.stats.Gaps++
		// At most one snapshot request per stream a second.
		if now := time.Now(); now.Sub(st.lastSync) >= time.Second {
			select {
			case s.reqs <- k:
				st.syncing, st.lastSync = true, now
			default:
			}
		}
	}
}

func (s *EventSubscriber) run(ctx context.Context) {
	defer close(s.done)
	sweep := time.NewTicker(10 * EventHeartbeat)
	defer sweep.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case k := <-s.reqs:
			s.sync(ctx, k)
		case now := <-sweep.C:
			s.forgetSilent(now)
		}
	}
}

// forgetSilent forgets the instances none of whose streams was heard from
// for 10 x EventHeartbeat: gone, or no longer publishing.
func (s *EventSubscriber) forgetSilent(now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	live := map[string]bool{}
	for k, st := range s.streams {
		if now.Sub(st.seen) < 10*EventHeartbeat {
			live[k.instance] = true
		}
	}
	for k := range s.streams {
		if !live[k.instance] {
			delete(s.streams, k)
			s.idx.Forget(k.instance)
		}
	}
}

// sync asks k's instance for a snapshot of its rank and applies it, then
// the batches that came meanwhile.
func (s *EventSubscriber) sync(ctx context.Context, k subKey) {
	snap, err := s.fetchSnapshot(ctx, k)
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.streams[k]
	if st == nil {
		return
	}
	pending := st.pending
	st.syncing, st.pending = false, nil
	if err != nil {
		s.stats.SyncFailures++
		s.cfg.Logger.Debug("cache events: snapshot failed", "instance", k.instance, "rank", k.rank, "err", err)
		return
	}
	s.stats.Syncs++
	s.applyLocked(k, st, snap)
	for i := range pending {
		if st.syncing {
			break
		}
		s.applyLocked(k, st, &pending[i])
	}
}

// fetchSnapshot requests and assembles k's snapshot.
func (s *EventSubscriber) fetchSnapshot(ctx context.Context, k subKey) (*kvevents.Batch, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.SyncTimeout)
	defer cancel()
	inbox := s.nc.NewInbox()
	msgs := make(chan *nats.Msg, 64)
	sub, err := s.nc.ChanSubscribe(inbox, msgs)
	if err != nil {
		return nil, err
	}
	defer func() { _ = sub.Unsubscribe() }()
	req := binary.BigEndian.AppendUint32(nil, uint32(k.rank))
	if err := s.nc.PublishRequest(wire.Subject(s.cfg.Prefix, s.cfg.Namespace, wire.SubjectInstanceEventsSync, k.instance), inbox, req); err != nil {
		return nil, err
	}
	var snap *kvevents.Batch
	for {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case m := <-msgs:
			if e := m.Header.Get(EventsError); e != "" {
				return nil, errors.New(e)
			}
			b, err := kvevents.Decode(m.Data)
			if err != nil {
				return nil, err
			}
			if !b.Snapshot || b.Instance != k.instance || b.Rank != k.rank || snap != nil && b.Seq != snap.Seq {
				return nil, fmt.Errorf("%w: a snapshot part of %s rank %d seq %d", kvevents.ErrBadBatch, b.Instance, b.Rank, b.Seq)
			}
			if snap == nil {
				snap = &b
			} else {
				snap.Events = append(snap.Events, b.Events...)
			}
			if m.Header.Get(EventsMore) == "" {
				return snap, nil
			}
		}
	}
}
