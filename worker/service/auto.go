package service

import (
	"time"

	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/config"
)

// autoRouter is decode --prefill auto's router: the thresholds of cfg over
// the load dec knows of its prefill instances (registry heartbeats plus its
// own handoffs in flight), read per request without asking a peer.
func autoRouter(cfg config.Config, dec *transfer.Decoder) worker.Router {
	return worker.AutoRouter{
		Policy: worker.AutoPolicy{MinRemoteTokens: cfg.AutoMinTokens, MaxPrefillQueue: cfg.AutoMaxQueue,
			MaxLocalRunning: cfg.AutoMaxRunning},
		Load: func() worker.PrefillLoad {
			l := dec.PrefillLoad(time.Now())
			return worker.PrefillLoad{Instances: l.Instances, Inflight: l.Inflight, Rows: l.Rows}
		},
	}
}
