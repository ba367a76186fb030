package worker

import "fmt"

// Prefill routes of a decode worker with conditional disaggregation
// (decode --prefill auto): the "route" label of handoff_prefill_routes_total.
const (
	RouteLocal  = "local"  // prefilled by this worker, in its own steps
	RouteRemote = "remote" // prefilled by a prefill worker, its cache transferred
)

// Why a request took its route: the "reason" label of
// handoff_prefill_routes_total.
const (
	ReasonShortPrompt = "short_prompt" // local: shipping the cache costs more than computing it
	ReasonPrefillBusy = "prefill_busy" // local: the least-loaded prefill instance has a queue
	ReasonNoPrefill   = "no_prefill"   // local: no usable prefill instance is known
	ReasonLongPrompt  = "long_prompt"  // remote: a long prompt and a prefill instance with room
	// ReasonDecodeBusy: remote: a short prompt, but the rank it landed on
	// runs so many requests that a local prefill would stall all of their
	// decode steps and hold its row longer, while a prefill instance has
	// room.
	ReasonDecodeBusy = "decode_busy"
	// ReasonRemoteRefused: local after all: the remote prefill was refused
	// (no prefill worker answered, none had room), so the request was
	// prefilled here on the resources it already held. Such a request is
	// counted twice, remote and then local.
	ReasonRemoteRefused = "remote_refused"
	// ReasonRemoteFailed: local after all: the remote prefill failed
	// mid-way (its prefill worker died on every attempt), so the request
	// was prefilled here from scratch over whatever bytes had landed.
	// Counted twice too.
	ReasonRemoteFailed = "remote_failed"
)

// Defaults of AutoPolicy, the thresholds of decode --prefill auto.
//
// DefaultAutoMinRemoteTokens: a prompt shorter than this is prefilled
// locally. A remote prefill adds the transfer of the request's cache and the
// control-plane round trip to its time to first token (the Mamba row alone
// is 49 MiB; 7-23 ms measured in docs/evaluation.md), while a local one
// stalls the running decodes of its step for the prefill's compute. Up to
// about 512 tokens the simulated nemotron-h-8b prefill on an H200 (17 ms)
// stalls the decodes about as long as the handoff delays the request; past
// it the stall grows with the prompt and a remote prefill wins.
//
// DefaultAutoMaxPrefillQueue: when even the least-loaded prefill instance
// has this many requests beyond one step's batch waiting, a new request is
// prefilled locally rather than queued there: each of them waits at least
// one whole prefill step of the batch ahead, so four such requests already
// cost more time to first token than a local prefill stalls the decodes.
const (
	DefaultAutoMinRemoteTokens = 512
	DefaultAutoMaxPrefillQueue = 4
)

// AutoPolicy is conditional disaggregation's rule: prefill a request
// locally when a remote prefill cannot win, remotely otherwise. It is pure:
// the caller gathers what it knows of the prefill instances (PrefillLoad)
// and applies the decision.
type AutoPolicy struct {
	// MinRemoteTokens: prompts with fewer tokens are prefilled locally,
	// while their rank is not busy (MaxLocalRunning).
	MinRemoteTokens int
	// MaxLocalRunning: a short prompt whose rank already runs this many
	// requests goes to a prefill instance with room instead; 0: half the
	// rank's rows.
	MaxLocalRunning int
	// MaxPrefillQueue: when the least-loaded usable prefill instance has
	// at least this many requests waiting beyond its batch (requests in
	// flight minus its real rows), prefill locally.
	MaxPrefillQueue int
}

