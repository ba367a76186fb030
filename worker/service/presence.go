package service

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/handoff-io/handoff/worker/admin"
)

// errNoPrefillYet is the prefill_instances check before any usable prefill
// instance was seen.
var errNoPrefillYet = errors.New("no usable prefill instance seen yet")

// prefillPresence is the prefill_instances readiness check of a remote
// decode worker, a pure function of what the registry shows at each probe:
//
//   - before the first usable instance (live, same layout, not draining) is
//     seen: failing, so a Service sends no traffic to a decode that can
//     serve nothing;
//   - with one: passing;
//   - with none for up to grace since one was last seen: passing with a
//     warning (a prefill restart does not flap every decode);
//   - with none for longer: failing until one is back.
//
// Absence is measured between probes: it is known at most one probe
// interval late.
type prefillPresence struct {
	grace time.Duration

	mu   sync.Mutex
	seen bool
	last time.Time // the last probe that saw a usable instance
}

func (p *prefillPresence) check(now time.Time, live, usable int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if usable > 0 {
		p.seen, p.last = true, now
		return nil
	}
	why := "none registered"
	if live > 0 {
		why = fmt.Sprintf("%d registered, none usable (draining or another layout)", live)
	}
	if !p.seen {
		return fmt.Errorf("%w: %s", errNoPrefillYet, why)
	}
	gone := now.Sub(p.last).Round(time.Millisecond)
	if gone <= p.grace {
		return admin.Warn("no usable prefill instance for %s (%s); unready after %s", gone, why, p.grace)
	}
	return fmt.Errorf("no usable prefill instance for %s (%s), longer than the %s grace", gone, why, p.grace)
}
