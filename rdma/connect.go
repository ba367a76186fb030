package rdma

// The writer side's peers: connecting to one, choosing its transport, and
// the link kept for it.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
)

// peerState is the writer side's connection to one peer.
type peerState struct {
	desc Descriptor
	link link
	// failed: the link's last write failed other than by the receiver's
	// answer or the caller's context (the peer dead or unreachable), so
	// a descriptor of an older incarnation may replace it (judge).
	failed atomic.Bool
}

// write writes op over p's link, noting whether the peer failed.
func (p *peerState) write(ctx context.Context, op *writeOp) error {
	err := p.link.write(ctx, op)
	var re *RemoteError
	p.failed.Store(err != nil && ctx.Err() == nil && !errors.As(err, &re))
	return err
}

// TransportFor reports the transport chosen for a connected peer.
func (e *Engine) TransportFor(agent AgentID) (Transport, bool) {
	e.peerMu.Lock()
	defer e.peerMu.Unlock()
	p, ok := e.peers[agent]
	if !ok {
		return "", false
	}
	return p.link.transport(), true
}

// Connect pre-connects to a peer and returns the transport chosen. The
// choice is the first of inproc (the peer engine lives in this process), shm
// (same Host), ucx (opt-in: served only where configured) and tcp that both
// engines serve and that connects; it is always
// logged, and a transport skipped because it failed to connect is logged as
// a warning with the reason. Connecting again to the same descriptor is a
// no-op; a changed descriptor replaces the old connection, unless it is of
// an older incarnation of the agent than the connection's: that fails with
// ErrStaleDescriptor and leaves the connection alone.
func (e *Engine) Connect(ctx context.Context, peer Descriptor) (Transport, error) {
	if err := e.beginOp(); err != nil {
		return "", err
	}
	defer e.ops.Done()
	p, err := e.peerFor(ctx, peer)
	if err != nil {
		return "", err
	}
	return p.link.transport(), nil
}

func sameEndpoint(a, b Descriptor) bool {
	return a.Agent == b.Agent && a.Host == b.Host && a.TCPAddr == b.TCPAddr && a.ShmAddr == b.ShmAddr && bytes.Equal(a.UCXAddr, b.UCXAddr) && slices.Equal(a.Transports, b.Transports)
}

// verdict is what peerFor does with a descriptor given the link it has for
// the same agent.
type verdict int

const (
	reuse   verdict = iota // the link serves it
	replace                // a new link is dialed for it and the old one closed
	stale                  // refused with ErrStaleDescriptor; the link is kept
)

// judge decides for peer against cur, the descriptor the agent's link was
// made for (curFailed: its last write found the peer failed). Where both
// name their incarnation, an older peer is stale and a newer one replaces
// the link, even at the same addresses (a restart in place: the link's
// process is gone). An older one replaces a link whose peer failed: the
// incarnations are start times, and a restart on a host whose clock is
// behind would otherwise never be reached. Otherwise (the same
// incarnation, or either unknown: 0) it is as before incarnations: the
// same endpoint reuses the link and another replaces it. An engine's
// addresses are fixed for its life, so one incarnation at other addresses
// is a caller's own rewrite (a proxy), and the caller's latest choice
// wins.
func judge(cur Descriptor, curFailed bool, peer Descriptor) verdict {
	switch a, b := cur.Incarnation, peer.Incarnation; {
	case a != 0 && b != 0 && b < a && !curFailed:
		return stale
	case a != 0 && b != 0 && b > a:
		return replace
	case sameEndpoint(cur, peer):
		return reuse
	}
	return replace
}

func staleErr(cur, peer Descriptor) error {
	return fmt.Errorf("%w: %s incarnation %d, linked to %d", ErrStaleDescriptor, peer.Agent, peer.Incarnation, cur.Incarnation)
}

