package transfer

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/wire"
)

// writerProbe bounds the control-plane check of a writer the data plane
// reported gone. A dead instance's NATS subscriptions go when its
// connection does, so the answer is a no-responders in about a round trip;
// the bound is for a host that vanished without closing anything.
const writerProbe = 250 * time.Millisecond

// watchWriters treats a prefill instance that closed its last data-path
// connection to this decoder (rdma.Engine.OnWriterGone: a worker killed
// with SIGKILL, an engine closed; a live engine never lets its last
// connection go) as dead, as a registry expiry does, but at once: a handoff
// addressed to it is fenced and re-granted to a live instance in
// milliseconds instead of after the registry TTL. Even a wrong report would
// cost a retry, never a wrong byte: the old grant is revoked first.
//
// The same report comes when something between the two hosts reset every
// connection (a proxy, a NIC, a firewall), and then the writer is alive.
// So the report is checked first on the control plane, which does not
// share the data path: the instance's micro service is pinged
// (Instance.Service). An answer within writerProbe means it lives: it is
// not taken for dead, and a handoff whose bytes the reset cut fails its
// write and is retried fenced, on it too where no other instance serves
// (its next write connects again). A draining instance answers too, until
// its requests are done (Prefiller.Shutdown, intake.stopRequests): a reset
// during a rolling update must not fail what it still serves. No answer,
// or an instance that does not say its service, and it is taken for dead.
//
// New handoffs pass an instance taken for dead over (pick) until its
// registry entry shows a heartbeat after the report: its entry stays fresh
// for up to the TTL after a SIGKILL, and a request sent to it would spend
// an attempt on a no-responders.
func (d *Decoder) watchWriters(eng *rdma.Engine) {
	d.unwatch = eng.OnWriterGone(func(a rdma.AgentID) { d.writerLost(string(a)) })
}

// writerLost checks a writer-gone report on its own goroutine (the report
// comes on a data-path connection's, which must not block) and takes the
// writer for dead unless it answers.
func (d *Decoder) writerLost(agent string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return
	}
	d.wg.Go(func() {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() { // Close ends the check rather than wait it out; ends with it
			select {
			case <-d.done:
				cancel()
			case <-ctx.Done():
			}
		}()
		pinged := d.entriesOf(agent)
		if inst, ok := d.answers(ctx, pinged); ok {
			d.cfg.Logger.Warn("data-path connections of a prefill instance lost; it answers on the control plane, so it is not taken for dead",
				"peer", inst.ID, "peer_agent", agent)
			var silent bool
			if pinged, silent = d.watchWriter(ctx, rdma.AgentID(agent)); !silent {
				return
			}
		}
		if ctx.Err() != nil {
			return // closing
		}
		d.cfg.Logger.Warn("prefill instance taken for dead: its data-path connections closed and it does not answer", "peer_agent", agent)
		// The entries as of now: pick passes the instance over until a
		// heartbeat later than the one recorded, and one may have come
		// during the ping.
		d.writerGone(agent, pinged, d.entriesOf(agent))
	})
}

// writerWatch is how often a writer whose data path was lost, but that
// answered on the control plane, is pinged again until it connects again;
// writerWatchMisses is how many pings in a row its service must be
// definitely absent (no responders, on a connected NATS connection) for it
// to be taken for dead.
const (
	writerWatch       = 200 * time.Millisecond
	writerWatchMisses = 2
)

// watchWriter keeps a writer that answered after losing every data-path
// connection under watch: until it connects again (its next write dials;
// from then on its death closes that connection and is reported at once),
// it is pinged every writerWatch. While it has no connection nothing else
// would report its death before the registry's TTL: a retry of a request
// whose write the reset cut goes to it (through the queue group, when it is
// the only instance), and if it is then killed, the decoder must learn it
// in milliseconds, not seconds.
//
// Only a definite absence counts: a no-responders while this decoder's own
// connection is up, writerWatchMisses times in a row. A ping that times
// out (a busy worker, a NATS blip) proves nothing and the watch goes on.
// One watch runs per writer, and for at most the registry's TTL: past it a
// dead writer's entry has expired, and the registry reports it.
// watchWriter returns the entries pinged and true when the writer is to be
// taken for dead; false when it connected again, left the registry, the
// watch ran its course, another watch covers it, or ctx ended.
func (d *Decoder) watchWriter(ctx context.Context, agent rdma.AgentID) ([]wire.Instance, bool) {
	d.mu.Lock()
	if d.watching[agent] {
		d.mu.Unlock()
		return nil, false
	}
	if d.watching == nil {
		d.watching = make(map[rdma.AgentID]bool)
	}
	d.watching[agent] = true
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		delete(d.watching, agent)
		d.mu.Unlock()
	}()
	ttl := d.cfg.Registry.TTL
	if ttl <= 0 {
		ttl = 6 * time.Second
	}
	until := time.Now().Add(ttl)
	t := time.NewTicker(writerWatch)
	defer t.Stop()
	misses := 0
	for {
		select {
		case <-ctx.Done():
			return nil, false
		case <-t.C:
		}
		if d.eng.WriterConnected(agent) || time.Now().After(until) {
			return nil, false
		}
		entries := d.entriesOf(string(agent))
		if len(entries) == 0 {
			return nil, false
		}
		switch d.probe(ctx, entries) {
		case probeAnswered:
			misses = 0
		case probeAbsent:
			if misses++; misses >= writerWatchMisses {
				return entries, ctx.Err() == nil
			}
		}
	}
}

