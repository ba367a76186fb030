package rdma

// The writer side's peers: connecting to one, choosing its transport, and
// the link kept for it.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
)

// peerState is the writer side's connection to one peer.
type peerState struct {
	desc Descriptor
	link link
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
// no-op; a changed descriptor replaces the old connection.
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

func (e *Engine) peerFor(ctx context.Context, peer Descriptor) (*peerState, error) {
	if peer.Agent == "" {
		return nil, fmt.Errorf("%w: descriptor without agent", ErrNoTransport)
	}
	// A replaced link is closed after peerMu is released: closing waits for
	// the link's own reconnects, which must not stall every other peer.
	var stale link
	e.peerMu.Lock()
	if p, ok := e.peers[peer.Agent]; ok {
		if sameEndpoint(p.desc, peer) {
			e.peerMu.Unlock()
			return p, nil
		}
		e.log.Info("rdma: peer descriptor changed, reconnecting", "peer", string(peer.Agent))
		delete(e.peers, peer.Agent)
		stale = p.link
	}
	e.peerMu.Unlock()
	if stale != nil {
		stale.close()
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
	old, ok := e.peers[peer.Agent]
	if ok && sameEndpoint(old.desc, peer) { // a concurrent dial won
		e.peerMu.Unlock()
		l.close()
		return old, nil
	}
	p := &peerState{desc: peer, link: l}
	e.peers[peer.Agent] = p
	e.peerMu.Unlock()
	if ok {
		old.link.close()
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
