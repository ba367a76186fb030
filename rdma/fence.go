package rdma

// The receiver-side seam: every transport's receiving side is a fence, the
// part of it a grant is opened on and fenced through. The Engine holds the
// fences of the transports it serves and runs every grant through all of
// them; neither the Engine nor Grant knows which transport is which.

import "time"

// fence is what a grant needs from one transport's receiving side. A byte
// reaches a grant's destination in one of two ways, and a transport's fence
// keeps the grant's promise (once fenced, no byte lands) for its way:
//
//   - The receiver stores it itself: a tcp data frame read into the
//     destination, a cuda-ipc pull copied device to device, an in-process
//     writer's memcpy, a UCX active message whose payload the receiver
//     pulls. Each store is admitted through Grant.beginLand, which refuses
//     it once the grant left its epoch, and counted in flight until
//     Grant.endLand. Such a transport's fence is landings.
//   - The writer stores it into memory it mapped (shm; an RDMA WRITE). The
//     receiver cannot refuse a store, only close what the writer must pass
//     before each one (shm: the slot word's CAS bracket), and wait for a
//     store in progress to end.
type fence interface {
	// open makes g's epoch writable through this transport. OpenGrant
	// calls it with Engine.mu held, once g's id, epoch and ticket are set
	// and before the ticket leaves the engine. It must not block.
	open(g *Grant)
	// fence is called once g left its epoch (revoked, expired, failed, or
	// committing: the grant admits no new landing). When it returns true,
	// no byte of g lands through this transport any more, whatever its
	// writers do. It returns false when, after waiting up to wait, a
	// writer the receiver cannot stop (a live process stopped inside a
	// copy) may still store into g's destination: g is then quarantined,
	// and fence is called again, with wait 0, until it returns true. It
	// never waits on a peer past wait, is safe to call concurrently and
	// again, and touches only g's epoch: a grant that reuses what g used
	// is not g's to close.
	fence(g *Grant, wait time.Duration) bool
	// stored returns the bytes writers stored into g through this
	// transport without Grant.beginLand (shm: the count in g's slot), for
	// a commit whose bytes the receiver did not count; 0 where every store
	// is a landing. It is called after fence returned true.
	stored(g *Grant) uint64
	// release lets go of what g used once g is retired: settled and
	// fenced. Engine.mu is held.
	release(g *Grant)
}

// slotted is a fence that files open grants in a fixed table indexed by
// grant id (shm's slot table: id mod its size). OpenGrant skips the ids
// whose entry still holds a grant, open or quarantined.
type slotted interface {
	fence
	// slotFree reports whether a grant of id can be filed now. Engine.mu
	// is held.
	slotFree(id uint64) bool
}

// landings is the fence of a transport whose receiver stores every byte
// itself, through Grant.beginLand: tcp and cuda-ipc (tcpServer) and inproc
// (inprocRx) embed it, and so would a receiver-driven transport to come
// (UCX active messages: the receive posted for a message is its landing,
// cancelling it its lander's abort). Since the grant admits no landing
// once it left its epoch, cutting those in flight and waiting for them
// (Grant.cutLandings) is the whole fence; it never quarantines. The
// landings of one grant are one count, whichever transport they came by,
// so the first such fence to run waits for them all and the others find
// none. It takes no wait: once its landers are cut (a read deadline in the
// past, a receive aborted), what is left are the receiver's own stores in
// progress (a memcpy, a device copy), which end without any peer's help.
type landings struct{}

func (landings) open(*Grant) {}

func (landings) fence(g *Grant, _ time.Duration) bool {
	g.cutLandings()
	return true
}

func (landings) stored(*Grant) uint64 { return 0 }

func (landings) release(*Grant) {}

// fence runs g through every served transport's fence (the landings
// first, then those that may wait for a writer), all within one wait, and
// reports whether no byte of g can land any more: false means quarantine.
func (e *Engine) fence(g *Grant, wait time.Duration) bool {
	until := time.Now().Add(wait)
	fenced := true
	for _, f := range e.fences {
		if !f.fence(g, max(time.Until(until), 0)) {
			fenced = false
		}
	}
	return fenced
}

// stored returns the bytes writers stored into g without Grant.beginLand;
// g is fenced.
func (e *Engine) stored(g *Grant) uint64 {
	var n uint64
	for _, f := range e.fences {
		n += f.stored(g)
	}
	return n
}
