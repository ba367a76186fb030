package worker

import "sync"

// acceptanceGate is speculative decoding's acceptance-rate gate
// (TensorRT-LLM's acceptance_rate_window_size and
// acceptance_rate_threshold): over the last window verifications, when
// fewer than threshold of the drafted tokens were accepted, drafting
// stops (the step's draft length is 0, padded on the pool's zero-length
// padding row). A gate that stopped drafting would never see another
// verification and so never reopen, the silent collapse of trtllm#16888:
// while closed it lets one step in every window draft (a probe), whose
// verifications slide the window, so the gate reopens once drafts are
// accepted again.
//
// It is safe for concurrent use: ranks verify in parallel within a step.
type acceptanceGate struct {
	window    int
	threshold float64

	mu       sync.Mutex
	drafted  []int // ring of the last window verifications
	accepted []int
	next     int
	n        int // verifications in the ring, up to window
	sumD     int
	sumA     int
	closed   bool
	steps    int // steps since the gate closed or last probed
}

func newAcceptanceGate(window int, threshold float64) *acceptanceGate {
	return &acceptanceGate{window: window, threshold: threshold,
		drafted: make([]int, window), accepted: make([]int, window)}
}

// observe records one verification of drafted tokens, accepted of them.
func (g *acceptanceGate) observe(drafted, accepted int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.n == g.window {
		g.sumD -= g.drafted[g.next]
		g.sumA -= g.accepted[g.next]
	} else {
		g.n++
	}
	g.drafted[g.next], g.accepted[g.next] = drafted, accepted
	g.sumD += drafted
	g.sumA += accepted
	g.next = (g.next + 1) % g.window
	full := g.n == g.window && g.sumD > 0
	switch rate := float64(g.sumA) / float64(max(g.sumD, 1)); {
	case full && rate < g.threshold && !g.closed:
		g.closed, g.steps = true, 0
	case g.closed && rate >= g.threshold:
		g.closed = false
	}
}

// allow reports whether the step about to run may draft: always while
// the gate is open, once every window steps (a probe) while closed.
func (g *acceptanceGate) allow() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.closed {
		return true
	}
	g.steps++
	if g.steps >= g.window {
		g.steps = 0
		return true
	}
	return false
}

// isClosed reports whether the gate stops drafting now.
func (g *acceptanceGate) isClosed() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.closed
}
