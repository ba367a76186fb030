package agent

import (
	"context"
	"fmt"
	"time"

	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/transfer/wire"
)

// The registry. With NATS an agent joins its namespace's instance registry
// (the JetStream KV bucket the workers announce themselves in,
// transfer.JoinRegistry) as role "agent" under its name: the entry carries
// the current registration's layout fingerprint and data-path descriptor,
// is refreshed at once when an engine registers or goes, kept alive by
// heartbeats, and deleted when the agent stops (or expires when it dies).
// The agent mirrors the other agents' entries, which OpPeers lists to its
// engine, so that an engine's scheduler finds the agents it can exchange
// with (same fingerprint, or another TP of the same model) without asking
// each. Workers watch only their peers' roles and pass agents by.

// joinTimeout bounds joining the registry: past the registry's own
// patience for a cluster that cannot place three replicas (it then falls
// back to one), as the workers wait. registryTimeout bounds a refresh and
// leaving.
const (
	joinTimeout     = time.Minute
	registryTimeout = 5 * time.Second
)

// joinRegistry announces the agent and starts the goroutine that publishes
// the entry again when a registration changes (refreshRegistry); leave
// stops it and deletes the entry.
func (a *Agent) joinRegistry(ctx context.Context) (leave func(), err error) {
	cfg := a.cfg.Registry
	cfg.Namespace = a.cfg.Namespace
	if cfg.Logger == nil {
		cfg.Logger = a.log
	}
	jctx, cancel := context.WithTimeout(ctx, joinTimeout)
	defer cancel()
	reg, err := transfer.JoinRegistry(jctx, a.nc, cfg, a.self, wire.RoleAgent)
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	kick, stop, done := make(chan struct{}, 1), make(chan struct{}), make(chan struct{})
	a.mu.Lock()
	a.reg, a.kick = reg, kick
	a.mu.Unlock()
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-kick:
			}
			// Off the sessions' goroutines: an engine's register is
			// answered at once, whether NATS is up or not.
			rctx, cancel := context.WithTimeout(context.Background(), registryTimeout)
			if err := reg.Refresh(rctx); err != nil {
				// The heartbeat publishes it again within a third of the TTL.
				a.log.Warn("agent: registry refresh", "err", err)
			}
			cancel()
		}
	}()
	a.log.Info("agent: joined the registry", "namespace", cfg.Namespace)
	return func() {
		a.mu.Lock()
		a.reg, a.kick = nil, nil
		a.mu.Unlock()
		close(stop)
		<-done
		cctx, cancel := context.WithTimeout(context.Background(), registryTimeout)
		defer cancel()
		if err := reg.Close(cctx); err != nil {
			a.log.Warn("agent: leaving the registry", "err", err)
		}
	}, nil
}

// self is the agent's registry entry.
func (a *Agent) self() wire.Instance {
	inst := wire.Instance{ID: a.cfg.Name, Role: wire.RoleAgent}
	a.mu.Lock()
	s := a.latest
	a.mu.Unlock()
	if s == nil {
		return inst
	}
	eng, p, err := s.registration()
	if err != nil {
		return inst
	}
	inst.Fingerprint, inst.Peer = p.fingerprint, wire.PeerOf(eng.Descriptor())
	return inst
}

// refreshRegistry asks for the entry to be published again (a
// registration changed); requests made while one is pending coalesce.
func (a *Agent) refreshRegistry() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.kick == nil {
		return
	}
	select {
	case a.kick <- struct{}{}:
	default: // one is pending: it publishes the latest state
	}
}

// peers answers OpPeers: the live agents of the registry but this one,
// sorted by name; none without NATS.
func (a *Agent) peers() Reply {
	a.mu.Lock()
	reg := a.reg
	a.mu.Unlock()
	if reg == nil {
		return Reply{}
	}
	var out []Peer
	for _, inst := range reg.Instances(wire.RoleAgent, time.Now()) {
		if inst.ID == a.cfg.Name {
			continue
		}
		out = append(out, Peer{Name: inst.ID, Fingerprint: inst.Fingerprint, AgentID: inst.Peer.Agent, Transports: inst.Peer.Transports})
	}
	return Reply{Peers: out}
}
