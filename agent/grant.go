package agent

import (
	"context"
	"fmt"
	"time"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/reshard"
)

// grantGroup is what one grant request opened: one rdma grant per source
// shard that writes into this shard (one when both TP sizes are equal).
// Its id is its first grant's.
type grantGroup struct {
	id  uint64
	req uint64
	gs  []*rdma.Grant
}

// grant opens the grants over the named blocks and row that the senders'
// shards write (reshard.go) and returns their ticket; an event reports
// how they ended, together.
func (s *session) grant(q Request) (Reply, error) {
	eng, p, row, err := s.named(q)
	if err != nil {
		return Reply{}, err
	}
	from, to, rd := q.FromTP, p.l.TP.Size, p.l.TP.Rank
	if from == 0 {
		from = to
	}
	if from < 1 || from > reshard.MaxTP {
		return Reply{}, fmt.Errorf("%w: senders' TP %d", ErrBadRequest, from)
	}
	pl, err := p.plans(from, to)
	if err != nil {
		return Reply{}, err
	}
	var deadline time.Time
	if q.DeadlineMS > 0 {
		if q.DeadlineMS > maxDeadlineMS {
			return Reply{}, fmt.Errorf("%w: deadline of %d ms, over %d", ErrBadRequest, q.DeadlineMS, maxDeadlineMS)
		}
		deadline = time.Now().Add(time.Duration(q.DeadlineMS) * time.Millisecond)
	}
	grp := &grantGroup{req: q.RequestID}
	var shards []int
	var tickets []rdma.Ticket
	var groups []int
	fail := func(err error) (Reply, error) {
		for _, g := range grp.gs {
			g.Revoke()
		}
		return Reply{}, err
	}
	mem := s.regions()
	pm := p.kvAt.placed() // ticket version 2: see plans.planeMajor
	for rs := range from {
		pcs := pl.pieces(rs, rd, len(q.Blocks), row >= 0)
		if pm {
			pcs = pl.planeMajor(pcs)
		}
		if len(pcs) == 0 {
			continue
		}
		ext, n := p.grantExtents(mem, pl, pcs, q.Blocks, row, pm)
		if len(ext) > rdma.MaxExtents {
			return fail(fmt.Errorf("%w: %d blocks are %d extents in this engine's memory (scattered blocks of a layout with planes take one per block and plane), more than the %d of one grant: grant fewer blocks at a time",
				rdma.ErrOutOfRange, len(q.Blocks), len(ext), rdma.MaxExtents))
		}
		g, err := eng.OpenGrant(rdma.GrantSpec{RequestID: q.RequestID, Extents: ext, Deadline: deadline})
		if err != nil {
			return fail(err)
		}
		grp.gs = append(grp.gs, g)
		shards, tickets, groups = append(shards, rs), append(tickets, g.Ticket()), append(groups, n)
	}
	grp.id = grp.gs[0].ID()
	v := 1
	if pm {
		v = ticketPlaneMajor
	}
	t, err := encodeTicket(ticket{V: v, Agent: s.a.cfg.Name, Fingerprint: p.fingerprint, DTypes: p.dtypes(), FromTP: from, ToTP: to, ToRank: rd,
		Blocks: len(q.Blocks), Row: row >= 0}, eng.Descriptor(), shards, tickets, groups)
	if err != nil {
		return fail(err)
	}
	if len(t) > maxTicket {
		// The reply could not carry it: refused by name, its grants closed.
		return fail(fmt.Errorf("%w: the ticket of %d blocks for TP-%d senders is %d bytes, over the %d a reply carries; grant fewer blocks at a time",
			ErrFrameTooLarge, len(q.Blocks), from, len(t), maxTicket))
	}
	s.mu.Lock()
	s.grants[grp.id] = grp
	s.mu.Unlock()
	s.a.m.openGrant.Inc()
	replied := s.afterReply()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.watchGrant(grp, replied)
	}()
	return Reply{Grant: grp.id, Ticket: t}, nil
}

// maxDeadlineMS bounds a grant's deadline (a year), far inside what a
// time.Duration holds.
const maxDeadlineMS = 365 * 24 * 3600 * 1000

// maxTicket bounds a grant's ticket: its reply, with room for the rest,
// fits a frame.
const maxTicket = MaxFrame - 64<<10

// watchGrant reports the end of a group's grants as one event: done when
// every grant is, else the first failure, whichever grant's: a failure
// revokes the others at once (not when the grants before it ended).
func (s *session) watchGrant(grp *grantGroup, replied <-chan struct{}) {
	failed := make(chan error, len(grp.gs))
	ended := make(chan *rdma.Grant, len(grp.gs))
	for _, g := range grp.gs {
		// Each ends: at its commit, failure or deadline, or when the
		// session's engine closes.
		go func() {
			select {
			case <-g.Failed(): // with Done, or before it (quarantined)
				failed <- g.Err()
			case <-g.Done():
			}
			<-g.Done()
			ended <- g
		}()
	}
	var bytes uint64
	var first error
	fail := func(err error) {
		if err != nil && first == nil {
			first = err
			for _, o := range grp.gs {
				o.Revoke()
			}
		}
	}
	for n := len(grp.gs); n > 0; {
		select {
		case err := <-failed:
			fail(err)
		case g := <-ended:
			n--
			m, err := g.Wait(context.Background())
			fail(err)
			for _, b := range m.Bytes {
				bytes += b
			}
		}
	}
	s.mu.Lock()
	delete(s.grants, grp.id)
	s.mu.Unlock()
	s.a.m.grantEnded(first, bytes)
	ev := Reply{Ev: EvGrantDone, Grant: grp.id, RequestID: grp.req, Bytes: bytes}
	if first != nil {
		ev = Reply{Ev: EvGrantFailed, Grant: grp.id, RequestID: grp.req, Code: Code(first), Msg: first.Error()}
	}
	<-replied
	s.reply(ev)
}

// revoke fences a grant: once the reply is sent, no byte of it lands; or it
// answers quarantined, when a writer stopped inside a copy into it (a
// frozen shm writer, rdma.Grant.Quarantined), and then nothing lands once
// the grant_failed event is sent.
func (s *session) revoke(q Request) (Reply, error) {
	s.mu.Lock()
	grp := s.grants[q.Grant]
	s.mu.Unlock()
	if grp == nil {
		return Reply{}, fmt.Errorf("%w: grant %d", ErrUnknown, q.Grant)
	}
	for _, g := range grp.gs {
		g.Revoke()
	}
	for _, g := range grp.gs {
		if g.Quarantined() {
			// A writer stopped inside a copy (a frozen process) may still
			// store into the blocks: the engine must not reuse them yet.
			return Reply{}, fmt.Errorf("%w: grant %d is revoked, but a writer stopped inside its copy may still write its blocks: reuse them once its grant_failed event came",
				rdma.ErrQuarantined, q.Grant)
		}
	}
	return Reply{Grant: q.Grant}, nil
}
