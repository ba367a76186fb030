package agent

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/handoff-io/handoff/rdma"
)

// send is one write of named blocks and a row into a ticket, whole or
// layer by layer. Its goroutine runs the queued steps in order (a
// rdma.Stream runs one write at a time) and reports the end as an event.
type send struct {
	id     uint64
	req    uint64
	peer   rdma.Descriptor
	t      rdma.Ticket
	none   bool      // this shard writes nothing into the ticket
	pl     *plans    // the plans of the ticket's TP pair
	segs   []seg     // the stretches this shard writes, in ticket order
	steps  chan step // closed by commit or cancel
	until  time.Time // past it sweepSends ends the send; zero: never
	cancel context.CancelCauseFunc
}

// step is one queued part of a layer-by-layer send: a layer's ranges, or
// (commit) the rest and the commit.
type step struct {
	dst    []rdma.Range
	src    []rdma.Extent
	commit bool
}

// errDeferred is handle's answer for a request whose reply its goroutine
// writes later (a send with Wait).
var errDeferred = errors.New("agent: reply deferred")

// sendGrace is how long past its grant's deadline a send goes on: the
// receiver fails the grant at the deadline and answers a commit past it
// with that failure.
const sendGrace = 2 * time.Second

// sendSweep is how often a session ends the sends past their grant's
// deadline and sendGrace. One ticker per session rather than a deadline
// per send: arming a timer that was the process's earliest woke one of
// the runtime's threads on every send (7 µs of CPU per small send on two
// cores, and a thread spinning for work after it).
const sendSweep = 100 * time.Millisecond

// errPastDeadline is the cause of a send that sweepSends ended.
var errPastDeadline = errors.New("agent: past the grant's deadline")

// maxSteps bounds the steps queued ahead of the writes: two per layer of
// the largest models, so a forward pass never blocks on its agent.
const maxSteps = 1024

// checkTicket refuses a ticket from a peer whose layout differs from ours,
// naming the peer and both sides' fingerprints, dtypes or TP sizes, and
// one whose block count or row differ from what we send.
func checkTicket(p *pools, t ticket, blocks int, row bool) error {
	switch {
	case t.Fingerprint != p.fingerprint:
		return fmt.Errorf("%w: agent %q has layout fingerprint %s, this agent %s", ErrLayoutMismatch, t.Agent, t.Fingerprint, p.fingerprint)
	case t.DTypes != p.dtypes():
		return fmt.Errorf("%w: agent %q has dtypes %s, this agent %s", ErrLayoutMismatch, t.Agent, t.DTypes, p.dtypes())
	case t.FromTP != p.l.TP.Size:
		return fmt.Errorf("%w: agent %q granted to TP-%d senders, this agent is TP %d", ErrLayoutMismatch, t.Agent, t.FromTP, p.l.TP.Size)
	case t.Blocks != blocks || t.Row != row:
		return fmt.Errorf("%w: the ticket of agent %q holds %d blocks and row %v, the send names %d blocks and row %v", ErrBadRequest, t.Agent, t.Blocks, t.Row, blocks, row)
	}
	return nil
}

