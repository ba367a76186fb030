package transfer

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"

	"github.com/handoff-io/handoff/transfer/wire"
)

// JoinRegistry opens the namespace's registry for a process that is neither
// a Decoder nor a Prefiller (the handoff agent): it announces self() now and
// every Heartbeat until Close deletes the entry, and, when watch is not
// empty, mirrors the live entries of that role (Instances). Refresh
// publishes self() ahead of the next heartbeat, after a change peers should
// see at once.
func JoinRegistry(ctx context.Context, nc *nats.Conn, cfg RegistryConfig, self func() wire.Instance, watch wire.Role) (*Registry, error) {
	r, err := openRegistry(ctx, nc, cfg)
	if err != nil {
		return nil, err
	}
	if watch != "" {
		err = r.watch(ctx, watch)
	}
	if err == nil {
		err = r.announce(ctx, self)
	}
	if err != nil {
		cctx, cancel := context.WithTimeout(context.Background(), r.cfg.Heartbeat)
		defer cancel()
		return nil, errors.Join(fmt.Errorf("transfer: join registry: %w", err), r.close(cctx))
	}
	return r, nil
}

// Refresh publishes the announced entry now (JoinRegistry).
func (r *Registry) Refresh(ctx context.Context) error { return r.refresh(ctx) }

// Close stops the registry's goroutines and deletes the announced entry,
// bounded by ctx (JoinRegistry). Idempotent.
func (r *Registry) Close(ctx context.Context) error { return r.close(ctx) }
