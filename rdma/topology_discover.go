package rdma

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
)

// TopologyOption configures Discover. Options are seams, mostly for tests.
type TopologyOption func(*topologyConfig)

type topologyConfig struct {
	sysfsRoot string
	logger    *slog.Logger
	nvml      nvmlHandle // nil: the system library (cgo builds only)
}

// WithSysfsRoot reads NIC and PCI facts below root instead of /sys.
func WithSysfsRoot(root string) TopologyOption {
	return func(c *topologyConfig) { c.sysfsRoot = root }
}

// WithTopologyLogger sets where Discover reports what it could not learn
// (for example a missing NVML library). Default slog.Default().
func WithTopologyLogger(l *slog.Logger) TopologyOption {
	return func(c *topologyConfig) { c.logger = l }
}

// Discover reads the GPUs (through NVML) and NICs (through sysfs) of this
// host. A host without the NVML library yields no GPUs, logs one line saying
// so and is not an error; any other NVML failure is. Errors wrap ErrTopology.
func Discover(ctx context.Context, opts ...TopologyOption) (Topology, error) {
	cfg := topologyConfig{sysfsRoot: "/sys", logger: slog.Default()}
	for _, o := range opts {
		o(&cfg)
	}
	if err := ctx.Err(); err != nil {
		return Topology{}, fmt.Errorf("%w: %w", ErrTopology, err)
	}
	gpus, err := discoverGPUs(ctx, cfg)
	if err != nil {
		return Topology{}, fmt.Errorf("%w: gpus: %w", ErrTopology, err)
	}
	for i := range gpus {
		if loc, ok := pciDeviceLocation(cfg.sysfsRoot, gpus[i].PCIBusID); ok {
			gpus[i].PCIPath = loc.path
			if gpus[i].NUMANode < 0 {
				gpus[i].NUMANode = loc.numaNode
			}
		}
	}
	slices.SortFunc(gpus, func(a, b GPU) int { return a.Index - b.Index })
	nics, err := discoverNICs(cfg.sysfsRoot)
	if err != nil {
		return Topology{}, fmt.Errorf("%w: nics: %w", ErrTopology, err)
	}
	// Empty, not nil: the JSON form says "gpus": [] rather than null.
	if gpus == nil {
		gpus = []GPU{}
	}
	if nics == nil {
		nics = []NIC{}
	}
	return Topology{GPUs: gpus, NICs: nics}, nil
}

// DiscoverAndLog is what a worker calls at start-up: it discovers the
// topology and logs it as one line on logger. A discovery error is returned,
// not logged.
func DiscoverAndLog(ctx context.Context, logger *slog.Logger, opts ...TopologyOption) (Topology, error) {
	if logger == nil {
		logger = slog.Default()
	}
	t, err := Discover(ctx, append([]TopologyOption{WithTopologyLogger(logger)}, opts...)...)
	if err != nil {
		return Topology{}, err
	}
	logger.LogAttrs(ctx, slog.LevelInfo, "rdma: topology", slog.Any("topology", t))
	return t, nil
}
