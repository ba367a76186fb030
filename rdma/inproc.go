package rdma

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/handoff-io/handoff/internal/crc32c"
)

// inprocEngines lists the live engines of this process by agent, so that a
// writer finds a receiver in the same process and copies directly.
var (
	inprocMu      sync.Mutex
	inprocEngines = map[AgentID][]*Engine{}
)

func inprocRegister(e *Engine) {
	inprocMu.Lock()
	defer inprocMu.Unlock()
	inprocEngines[e.cfg.Agent] = append(inprocEngines[e.cfg.Agent], e)
}

func inprocUnregister(e *Engine) {
	inprocMu.Lock()
	defer inprocMu.Unlock()
	list := inprocEngines[e.cfg.Agent]
	for i, x := range list {
		if x == e {
			list = append(list[:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(inprocEngines, e.cfg.Agent)
	} else {
		inprocEngines[e.cfg.Agent] = list
	}
}

// inprocLookup finds the engine of this process that peer describes: same
// agent, host and addresses, serving inproc.
func inprocLookup(peer Descriptor) *Engine {
	inprocMu.Lock()
	defer inprocMu.Unlock()
	for _, e := range inprocEngines[peer.Agent] {
		d := e.Descriptor()
		if d.Host == peer.Host && d.TCPAddr == peer.TCPAddr && d.ShmAddr == peer.ShmAddr && e.serves(TransportInproc) {
			return e
		}
	}
	return nil
}

// inprocRx is the receiving side of inproc. An in-process writer lands
// each piece through the receiving engine's Grant.beginLand (inprocLink),
// so the fence is landings: a piece's memcpy is not cut short but waited
// for, and it is at most one piece.
type inprocRx struct{ landings }

var _ fence = inprocRx{}

// inprocLink writes into an engine of the same process: each piece passes
// the same per-frame checks as over TCP, then one memcpy.
type inprocLink struct {
	tx, rx *Engine
}

func (l *inprocLink) transport() Transport { return TransportInproc }

func (l *inprocLink) close() {}

func (l *inprocLink) write(ctx context.Context, op *writeOp) error {
	if err := l.rx.beginOp(); err != nil {
		return remoteErr(l.rx.cfg.Agent, err)
	}
	defer l.rx.ops.Done()
	g, err := l.rx.lookupGrant(op.t.Grant)
	if err != nil {
		return remoteErr(l.rx.cfg.Agent, err)
	}
	var now time.Time
	var landed uint64
	for i := range op.pieces {
		if i&63 == 0 {
			if err := ctx.Err(); err != nil {
				if i > 0 {
					// The grant holds part of the data: fail it now, as the
					// other transports do, rather than at its deadline.
					g.terminate(fmt.Errorf("%w: writer cancelled: %w", ErrPeerClosed, err))
				}
				return err
			}
			now = time.Now()
		}
		p := &op.pieces[i]
		ld, err := g.beginLandAt(now, op.t.Epoch, &op.t.Token, p.ext, p.off, p.size(), nil)
		if err != nil {
			l.rx.stats.framesRefused.Add(1)
			return remoteErr(l.rx.cfg.Agent, err)
		}
		if f := op.testHooks().writing; f != nil {
			f(op.t, landed)
		}
		if p.dev.a != nil || ld.dev.a != nil {
			err := l.landDevice(ctx, op, p, &ld)
			g.endLand(&ld, err == nil, nil)
			if err != nil {
				err = fmt.Errorf("rdma: device copy into grant %d: %w", g.id, err)
				g.terminate(err)
				return remoteErr(l.rx.cfg.Agent, err)
			}
			landed += p.size()
			continue
		}
		for off := 0; off < len(p.src); off += landChunk {
			end := min(off+landChunk, len(p.src))
			d, s := ld.dst[off:end], p.src[off:end]
			if sum := op.crcFor(p); ld.track && !op.noCRC && ld.crc == *sum {
				// One pass for both sides: in one process the bytes the
				// receiver sums as they land are the ones the writer copies
				// (as with shm, whose receiver takes the writer's sums).
				ld.crc = crc32c.CopyUpdate(ld.crc, d, s)
				*sum = ld.crc
				continue
			}
			ld.copyFill(d, s)
			op.sum(p, s)
		}
		g.endLand(&ld, true, nil)
		landed += p.size()
	}
	if op.partial {
		return nil // landed; a Stream commits once every part is in
	}
	if h := op.testHooks(); h.commit != nil {
		h.commit(op.t)
	}
	if h := op.testHooks(); h.sent != nil {
		h.sent(op.t.Grant)
	}
	return remoteErr(l.rx.cfg.Agent, g.commit(op.t.Epoch, &op.t.Token, op.manifest, true, !op.noCRC))
}