// A probe's verdict on a writer's entries.
const (
	probeUnknown  = iota // no definite answer: a timeout, this side's connection down
	probeAnswered        // a service answered
	probeAbsent          // every service that entries name has no subscriber
)

// probe pings the micro service of each entry that names one, as answers
// does, and says whether one answered, all were definitely absent, or
// neither.
func (d *Decoder) probe(ctx context.Context, entries []wire.Instance) int {
	absent, asked := 0, 0
	for _, inst := range entries {
		if inst.Service == "" {
			continue
		}
		subj, err := micro.ControlSubject(micro.PingVerb, wire.ServiceName, inst.Service)
		if err != nil {
			continue
		}
		asked++
		pctx, cancel := context.WithTimeout(ctx, writerProbe)
		_, err = d.nc.RequestWithContext(pctx, subj, nil)
		cancel()
		switch {
		case err == nil:
			return probeAnswered
		case errors.Is(err, nats.ErrNoResponders) && d.nc.IsConnected():
			absent++
		}
	}
	if asked > 0 && absent == asked {
		return probeAbsent
	}
	return probeUnknown
}

// entriesOf returns the registry's prefill entries that name agent.
func (d *Decoder) entriesOf(agent string) []wire.Instance {
	if d.reg == nil {
		return nil
	}
	var out []wire.Instance
	for _, inst := range d.reg.Instances(wire.RolePrefill, time.Now()) {
		if inst.Peer.Agent == agent || inst.ID == agent {
			out = append(out, inst)
		}
	}
	return out
}

// answers pings the micro service of each entry that names one and returns
// the first that answers within writerProbe (and before ctx ends).
func (d *Decoder) answers(ctx context.Context, entries []wire.Instance) (wire.Instance, bool) {
	for _, inst := range entries {
		if inst.Service == "" {
			continue
		}
		subj, err := micro.ControlSubject(micro.PingVerb, wire.ServiceName, inst.Service)
		if err != nil {
			continue // not a service id: the entry cannot vouch for it
		}
		pctx, cancel := context.WithTimeout(ctx, writerProbe)
		_, err = d.nc.RequestWithContext(pctx, subj, nil)
		cancel()
		if err == nil {
			return inst, true
		}
		if ctx.Err() != nil {
			return wire.Instance{}, false
		}
		if !errors.Is(err, nats.ErrNoResponders) && !errors.Is(err, context.DeadlineExceeded) {
			d.cfg.Logger.Warn("ping of a prefill instance", "peer", inst.ID, "err", err)
		}
	}
	return wire.Instance{}, false
}

// writerGone takes agent's instance for dead: pinged are the registry's
// entries that named it when it was found not to answer, now the ones that
// name it now, whose heartbeat times pick compares. An entry of now whose
// micro service was not pinged is a new incarnation that took the id over
// during the ping (a quick restart): it is not recorded as gone, and the
// handoffs addressed to it are not told; the registry reports the old
// incarnation's end in any case.
func (d *Decoder) writerGone(agent string, pinged, now []wire.Instance) {
	d.mu.Lock()
	if d.gone == nil {
		d.gone = make(map[string]int64)
	}
	for _, inst := range now {
		if slices.ContainsFunc(pinged, func(p wire.Instance) bool { return p.ID == inst.ID && p.Service == inst.Service }) {
			d.gone[inst.ID] = inst.Updated
		}
	}
	d.mu.Unlock()
	named := false // the workers use their instance id as agent id
	for _, inst := range pinged {
		d.incarnationDied(inst.ID, inst.Service)
		named = named || inst.ID == agent
	}
	if !named {
		d.peerDied(agent) // no entry says which incarnation
	}
}
