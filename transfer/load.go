package transfer

import (
	"maps"
	"time"

	"github.com/handoff-io/handoff/transfer/wire"
)

// PrefillLoad is what a decoder knows of the prefill instances it may
// address: how many are usable, and the load and rows of the least-loaded.
type PrefillLoad struct {
	// Instances is the number of live prefill instances with this
	// decoder's layout, not draining and not reported gone.
	Instances int
	// Inflight is the least-loaded one's requests in flight: as its last
	// heartbeat announced, plus the ones this decoder addressed to it
	// since (the load pick compares).
	Inflight int
	// Rows is the real rows it announced (Capacity.Rows): the requests
	// its ranks prefill in one step.
	Rows int
}

// PrefillLoad reports the prefill instances' load as of now, from the
// registry and this decoder's calls in flight. It asks no peer: it is
// cheap enough to call per request.
func (d *Decoder) PrefillLoad(now time.Time) PrefillLoad {
	insts := d.reg.Instances(wire.RolePrefill, now)
	if len(insts) == 0 {
		return PrefillLoad{}
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
	var out PrefillLoad
	for _, inst := range insts {
		if inst.Fingerprint != d.cfg.Fingerprint || inst.Draining {
			continue
		}
		if at, ok := gone[inst.ID]; ok && inst.Updated == at {
			continue
		}
		load := inst.Capacity.Inflight + mine[inst.ID]
		if out.Instances == 0 || load < out.Inflight {
			out.Inflight, out.Rows = load, inst.Capacity.Rows
		}
		out.Instances++
	}
	return out
}
