//go:build gpu && cgo

package topology

// Run on a machine with NVIDIA GPUs and their driver:
//
//	go test -tags gpu -run TestDiscoverRealGPUs -v ./rdma
//
// TOPOLOGY_JSON=path also writes the discovered topology there.

import (
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/require"
)

func TestDiscoverRealGPUs(t *testing.T) {
	if _, err := os.Stat("/dev/nvidiactl"); err != nil {
		t.Skip("no /dev/nvidiactl: not a GPU machine")
	}
	lib := nvml.New()
	var inits int
	topo, err := Discover(context.Background(), WithNVML(countingNVML{Interface: lib, inits: &inits}),
		WithLogger(slog.New(slog.NewTextHandler(os.Stderr, nil))))
	require.NoError(t, err)
	require.Equal(t, 1, inits)
	b, err := json.MarshalIndent(topo, "", "  ")
	require.NoError(t, err)
	t.Logf("topology: %s\n%s", topo.Summary(), b)
	if p := os.Getenv("TOPOLOGY_JSON"); p != "" {
		require.NoError(t, os.WriteFile(p, b, 0o644))
	}

	require.NotEmpty(t, topo.GPUs, "a driver is present, so NVML must report GPUs")
	for i, g := range topo.GPUs {
		require.Equal(t, i, g.Index)
		require.True(t, strings.HasPrefix(g.UUID, "GPU-"), g.UUID)
		require.NotEmpty(t, g.Name)
		require.Positive(t, g.MemoryBytes)
		norm, err := NormalizePCIBusID(g.PCIBusID)
		require.NoError(t, err)
		require.Equal(t, norm, g.PCIBusID)
		_, err = os.Stat("/sys/bus/pci/devices/" + g.PCIBusID)
		require.NoError(t, err, "NVML's bus id names a sysfs PCI device")
		require.NotEmpty(t, g.PCIPath, "sysfs gives the PCI path")
		require.GreaterOrEqual(t, g.NUMANode, -1)
		require.Len(t, g.Peers, len(topo.GPUs)-1)
		for _, p := range g.Peers {
			require.NotEqual(t, LevelUnknown, p.Level, "gpu %d peer %d", i, p.Index)
		}
	}
	for _, n := range topo.NICs {
		if n.PCIBusID != "" {
			_, err := os.Stat("/sys/bus/pci/devices/" + n.PCIBusID)
			require.NoError(t, err, n.Name)
		}
	}
}

type countingNVML struct {
	nvml.Interface
	inits *int
}

func (c countingNVML) Init() nvml.Return { *c.inits++; return c.Interface.Init() }
