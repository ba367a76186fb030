package transfer

import (
	"context"
	"log/slog"
	"time"

	"github.com/handoff-io/handoff/transfer/wire"
)

// StateIndex tells where a prompt's longest resumable state lives
// (EventSubscriber, from the instances' cache events).
type StateIndex interface {
	// Hits returns the longest prefix of tokens each instance can resume
	// from; an instance the index cannot tell about is absent.
	Hits(tokens []int32) map[string]int
}

// State-aware routing (DecoderConfig.States): the first attempt of a
// request goes to the prefill instance with the lowest cost, in prompt
// tokens of compute:
//
//	cost(i) = (n − L(i)) + load(i) × c
//
// n is the prompt's length; L(i) the longest prefix of it whose state
// instance i holds (exactly what its cache would resume from, from its
// events; 0 when its streams are out of sync or it publishes none, so it
// is weighed by load alone); load(i) its requests in flight (as of its
// last heartbeat, plus the ones this decoder addressed to it since, as
// pick counts); and c the tokens a request in flight costs the ones that
// share its steps, estimated as what requests need computed at their best
// instance: the mean of n − max L(i) over the requests this decoder routed
// lately (an exponential average over about 16 requests, starting at the
// first prompt's length). It is taken from the best option, not from the
// one chosen, so that a workload whose turns could hit learns so even
// while load keeps sending them elsewhere. Instances without a free row
// are taken only when none has one. Ties go to the lower load, then round
// robin. The bytes a handoff moves are the same from every prefill
// instance (the whole prompt's KV and one state row), so they do not
// enter the cost.
//
// When the cheapest instance holds nothing of the prompt, the request goes
// where it would without events: to the instance its prompt_cache_key (or
// remembered prefixes, PrefixAffinity) names, else by load. A state that
// was evicted between the choice and the prefill costs a recompute there,
// never a wrong answer: the prefill worker's own cache checks what it
// serves.

// stateCostWeight is the weight of the newest request in the average c.
const stateCostWeight = 1.0 / 16

// pickByState returns the instance state-aware routing chooses for
// tokens, the state it holds, and whether one holds any.
func (d *Decoder) pickByState(tokens []int32, exclude []string) (wire.Instance, int, bool) {
	insts := d.reg.Instances(wire.RolePrefill, time.Now())
	if len(insts) == 0 {
		return wire.Instance{}, 0, false
	}
	mine, gone := d.picking(len(insts))
	n := len(tokens)
	d.mu.Lock()
	c := d.stateCost
	d.mu.Unlock()
	if c == 0 {
		c = float64(n)
	}
	type cand struct {
		inst      wire.Instance
		held, ld  int
		cost      float64
		free, has bool
	}
	var best cand
	hits := d.cfg.States.Hits(tokens)
	most := 0 // the longest state any instance holds
	off := int(d.picks.Add(1))
	for i := range insts {
		inst := insts[(off+i)%len(insts)]
		if !d.usable(inst, exclude, gone) {
			continue
		}
		L := hits[inst.ID]
		most = max(most, L)
		ld := inst.Capacity.Inflight + mine[inst.ID]
		x := cand{inst: inst, held: L, ld: ld, cost: float64(n-L) + float64(ld)*c, free: ld < inst.Capacity.Rows, has: true}
		switch {
		case !best.has,
			x.free && !best.free,
			x.free == best.free && (x.cost < best.cost || x.cost == best.cost && x.ld < best.ld):
			best = x
		}
	}
	if !best.has {
		return wire.Instance{}, 0, false
	}
	d.mu.Lock()
	if d.stateCost == 0 {
		d.stateCost = float64(n)
	}
	d.stateCost += stateCostWeight * (float64(n-most) - d.stateCost)
	d.mu.Unlock()
	if best.held == 0 {
		return wire.Instance{}, 0, false
	}
	if log := d.cfg.Logger; log.Enabled(context.Background(), slog.LevelDebug) {
		log.Debug("prefill by cached state", "instance", best.inst.ID, "state_tokens", best.held, "prompt_tokens", n, "load", best.ld)
	}
	return best.inst, best.held, true
}