func (e *Engine) peerFor(ctx context.Context, peer Descriptor) (*peerState, error) {
	if peer.Agent == "" {
		return nil, fmt.Errorf("%w: descriptor without agent", ErrNoTransport)
	}
	// A replaced link is closed after peerMu is released: closing waits for
	// the link's own reconnects, which must not stall every other peer.
	var old link
	e.peerMu.Lock()
	if p, ok := e.peers[peer.Agent]; ok {
		switch judge(p.desc, p.failed.Load(), peer) {
		case reuse:
			e.peerMu.Unlock()
			return p, nil
		case stale:
			e.peerMu.Unlock()
			return nil, staleErr(p.desc, peer)
		}
		e.log.Info("rdma: peer descriptor changed, reconnecting", "peer", string(peer.Agent),
			"incarnation", peer.Incarnation, "was", p.desc.Incarnation)
		delete(e.peers, peer.Agent)
		old = p.link
	}
	e.peerMu.Unlock()
	if old != nil {
		old.close()
	}

	// Dial without the lock; Close cancels a dial in progress.
	dctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(e.ctx, cancel)
	defer stop()
	l, err := e.dial(dctx, peer)
	if err != nil {
		if e.ctx.Err() != nil {
			return nil, ErrClosed
		}
		return nil, err
	}
	e.peerMu.Lock()
	if e.ctx.Err() != nil {
		e.peerMu.Unlock()
		l.close()
		return nil, ErrClosed
	}
	// A concurrent dial may have put a link in place meanwhile: judged
	// the same way, so an older incarnation's dial never displaces it.
	cur, ok := e.peers[peer.Agent]
	if ok {
		switch judge(cur.desc, cur.failed.Load(), peer) {
		case reuse:
			e.peerMu.Unlock()
			l.close()
			return cur, nil
		case stale:
			e.peerMu.Unlock()
			l.close()
			return nil, staleErr(cur.desc, peer)
		}
	}
	p := &peerState{desc: peer, link: l}
	e.peers[peer.Agent] = p
	e.peerMu.Unlock()
	if ok {
		cur.link.close()
	}
	return p, nil
}

func (e *Engine) serves(t Transport) bool { return slices.Contains(e.served, t) }

// dial chooses and connects a transport to peer.
func (e *Engine) dial(ctx context.Context, peer Descriptor) (link, error) {
	type candidate struct {
		t      Transport
		reason string
		dial   func() (link, error)
	}
	var cands []candidate
	both := func(t Transport) bool { return e.serves(t) && slices.Contains(peer.Transports, t) }
	if both(TransportInproc) {
		if rx := inprocLookup(peer); rx != nil {
			cands = append(cands, candidate{TransportInproc, "peer engine is in this process", func() (link, error) { return &inprocLink{tx: e, rx: rx}, nil }})
		}
	}
	if both(TransportCUDAIPC) && peer.TCPAddr != "" {
		if ok, reason := e.ipcReach(peer); ok {
			cands = append(cands, candidate{TransportCUDAIPC, reason, func() (link, error) { return dialIPC(ctx, e, peer) }})
		}
	}
	// shm maps memfds: device memory on either side goes by cuda-ipc or tcp.
	if both(TransportSHM) && peer.Host == e.cfg.Host && peer.ShmAddr != "" && !e.devs.any() && !hasDeviceRegions(peer) {
		cands = append(cands, candidate{TransportSHM, "peer is on this host", func() (link, error) { return dialSHM(ctx, e, peer) }})
	}
	// ucx is served only where the operator asked for it (it is never in
	// the default Transports), so when both serve it, it is what they want.
	if both(TransportUCX) && len(peer.UCXAddr) > 0 && !e.devs.any() && !hasDeviceRegions(peer) {
		cands = append(cands, candidate{TransportUCX, "both serve ucx", func() (link, error) { return dialUCX(ctx, e, peer) }})
	}
	if both(TransportTCP) && peer.TCPAddr != "" {
		reason := "peer is on another host"
		if peer.Host == e.cfg.Host {
			reason = "same host, shm not served by both"
			if e.devs.any() || hasDeviceRegions(peer) {
				reason = "same host, device memory, cuda-ipc not usable"
			}
		}
		cands = append(cands, candidate{TransportTCP, reason, func() (link, error) { return dialTCP(ctx, e, peer) }})
	}
	var errs []error
	for _, c := range cands {
		l, err := c.dial()
		if err != nil {
			e.log.Warn("rdma: transport unavailable, trying the next", "peer", string(peer.Agent), "transport", string(c.t), "err", err)
			errs = append(errs, fmt.Errorf("%s: %w", c.t, err))
			continue
		}
		e.log.Info("rdma: transport chosen", "peer", string(peer.Agent), "transport", string(c.t), "reason", c.reason, "skipped", len(errs))
		return l, nil
	}
	if len(errs) == 0 {
		return nil, fmt.Errorf("%w: with %s (we serve %v, it serves %v)", ErrNoTransport, peer.Agent, e.served, peer.Transports)
	}
	return nil, fmt.Errorf("%w: with %s: %w", ErrNoTransport, peer.Agent, errors.Join(errs...))
}
