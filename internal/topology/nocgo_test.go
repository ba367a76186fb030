//go:build !cgo

package topology

import (
	"bytes"
	"context"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
)

// nvmlAbsent: without cgo there is no NVML to hide.
func nvmlAbsent() Option { return func(*config) {} }

func TestDiscoverWithoutCgo(t *testing.T) {
	var logs bytes.Buffer
	f := newFakeSysfs(t)
	f.netdev("eth0", f.pci(0, "pci0000:00/0000:00:03.0"), "10000")
	topo, err := Discover(context.Background(), WithSysfsRoot(f.root),
		WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	require.NoError(t, err)
	require.Empty(t, topo.GPUs)
	require.Len(t, topo.NICs, 1)
	require.Contains(t, logs.String(), "NVML unavailable")
}
