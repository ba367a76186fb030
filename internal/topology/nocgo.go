//go:build !cgo

package topology

import (
	"context"
	"log/slog"
)

// nvmlHandle stands in for nvml.Interface, which needs cgo.
type nvmlHandle interface{}

// discoverGPUs cannot reach NVML without cgo: the topology has no GPUs, and
// the log says why.
func discoverGPUs(ctx context.Context, cfg config) ([]GPU, error) {
	cfg.logger.LogAttrs(ctx, slog.LevelInfo, "topology: built without cgo, NVML unavailable; topology has no GPUs")
	return nil, nil
}