// openSend starts a send (OpSend: the whole grant at once; OpOpenSend:
// layer by layer, until OpCommit).
func (s *session) openSend(q Request) (Reply, error) {
	start := time.Now()
	eng, p, row, err := s.named(q)
	if err != nil {
		return Reply{}, err
	}
	tk, peer, sub, err := decodeTicket(q.Ticket, p.l.TP.Rank)
	if err != nil {
		return Reply{}, err
	}
	if err := checkTicket(p, tk, len(q.Blocks), row >= 0); err != nil {
		return Reply{}, err
	}
	pl, err := p.plans(tk.FromTP, tk.ToTP)
	if err != nil {
		return Reply{}, err
	}
	pcs := pl.pieces(p.l.TP.Rank, tk.ToRank, len(q.Blocks), row >= 0)
	if tk.V >= ticketPlaneMajor {
		pcs = pl.planeMajor(pcs)
	}
	mine := sub != nil
	if mine != (len(pcs) > 0) {
		return Reply{}, fmt.Errorf("%w: agent %q's ticket and the plan disagree on whether shard %d writes", ErrBadTicket, tk.Agent, p.l.TP.Rank)
	}
	var rt rdma.Ticket
	var segs []seg
	if mine {
		if rt, err = sub.ticket(p.mostExtents(pcs)); err != nil {
			return Reply{}, fmt.Errorf("agent %q: %w", tk.Agent, err)
		}
		if segs, err = p.segments(s.regions(), pcs, q.Blocks, row, rt.Extents); err != nil {
			return Reply{}, fmt.Errorf("agent %q: %w", tk.Agent, err)
		}
	}
	// A whole send with Wait answers when it ended, one frame instead of a
	// reply and an event: what a latency-bound engine waits for anyway.
	wait := q.Wait && q.Op == OpSend
	ctx, cancel := context.WithCancelCause(s.ctx)
	sd := &send{req: rt.RequestID, peer: peer, t: rt, none: !mine, pl: pl, segs: segs, cancel: cancel}
	if !rt.Deadline.IsZero() {
		// Past the grant's deadline the receiver has given up on it: a
		// receiver that stopped answering (a frozen process) must not hold
		// the send, and a send_wait, for ever.
		sd.until = rt.Deadline.Add(sendGrace)
	}
	if q.Op == OpOpenSend {
		sd.steps = make(chan step, maxSteps)
	}
	s.mu.Lock()
	s.nextSend++
	sd.id = s.nextSend
	s.sends[sd.id] = sd
	s.running[sd] = struct{}{}
	s.mu.Unlock()
	replied := s.afterReply()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer cancel(nil)
		m, err := s.runSend(ctx, eng, sd)
		switch {
		case err == nil:
		case errors.Is(context.Cause(ctx), errPastDeadline):
			// Whatever the send was doing when the sweep ended it (a
			// write, or waiting for an engine's next layer): %v, so that
			// its code is deadline and not the cancel's.
			err = fmt.Errorf("%w: send %d, past the grant's deadline: %v", rdma.ErrDeadline, sd.id, err)
		case ctx.Err() == nil || errors.Is(err, ErrCancelled):
		default:
			err = fmt.Errorf("%w: send %d: %w", ErrCancelled, sd.id, err)
		}
		s.mu.Lock()
		delete(s.sends, sd.id)
		delete(s.running, sd)
		s.mu.Unlock()
		var bytes uint64
		for _, b := range m.Bytes {
			bytes += b
		}
		s.a.m.sendEnded(err, bytes, time.Since(start))
		ev := Reply{Ev: EvSendDone, Send: sd.id, RequestID: sd.req}
		if wait {
			ev.Ev, ev.Re = "", q.ID // the request's reply, in place of an event
			s.a.m.request(q.Op, err)
		}
		if err != nil {
			ev.Code, ev.Msg = Code(err), err.Error()
			if !wait {
				ev.Ev = EvSendFailed
			}
		} else {
			ev.Bytes = bytes
		}
		if !wait {
			<-replied
		}
		s.reply(ev)
	}()
	if wait {
		return Reply{}, errDeferred
	}
	return Reply{Send: sd.id, RequestID: sd.req}, nil
}

// sweepSends ends, every sendSweep until the session ends, the sends
// past their until.
func (s *session) sweepSends() {
	t := time.NewTicker(sendSweep)
	defer t.Stop()
	for {
		select {
		case <-s.ctx.Done():
			return
		case now := <-t.C:
			s.mu.Lock()
			for sd := range s.running {
				if !sd.until.IsZero() && now.After(sd.until) {
					sd.cancel(errPastDeadline)
				}
			}
			s.mu.Unlock()
		}
	}
}

