package service

import (
	"log/slog"

	"github.com/nats-io/nats.go"

	"github.com/handoff-io/handoff/kvevents"
	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/worker/config"
)

// startEventPublisher publishes the cache events of n's ranks that keep a
// prefix cache (transfer.EventPublisher), so decoders route each prompt
// to where its longest state lives. It returns a no-op stop when none
// does.
func startEventPublisher(nc *nats.Conn, cfg config.Config, n *node, log *slog.Logger) (stop func(), err error) {
	var ranks []transfer.EventRank
	medium := kvevents.MediumCPU
	if n.mem.device() {
		medium = kvevents.MediumGPU
	}
	for _, r := range n.ranks {
		root, ok := r.PrefixRoot()
		if !ok {
			continue
		}
		ranks = append(ranks, transfer.EventRank{Rank: r.Index(), Cache: r.Manager(), Root: root,
			BlockSize: r.TokensPerBlock(), Medium: medium})
	}
	if len(ranks) == 0 {
		return func() {}, nil
	}
	p, err := transfer.StartEventPublisher(nc, transfer.EventPublisherConfig{
		Instance: cfg.InstanceID, Namespace: cfg.Namespace, Ranks: ranks, Logger: log,
	})
	if err != nil {
		return nil, err
	}
	return p.Close, nil
}
