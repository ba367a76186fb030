package rdma

// Test seams. The fence tests (fence_test.go) must reach exact points of a
// transfer: a writer stopped inside a copy, a commit about to go out or
// just sent, a fence waiting for a writer. An engine's hooks, set only by
// tests (Engine.hooks), are called at those points, so that a test reaches
// its case for certain instead of sleeping and hoping. None is set outside
// tests; the data path pays a nil check per step and one atomic load per
// write for them.

// hooks are called on the data path's own goroutines, and may block it:
// that is how a test holds a writer at a point.
type hooks struct {
	// writing runs before each step of a write's data, n being the bytes
	// earlier steps on the same goroutine carried (a striped tcp write
	// counts per lane): inside each shm copy bracket before its copy (the
	// slot says writing), before each batch of tcp host data goes out
	// (n > 0: the receiver is inside the landing of a frame longer than a
	// batch), after each inproc piece was admitted and before its copy
	// (the landing is in flight).
	writing func(t *Ticket, n uint64)
	// commit runs right before a writer sends t's commit (inproc: before
	// it commits), sent right after a commit, or a shm abort, for grant
	// went out and before its verdict is read.
	commit func(t *Ticket)
	sent   func(grant uint64)
	// fenceWaits runs when a fence has to wait for g: for its landings in
	// flight (landings, with g's lock held: it must not take it) or for a
	// live writer inside a copy into it (shm), on every call that waits.
	fenceWaits func(g *Grant)
}

// noHooks is what an engine without hooks runs.
var noHooks hooks

// testHooks returns the hooks set on e, or noHooks.
func (e *Engine) testHooks() *hooks {
	if h := e.hooks.Load(); h != nil {
		return h
	}
	return &noHooks
}
