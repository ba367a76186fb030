package rdma

import (
	"context"
	"sync"
	"time"
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
	wait := sumAside(op) // the writer's sums on another core
	if wait != nil {
		defer func() {
			if wait != nil {
				wait()
			}
		}()
	}
	var now time.Time
	for i := range op.pieces {
		if i&63 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
			now = time.Now()
		}
		p := &op.pieces[i]
		ld, err := g.beginLandAt(now, op.t.Epoch, &op.t.Token, p.ext, p.off, uint64(len(p.src)), nil)
		if err != nil {
			l.rx.stats.framesRefused.Add(1)
			return remoteErr(l.rx.cfg.Agent, err)
		}
		// Copy in cache-sized chunks: the receiver's crc comes with the
		// copy, the writer's (unless summed aside) reads the source chunk
		// while it is hot.
		for off := 0; off < len(p.src); off += landChunk {
			end := min(off+landChunk, len(p.src))
			ld.copyFill(ld.dst[off:end], p.src[off:end])
			if wait == nil {
				op.sum(p.ext, p.src[off:end])
			}
		}
		g.endLand(&ld, true, nil)
	}
	if wait != nil {
		wait()
		wait = nil
	}
	return remoteErr(l.rx.cfg.Agent, g.commit(op.t.Epoch, &op.t.Token, op.manifest, true, !op.noCRC))
}
