//go:build linux && cgo && ucx

package rdma

import (
	"context"
	"errors"
)

// ucxTestTransports adds ucx to the conformance suite in builds that have
// it. UCX picks its transports from the environment: run the suite with
// UCX_TLS=tcp, and with UCX_TLS=cma,tcp UCX_CMA_MEMORY_INVALIDATE=y for
// same-host GETs (scripts/test does both).
func ucxTestTransports() []Transport { return []Transport{TransportUCX} }

// cutUCXWriters cuts every writer link e's ucx receiver holds, as a
// receiver that gave up on its writers would: what they landed without
// committing fails (and is fenced), and their endpoints are closed.
func cutUCXWriters(e *Engine) int {
	s := e.ucx
	if s == nil {
		return 0
	}
	s.mu.Lock()
	rxs := make([]*ucxRx, 0, len(s.rx))
	for id, r := range s.rx {
		rxs = append(rxs, r)
		delete(s.rx, id)
		delete(s.rxByEP, r.ep)
	}
	s.mu.Unlock()
	for _, r := range rxs {
		s.notifyCut(context.Background(), r, 0)
		s.gone(r, errors.New("cut by the test"))
	}
	return len(rxs)
}

// ucxStopAt is where a helper writer over ucx stops itself (StopMidWrite):
// once a window's worth of messages went out and the first completed, so
// that the receiver holds receives of it in flight. Posting a message only
// queues it for the writer's worker, which a stop right after the first
// one could freeze before its rendezvous request left.
func ucxStopAt(tr Transport) uint64 {
	if tr != TransportUCX {
		return 0
	}
	return (ucxWindow + 2) * ucxChunk
}

// ucxConns counts the writer links e's ucx receiver holds.
func ucxConns(e *Engine) int {
	if e.ucx == nil {
		return 0
	}
	e.ucx.mu.Lock()
	defer e.ucx.mu.Unlock()
	return len(e.ucx.rx)
}

// ucxPeerErrors counts the endpoint failures e's ucx worker saw.
func ucxPeerErrors(e *Engine) uint64 {
	if e.ucx == nil {
		return 0
	}
	return e.ucx.w.Stats().PeerErrors
}

// ucxEndpoints counts the endpoints e's ucx worker keeps (made and not
// yet closed, failed ones included).
func ucxEndpoints(e *Engine) int64 {
	if e.ucx == nil {
		return 0
	}
	return e.ucx.w.Stats().Endpoints
}