// Validate checks the thresholds.
func (p AutoPolicy) Validate() error {
	if p.MinRemoteTokens < 0 {
		return fmt.Errorf("%w: auto prefill: min remote tokens %d, want ≥ 0", ErrInvalidConfig, p.MinRemoteTokens)
	}
	if p.MaxLocalRunning < 0 {
		return fmt.Errorf("%w: auto prefill: max local running %d, want ≥ 0", ErrInvalidConfig, p.MaxLocalRunning)
	}
	if p.MaxPrefillQueue < 1 {
		return fmt.Errorf("%w: auto prefill: max prefill queue %d, want ≥ 1", ErrInvalidConfig, p.MaxPrefillQueue)
	}
	return nil
}

// PrefillLoad is what a decode worker knows of its prefill instances when
// it decides: from the instance registry (each instance's heartbeat
// announces its requests in flight and its rows) and from its own
// handoffs addressed to them since.
type PrefillLoad struct {
	// Instances is the number of usable prefill instances: same cache
	// layout, not draining, not reported gone.
	Instances int
	// Inflight is the least-loaded one's requests in flight: as of its last
	// heartbeat plus the ones this decode worker addressed to it since.
	Inflight int
	// Rows is that instance's real rows, the requests it prefills in one
	// step; 0 when it announced none.
	Rows int
}

// Queue is the requests waiting at the least-loaded prefill instance
// beyond the batch its ranks prefill in one step.
func (l PrefillLoad) Queue() int { return max(l.Inflight-l.Rows, 0) }

// LocalLoad is the decode rank a request was placed on, when it is routed.
type LocalLoad struct {
	Running int // requests the rank prefills or generates, this one aside
	Rows    int // the rank's rows for real requests
}

// busy reports whether a local prefill would stall too many decodes:
// Running reached max, or half the rows when max is 0.
func (l LocalLoad) busy(max int) bool {
	if max == 0 {
		max = (l.Rows + 1) / 2
	}
	return max > 0 && l.Running >= max
}

// RouteDecision is where one request's prefill runs, and why.
type RouteDecision struct {
	Remote bool
	Reason string // one of the Reason constants
}

// Route is the decision's "route" label: RouteRemote or RouteLocal.
func (d RouteDecision) Route() string {
	if d.Remote {
		return RouteRemote
	}
	return RouteLocal
}

// Decide routes the prefill of a prompt of promptTokens tokens placed on a
// rank with local load, in order: with no usable prefill instance it is
// local (a remote prefill would fail); a short prompt is local, unless its
// rank is busy (MaxLocalRunning) and the prefill instances have room; a
// long one is remote unless the least-loaded prefill instance's queue
// reached MaxPrefillQueue.
func (p AutoPolicy) Decide(promptTokens int, l PrefillLoad, local LocalLoad) RouteDecision {
	switch {
	case l.Instances < 1:
		return RouteDecision{Reason: ReasonNoPrefill}
	case promptTokens < p.MinRemoteTokens:
		if local.busy(p.MaxLocalRunning) && l.Queue() < p.MaxPrefillQueue {
			return RouteDecision{Remote: true, Reason: ReasonDecodeBusy}
		}
		return RouteDecision{Reason: ReasonShortPrompt}
	case l.Queue() >= p.MaxPrefillQueue:
		return RouteDecision{Reason: ReasonPrefillBusy}
	}
	return RouteDecision{Remote: true, Reason: ReasonLongPrompt}
}

// Router decides, for a decode Scheduler with a CacheSource, where each
// admitted request's prefill runs (decode --prefill auto). It is called on
// the scheduling loop's goroutine, once per request at admission: it must
// not block (read what is known, never ask a peer).
type Router interface {
	Route(promptTokens int, local LocalLoad) RouteDecision
}

// LoadFunc reports what is known of the prefill instances now.
type LoadFunc func() PrefillLoad

// AutoRouter applies an AutoPolicy to the load Load reports.
type AutoRouter struct {
	Policy AutoPolicy
	Load   LoadFunc
}

var _ Router = AutoRouter{}

// Route implements Router.
func (a AutoRouter) Route(promptTokens int, local LocalLoad) RouteDecision {
	return a.Policy.Decide(promptTokens, a.Load(), local)
}
