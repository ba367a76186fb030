package topology

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
)

// Option configures Discover. Options are seams, mostly for tests.
type Option func(*config)

type config struct {
	sysfsRoot string
	logger    *slog.Logger
	nvml      nvmlHandle // nil: the system library (cgo builds only)
}

// WithSysfsRoot reads NIC and PCI facts below root instead of /sys.
func WithSysfsRoot(root string) Option {
	return func(c *config) { c.sysfsRoot = root }
}

// WithLogger sets where Discover reports what it could not learn
// (for example a missing NVML library). Default slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(c *config) { c.logger = l }
}

// Discover reads the GPUs (through NVML) and NICs (through sysfs) of this
// host. A host without the NVML library yields no GPUs, logs one line saying
// so and is not an error; any other NVML failure is. Errors wrap ErrDiscovery.
func Discover(ctx context.Context, opts ...Option) (Host, error) {
	cfg := config{sysfsRoot: "/sys", logger: slog.Default()}
	for _, o := range opts {
		o(&cfg)
	}
	if err := ctx.Err(); err != nil {
		return Host{}, fmt.Errorf("%w: %w", ErrDiscovery, err)
	}
	gpus, err := discoverGPUs(ctx, cfg)
	if err != nil {
		return Host{}, fmt.Errorf("%w: gpus: %w", ErrDiscovery, err)
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
		return Host{}, fmt.Errorf("%w: nics: %w", ErrDiscovery, err)
	}
	// Empty, not nil: the JSON form says "gpus": [] rather than null.
	if gpus == nil {
		gpus = []GPU{}
	}
	if nics == nil {
		nics = []NIC{}
	}
	return Host{GPUs: gpus, NICs: nics}, nil
}

// DiscoverAndLog is what a worker calls at start-up: it discovers the
// topology and logs it as one line on logger. A discovery error is returned,
// not logged.
func DiscoverAndLog(ctx context.Context, logger *slog.Logger, opts ...Option) (Host, error) {
	if logger == nil {
		logger = slog.Default()
	}
	t, err := Discover(ctx, append([]Option{WithLogger(logger)}, opts...)...)
	if err != nil {
		return Host{}, err
	}
	logger.LogAttrs(ctx, slog.LevelInfo, "topology: host", slog.Any("topology", t))
	return t, nil
}
