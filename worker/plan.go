package worker

// This file is the pure half of the scheduler: it decides, from plain counts,
// which rank takes a new request and which ranks pad the attention-DP dummy in
// an iteration. It does no IO, starts no goroutines and touches no pool; the
// loop in scheduler.go applies its decisions.

// Phase is where a request is in its life on one worker.
type Phase uint8

const (
	// PhaseQueued: accepted, waiting for admission; holds nothing.
	PhaseQueued Phase = iota
	// PhaseAwaitCache: decode side, resources held while the prefilled cache
	// is in flight. Not schedulable: the rank may look idle while every real
	// row is taken (the scenario the reserved ADP row exists for).
	PhaseAwaitCache
	// PhaseContext: the prompt has not been run yet; the next iteration
	// runs prefill. Schedulable.
	PhaseContext
	// PhaseGenerate: one decode step per iteration. Schedulable.
	PhaseGenerate
	// PhasePush: prefill side, prefill done, the cache is being pushed to a
	// decode worker. Holds resources, not schedulable.
	PhasePush
	// PhaseHeld: prefill side, the job ended before its lease was taken
	// (failed, cancelled, given up by Wait) and its holder has not let go
	// yet (PendingPrefill.Abandon): what its Parts named may still be read.
	// Holds resources, not schedulable.
	PhaseHeld
	// PhaseDone: finished; resources are being released.
	PhaseDone
)

var phaseNames = [...]string{"queued", "await-cache", "context", "generate", "push", "held", "done"}

func (p Phase) String() string {
	if int(p) < len(phaseNames) {
		return phaseNames[p]
	}
	return "unknown"
}

// Schedulable reports whether a request in phase p is work for the forward
// pass of the next iteration.
func (p Phase) Schedulable() bool { return p == PhaseContext || p == PhaseGenerate }

// HoldsResources reports whether a request in phase p holds a row and blocks.
func (p Phase) HoldsResources() bool {
	return p == PhaseAwaitCache || p == PhaseContext || p == PhaseGenerate || p == PhasePush || p == PhaseHeld
}

// RankLoad is what the planner sees of one rank at the start of an iteration.
type RankLoad struct {
	// Phases of the requests the rank holds (queued requests are not on a rank).
	Phases []Phase
	// NoCompute counts the schedulable ones that run no forward pass: a
	// state served from the cache or adopted (state.go), a row copy.
	NoCompute int
}

// Schedulable counts the rank's schedulable requests.
func (l RankLoad) Schedulable() int {
	n := 0
	for _, p := range l.Phases {
		if p.Schedulable() {
			n++
		}
	}
	return n
}

// Plan is the decision for one lockstep iteration.
type Plan struct {
	// Step is true when some rank has schedulable work: every rank then runs
	// a forward pass this iteration.
	Step bool
	// Dummy[i] is true when rank i has no schedulable work in a stepping
	// iteration and pads the ADP dummy (request id 0) on its reserved row.
	Dummy []bool
}

// Dummies counts the ranks that pad this iteration.
func (p Plan) Dummies() int {
	n := 0
	for _, d := range p.Dummy {
		if d {
			n++
		}
	}
	return n
}

// PlanStep decides one iteration. Without attention DP no rank ever pads:
// ranks are independent and an idle one simply skips the forward pass.
// With attention DP, when any rank has schedulable work, every rank with none
// that runs a forward pass pads the dummy (and steps its no-compute work
// beside it): requests waiting for their cache or pushing it do not count
// as work, even though they hold the rank's rows, nor do states served
// from the cache or adopted, which copy a row and compute nothing (an
// iteration of those alone steps with no forward pass and no dummy).
func PlanStep(loads []RankLoad, attentionDP bool) Plan {
	p := Plan{Dummy: make([]bool, len(loads))}
	forward := false // some rank runs a forward pass
	for _, l := range loads {
		n := l.Schedulable()
		p.Step = p.Step || n > 0
		forward = forward || n > l.NoCompute
	}
	if !forward || !attentionDP {
		return p
	}
	for i, l := range loads {
		p.Dummy[i] = l.Schedulable() == l.NoCompute
	}
	return p
}

// RankRoom is a rank's free capacity as admission sees it.
type RankRoom struct {
	// Rows is the number of free real Mamba rows.
	Rows int
	// Blocks is the number of KV blocks not yet promised to any request
	// (the dummy's block is already excluded).
	Blocks int
	// Held is the number of requests the rank holds (used to spread load).
	Held int
	// Hit is the request's longest prefix-cache hit on the rank, in tokens.
	Hit int
}

// PickRank returns the rank that takes a request needing blocks KV blocks
// over its whole life, or -1 when none can take it now. It never
// over-commits: a rank qualifies only with a free row and enough unpromised
// blocks. Among those it prefers the longest prefix-cache hit (attention
// DP: the rank that holds the most of the request's prompt), then the
// least loaded, then the one with the most free blocks, then the lowest
// index.
func PickRank(rooms []RankRoom, blocks int) int {
	best := -1
	for i, r := range rooms {
		if r.Rows < 1 || r.Blocks < blocks {
			continue
		}
		if best < 0 || r.Hit > rooms[best].Hit || r.Hit == rooms[best].Hit && (r.Held < rooms[best].Held ||
			(r.Held == rooms[best].Held && r.Blocks > rooms[best].Blocks)) {
			best = i
		}
	}
	return best
}