// runSend writes the send: at once, or its steps as they come.
func (s *session) runSend(ctx context.Context, eng *rdma.Engine, sd *send) (rdma.Manifest, error) {
	if sd.none {
		// Nothing of ours lands in that shard: done once committed (a
		// layer-by-layer send takes its steps and ignores them).
		for sd.steps != nil {
			select {
			case x, ok := <-sd.steps:
				if !ok {
					return rdma.Manifest{}, fmt.Errorf("%w: send %d", ErrCancelled, sd.id)
				}
				if x.commit {
					return rdma.Manifest{}, nil
				}
			case <-ctx.Done():
				return rdma.Manifest{}, fmt.Errorf("%w: send %d", ErrCancelled, sd.id)
			}
		}
		return rdma.Manifest{}, nil
	}
	if sd.steps == nil {
		return eng.Write(ctx, sd.peer, sd.t, sources(sd.segs))
	}
	st, err := eng.OpenStream(ctx, sd.peer, sd.t)
	if err != nil {
		return rdma.Manifest{}, err
	}
	for {
		var x step
		var ok bool
		select {
		case x, ok = <-sd.steps:
		case <-ctx.Done():
			return rdma.Manifest{}, fmt.Errorf("%w: send %d", ErrCancelled, sd.id)
		}
		if !ok {
			return rdma.Manifest{}, fmt.Errorf("%w: send %d", ErrCancelled, sd.id)
		}
		if x.commit {
			if err := st.WriteRest(ctx, sources(sd.segs)); err != nil {
				return rdma.Manifest{}, err
			}
			return st.Commit(ctx)
		}
		if len(x.dst) == 0 {
			continue // a layer with nothing in this send (no blocks, or no row)
		}
		if err := st.Write(ctx, x.dst, x.src); err != nil {
			return rdma.Manifest{}, err
		}
	}
}

// sendOp queues a layer, or the commit, of a layer-by-layer send, or
// cancels a send.
func (s *session) sendOp(q Request) (Reply, error) {
	_, p, err := s.registration()
	if err != nil {
		return Reply{}, err
	}
	s.mu.Lock()
	sd := s.sends[q.Send]
	if sd != nil && (q.Op == OpCancel || q.Op == OpCommit && sd.steps != nil) {
		delete(s.sends, q.Send) // no step after commit or cancel; a refused commit leaves it cancellable
	}
	s.mu.Unlock()
	if sd == nil {
		return Reply{}, fmt.Errorf("%w: send %d", ErrUnknown, q.Send)
	}
	switch q.Op {
	case OpCancel:
		sd.cancel(nil)
		return Reply{Send: sd.id}, nil
	case OpCommit:
		if sd.steps == nil {
			return Reply{}, fmt.Errorf("%w: send %d is a whole send: it commits itself", ErrBadRequest, sd.id)
		}
		select {
		case sd.steps <- step{commit: true}:
		default:
			sd.cancel(nil)
			return Reply{}, fmt.Errorf("%w: send %d has %d steps queued", ErrBadRequest, sd.id, maxSteps)
		}
		return Reply{Send: sd.id}, nil
	}
	if sd.steps == nil {
		return Reply{}, fmt.Errorf("%w: send %d is a whole send, not layer by layer", ErrBadRequest, sd.id)
	}
	x, err := layerStep(p, sd, q.Kind, q.Layer)
	if sd.none {
		x = step{}
	}
	if err != nil {
		return Reply{}, err
	}
	select {
	case sd.steps <- x:
	default:
		return Reply{}, fmt.Errorf("%w: send %d has %d steps queued", ErrBadRequest, sd.id, maxSteps)
	}
	return Reply{Send: sd.id}, nil
}

// layerStep is the ranges of one layer of a send: attention layer l's K and
// V in every block, or Mamba layer l of the row, as they lie in the
// stretches this shard writes.
func layerStep(p *pools, sd *send, kind string, l int) (step, error) {
	var x step
	switch kind {
	case "kv":
		if l < 0 || l >= p.kv.Layers {
			return step{}, fmt.Errorf("%w: attention layer %d of %d", ErrBadRequest, l, p.kv.Layers)
		}
		if sd.pl.kv != nil {
			x.dst, x.src = layerRanges(sd.pl, sd.segs, false, l)
		}
	case "mamba":
		if l < 0 || l >= p.mamba.Layers {
			return step{}, fmt.Errorf("%w: mamba layer %d of %d", ErrBadRequest, l, p.mamba.Layers)
		}
		if sd.pl.mamba != nil {
			x.dst, x.src = layerRanges(sd.pl, sd.segs, true, l)
		}
	default:
		return step{}, fmt.Errorf("%w: layer kind %q, want kv or mamba", ErrBadRequest, kind)
	}
	return x, nil
}
