package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/transfer/wire"
)

// Subject is where an agent of namespace ns answers who it is: a request
// on "handoff.<ns>.agent.<name>.describe" gets a Description. Engines'
// schedulers (or peers) use it to check that two agents can exchange
// before either opens a grant. Like the workers' subjects, it is per
// namespace: deployments sharing a NATS server do not see each other's
// agents.
func Subject(ns, name string) string {
	return wire.DefaultPrefix + "." + ns + ".agent." + name + ".describe"
}

// OfferSubject is where an agent takes tickets other agents of its
// namespace offer it (OpOffer): it hands each to its engine as an EvTicket
// event.
func OfferSubject(ns, name string) string {
	return wire.DefaultPrefix + "." + ns + ".agent." + name + ".offer"
}

// offer is the message on OfferSubject; its reply is an offerReply.
type offer struct {
	From   string `msgpack:"from"`
	Ticket []byte `msgpack:"ticket"`
}

type offerReply struct {
	Code string `msgpack:"code"`
	Msg  string `msgpack:"msg"`
}

// offerTimeout bounds an offer's NATS round trip.
const offerTimeout = 5 * time.Second

// Description is an agent's answer on Subject: its name and, once an
// engine registered, the registration's rdma agent id, layout fingerprint,
// TP and data-path descriptor (JSON).
type Description struct {
	Name        string `msgpack:"name"`
	AgentID     string `msgpack:"agent_id"`
	Fingerprint string `msgpack:"fingerprint"`
	DTypes      string `msgpack:"dtypes"`
	TP          TP     `msgpack:"tp"`
	Desc        []byte `msgpack:"desc"`
}

func (a *Agent) describe() Description {
	a.mu.Lock()
	s := a.latest
	a.mu.Unlock()
	d := Description{Name: a.cfg.Name}
	if s == nil {
		return d
	}
	eng, p, err := s.registration()
	if err != nil {
		return d
	}
	rd := eng.Descriptor()
	d.AgentID, d.Fingerprint, d.DTypes, d.TP = string(rd.Agent), p.fingerprint, p.dtypes(), p.l.TP
	d.Desc, _ = json.Marshal(rd)
	return d
}

func (a *Agent) subscribe() (func(), error) {
	sub, err := a.nc.Subscribe(Subject(a.cfg.Namespace, a.cfg.Name), func(m *nats.Msg) {
		b, err := msgpack.Marshal(a.describe())
		if err != nil {
			return
		}
		m.Respond(b)
	})
	if err != nil {
		return nil, fmt.Errorf("agent: subscribe %s: %w", Subject(a.cfg.Namespace, a.cfg.Name), err)
	}
	osub, err := a.nc.Subscribe(OfferSubject(a.cfg.Namespace, a.cfg.Name), a.takeOffer)
	if err != nil {
		sub.Unsubscribe()
		return nil, fmt.Errorf("agent: subscribe %s: %w", OfferSubject(a.cfg.Namespace, a.cfg.Name), err)
	}
	return func() { sub.Unsubscribe(); osub.Unsubscribe() }, a.nc.Flush()
}

// takeOffer hands an offered ticket to the registered engine.
func (a *Agent) takeOffer(m *nats.Msg) {
	var rep offerReply
	o, t, err := decodeOffer(m.Data)
	a.mu.Lock()
	s := a.latest
	a.mu.Unlock()
	switch {
	case err != nil:
	case s == nil:
		err = fmt.Errorf("%w: no engine registered with agent %q", ErrNotRegistered, a.cfg.Name)
	default:
		ev := Reply{Ev: EvTicket, Ticket: o.Ticket, Agent: o.From}
		if len(t.Subs) > 0 {
			ev.RequestID = t.Subs[0].Ticket.RequestID
		}
		err = s.reply(ev)
	}
	if err != nil {
		rep = offerReply{Code: Code(err), Msg: err.Error()}
	}
	b, _ := msgpack.Marshal(rep)
	m.Respond(b)
}

// decodeOffer decodes an offer and the ticket it carries. Errors wrap
// ErrBadTicket.
func decodeOffer(b []byte) (offer, ticket, error) {
	var o offer
	var t ticket
	if err := unmarshal(b, &o); err != nil {
		return offer{}, ticket{}, fmt.Errorf("%w: offer: %w", ErrBadTicket, err)
	}
	if err := unmarshal(o.Ticket, &t); err != nil {
		return offer{}, ticket{}, fmt.Errorf("%w: offered ticket: %w", ErrBadTicket, err)
	}
	return o, t, nil
}

// offer sends a ticket to agent q.To over NATS.
func (s *session) offer(q Request) (Reply, error) {
	nc := s.a.nc
	if nc == nil {
		return Reply{}, fmt.Errorf("%w: agent %q has no NATS (--nats-url)", ErrBadRequest, s.a.cfg.Name)
	}
	if !wire.ValidToken(q.To) || len(q.Ticket) == 0 {
		return Reply{}, fmt.Errorf("%w: offer needs a ticket and an agent's name, not %q", ErrBadRequest, q.To)
	}
	b, err := msgpack.Marshal(offer{From: s.a.cfg.Name, Ticket: q.Ticket})
	if err != nil {
		return Reply{}, err
	}
	// The round trip may take up to offerTimeout (a slow or gone peer, NATS
	// reconnecting): it runs on a goroutine of its own, which answers, so
	// that the engine's other requests (a revoke) are not held behind it.
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		rep := Reply{Re: q.ID}
		err := s.offerTo(nc, q.To, b)
		s.a.m.request(q.Op, err)
		if err != nil {
			rep.Code, rep.Msg = Code(err), err.Error()
		}
		s.reply(rep)
	}()
	return Reply{}, errDeferred
}

func (s *session) offerTo(nc *nats.Conn, to string, b []byte) error {
	ctx, cancel := context.WithTimeout(s.ctx, offerTimeout)
	defer cancel()
	m, err := nc.RequestWithContext(ctx, OfferSubject(s.a.cfg.Namespace, to), b)
	if err != nil {
		return fmt.Errorf("%w: offer to agent %q: %w", ErrPeerUnreachable, to, err)
	}
	var rep offerReply
	if err := unmarshal(m.Data, &rep); err != nil {
		return fmt.Errorf("%w: agent %q's answer: %w", ErrPeerUnreachable, to, err)
	}
	if rep.Code != "" {
		return &RemoteError{Code: rep.Code, Msg: rep.Msg}
	}
	return nil
}
