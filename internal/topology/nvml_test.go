//go:build cgo

package topology

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/stretchr/testify/require"
)

// nvmlAbsent makes Discover behave as on a host without the NVML library.
func nvmlAbsent() Option {
	return WithNVML(&mock.Interface{InitFunc: func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }})
}

// dgxBus are the GPU bus numbers of an HGX H200 board: four per socket.
var dgxBus = []int{0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb}

const nvswitchBusID = "00000000:05:00.0"

func busIDBytes(s string) [32]int8 {
	var b [32]int8
	for i := range len(s) {
		b[i] = int8(s[i])
	}
	return b
}

// countedServer wraps the dgxh200 mock: it fills the functions the mock
// leaves empty, as an HGX H200 board answers them (every NVLink ends at an
// NVSwitch, sockets split 4+4), and counts Init/Shutdown.
type countedServer struct {
	*server.Server
	inits, shutdowns int
}

func newH200(t *testing.T) *countedServer {
	t.Helper()
	s := &countedServer{Server: dgxh200.New()}
	initFn, shutdownFn := s.InitFunc, s.ShutdownFunc
	s.InitFunc = func() nvml.Return { s.inits++; return initFn() }
	s.ShutdownFunc = func() nvml.Return { s.shutdowns++; return shutdownFn() }
	socket := func(d nvml.Device) int { return d.(*server.Device).Index / 4 }
	for _, dev := range s.Devices {
		d := dev.(*server.Device)
		bus := busIDBytes(fmt.Sprintf("00000000:%02X:00.0", dgxBus[d.Index]))
		d.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
			return nvml.PciInfo{BusId: bus, Bus: uint32(dgxBus[d.Index]), PciDeviceId: d.Config.PciDeviceId}, nvml.SUCCESS
		}
		d.GetNumaNodeIdFunc = func() (int, nvml.Return) { return socket(d), nvml.SUCCESS }
		d.GetTopologyCommonAncestorFunc = func(o nvml.Device) (nvml.GpuTopologyLevel, nvml.Return) {
			if socket(o) == socket(d) {
				return nvml.TOPOLOGY_NODE, nvml.SUCCESS
			}
			return nvml.TOPOLOGY_SYSTEM, nvml.SUCCESS
		}
		d.GetP2PStatusFunc = func(nvml.Device, nvml.GpuP2PCapsIndex) (nvml.GpuP2PStatus, nvml.Return) {
			return nvml.P2P_STATUS_OK, nvml.SUCCESS
		}
		d.GetNvLinkStateFunc = func(link int) (nvml.EnableState, nvml.Return) {
			if link >= 18 {
				return 0, nvml.ERROR_INVALID_ARGUMENT
			}
			return nvml.FEATURE_ENABLED, nvml.SUCCESS
		}
		d.GetNvLinkRemotePciInfoFunc = func(int) (nvml.PciInfo, nvml.Return) {
			return nvml.PciInfo{BusId: busIDBytes(nvswitchBusID)}, nvml.SUCCESS
		}
	}
	return s
}

func (s *countedServer) device(i int) *server.Device { return s.Devices[i].(*server.Device) }

func TestDiscoverH200(t *testing.T) {
	s := newH200(t)
	topo, err := Discover(context.Background(), WithNVML(s), WithSysfsRoot(t.TempDir()))
	require.NoError(t, err)
	require.Equal(t, 1, s.inits)
	require.Equal(t, 1, s.shutdowns)
	require.Len(t, topo.GPUs, 8)
	require.Empty(t, topo.NICs)
	for i, g := range topo.GPUs {
		require.Equal(t, i, g.Index)
		require.Equal(t, s.device(i).UUID, g.UUID)
		require.Equal(t, "NVIDIA H200 141GB HBM3e", g.Name)
		require.Equal(t, fmt.Sprintf("0000:%02x:00.0", dgxBus[i]), g.PCIBusID)
		require.Equal(t, i/4, g.NUMANode)
		require.Equal(t, uint64(144384)<<20, g.MemoryBytes)
		require.Equal(t, 18, g.NVLinks)
		require.Len(t, g.Peers, 7)
		for _, p := range g.Peers {
			require.NotEqual(t, i, p.Index)
			want := LevelNode
			if p.Index/4 != i/4 {
				want = LevelSys
			}
			require.Equal(t, want, p.Level, "gpu %d peer %d", i, p.Index)
			require.Equal(t, P2POK, p.P2PRead)
			require.Equal(t, P2POK, p.P2PWrite)
			require.Equal(t, P2POK, p.P2PNVLink)
			require.Zero(t, p.NVLinks, "links end at NVSwitches, not at the peer")
		}
	}
	require.Contains(t, topo.Summary(), "8 GPUs (8x NVIDIA H200 141GB HBM3e 141GiB nvlink18)")
}

// TestDiscoverDirectNVLinkPair: two GPUs bridged to each other, a PCIe board
// whose driver does not know NUMA (taken from sysfs instead), p2p refused by
// the chipset, and a NIC behind the same switch as GPU 0.
func TestDiscoverDirectNVLinkPair(t *testing.T) {
	s := newH200(t)
	s.Devices = s.Devices[:2]
	bus := []string{"0000:18:00.0", "0000:2a:00.0"} // as newH200 numbers them
	for i := range 2 {
		d := s.device(i)
		d.GetNumaNodeIdFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
		d.GetTopologyCommonAncestorFunc = func(nvml.Device) (nvml.GpuTopologyLevel, nvml.Return) {
			return nvml.TOPOLOGY_HOSTBRIDGE, nvml.SUCCESS
		}
		d.GetP2PStatusFunc = func(_ nvml.Device, idx nvml.GpuP2PCapsIndex) (nvml.GpuP2PStatus, nvml.Return) {
			if idx == nvml.P2P_CAPS_INDEX_NVLINK {
				return nvml.P2P_STATUS_OK, nvml.SUCCESS
			}
			return nvml.P2P_STATUS_CHIPSET_NOT_SUPPORTED, nvml.SUCCESS
		}
		d.GetNvLinkStateFunc = func(link int) (nvml.EnableState, nvml.Return) {
			switch {
			case link >= 6:
				return 0, nvml.ERROR_INVALID_ARGUMENT
			case link == 5:
				return nvml.FEATURE_DISABLED, nvml.SUCCESS
			}
			return nvml.FEATURE_ENABLED, nvml.SUCCESS
		}
		peer := busIDBytes("0000" + bus[1-i])
		d.GetNvLinkRemotePciInfoFunc = func(int) (nvml.PciInfo, nvml.Return) { return nvml.PciInfo{BusId: peer}, nvml.SUCCESS }
	}
	f := newFakeSysfs(t)
	sw := "pci0000:15/0000:15:01.0/0000:16:00.0"
	f.pci(0, sw+"/0000:17:00.0/0000:18:00.0")
	nic := f.pci(0, sw+"/0000:17:01.0/0000:19:00.0")
	f.netdev("ens2", nic, "200000")
	f.ibdev("mlx5_0", nic, "200 Gb/sec (4X HDR)")
	f.pci(1, "pci0000:97/0000:97:01.0/0000:98:00.0/0000:99:00.0/0000:2a:00.0")

	topo, err := Discover(context.Background(), WithNVML(s), WithSysfsRoot(f.root))
	require.NoError(t, err)
	require.Len(t, topo.GPUs, 2)
	g0, g1 := topo.GPUs[0], topo.GPUs[1]
	require.Equal(t, 0, g0.NUMANode)
	require.Equal(t, 1, g1.NUMANode)
	require.Equal(t, []string{"pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:00.0"}, g0.PCIPath)
	require.Equal(t, 5, g0.NVLinks)
	require.Equal(t, []GPUPeer{{Index: 1, Level: LevelPHB, P2PRead: P2PChipsetNotSupported,
		P2PWrite: P2PChipsetNotSupported, P2PNVLink: P2POK, NVLinks: 5}}, g0.Peers)

	best, ok := topo.BestNIC(0, true)
	require.True(t, ok)
	require.Equal(t, "ens2", best.NIC.Name)
	require.Equal(t, LevelPIX, best.Level)
	best, ok = topo.BestNIC(1, true)
	require.True(t, ok)
	require.Equal(t, LevelSys, best.Level)
}

func TestDiscoverNVMLMissing(t *testing.T) {
	var logs bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	shutdowns := 0
	lib := &mock.Interface{
		InitFunc:     func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND },
		ShutdownFunc: func() nvml.Return { shutdowns++; return nvml.SUCCESS },
	}
	f := newFakeSysfs(t)
	f.netdev("eth0", f.pci(-1, "pci0000:00/0000:00:03.0"), "10000")
	topo, err := Discover(context.Background(), WithNVML(lib), WithSysfsRoot(f.root), WithLogger(logger))
	require.NoError(t, err)
	require.Empty(t, topo.GPUs)
	require.Len(t, topo.NICs, 1)
	require.Zero(t, shutdowns, "Shutdown pairs only a successful Init")
	require.Contains(t, logs.String(), "NVML library not found")
}

func TestDiscoverNVMLErrors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		break_ func(s *countedServer)
		want   nvml.Return
		inits  int
	}{
		{"init", func(s *countedServer) {
			s.InitFunc = func() nvml.Return { s.inits++; return nvml.ERROR_DRIVER_NOT_LOADED }
		}, nvml.ERROR_DRIVER_NOT_LOADED, 1},
		{"count", func(s *countedServer) {
			s.DeviceGetCountFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_UNKNOWN }
		}, nvml.ERROR_UNKNOWN, 1},
		{"handle", func(s *countedServer) {
			s.DeviceGetHandleByIndexFunc = func(int) (nvml.Device, nvml.Return) { return nil, nvml.ERROR_GPU_IS_LOST }
		}, nvml.ERROR_GPU_IS_LOST, 1},
		{"uuid", func(s *countedServer) {
			s.device(3).GetUUIDFunc = func() (string, nvml.Return) { return "", nvml.ERROR_GPU_IS_LOST }
		}, nvml.ERROR_GPU_IS_LOST, 1},
		{"memory", func(s *countedServer) {
			s.device(0).GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) { return nvml.Memory{}, nvml.ERROR_NO_PERMISSION }
		}, nvml.ERROR_NO_PERMISSION, 1},
		{"numa real failure", func(s *countedServer) {
			s.device(0).GetNumaNodeIdFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_UNKNOWN }
		}, nvml.ERROR_UNKNOWN, 1},
		{"common ancestor", func(s *countedServer) {
			s.device(2).GetTopologyCommonAncestorFunc = func(nvml.Device) (nvml.GpuTopologyLevel, nvml.Return) {
				return 0, nvml.ERROR_UNKNOWN
			}
		}, nvml.ERROR_UNKNOWN, 1},
		{"p2p", func(s *countedServer) {
			s.device(1).GetP2PStatusFunc = func(nvml.Device, nvml.GpuP2PCapsIndex) (nvml.GpuP2PStatus, nvml.Return) {
				return 0, nvml.ERROR_TIMEOUT
			}
		}, nvml.ERROR_TIMEOUT, 1},
		{"nvlink", func(s *countedServer) {
			s.device(7).GetNvLinkStateFunc = func(int) (nvml.EnableState, nvml.Return) { return 0, nvml.ERROR_GPU_IS_LOST }
		}, nvml.ERROR_GPU_IS_LOST, 1},
		{"shutdown", func(s *countedServer) {
			s.ShutdownFunc = func() nvml.Return { s.shutdowns++; return nvml.ERROR_UNINITIALIZED }
		}, nvml.ERROR_UNINITIALIZED, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newH200(t)
			tc.break_(s)
			topo, err := Discover(context.Background(), WithNVML(s), WithSysfsRoot(t.TempDir()))
			require.ErrorIs(t, err, ErrDiscovery)
			require.ErrorIs(t, err, tc.want)
			require.Empty(t, topo.GPUs)
			require.Equal(t, tc.inits, s.inits)
			if tc.name == "init" {
				require.Zero(t, s.shutdowns)
			} else {
				require.Equal(t, 1, s.shutdowns, "Shutdown pairs Init on every path")
			}
		})
	}
}

func TestDiscoverCanceled(t *testing.T) {
	s := newH200(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := Discover(ctx, WithNVML(s), WithSysfsRoot(t.TempDir()))
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorIs(t, err, ErrDiscovery)
}

func TestDiscoverAndLog(t *testing.T) {
	var logs bytes.Buffer
	logger := slog.New(slog.NewJSONHandler(&logs, nil))
	s := newH200(t)
	f := newFakeSysfs(t)
	f.netdev("eth0", f.pci(-1, "pci0000:00/0000:00:03.0"), "25000")
	topo, err := DiscoverAndLog(context.Background(), logger, WithNVML(s), WithSysfsRoot(f.root))
	require.NoError(t, err)
	require.Len(t, topo.GPUs, 8)
	out := logs.String()
	require.Contains(t, out, `"msg":"topology: host"`)
	require.Contains(t, out, `"gpus":8`)
	require.Contains(t, out, `"nics":1`)
	require.Contains(t, out, "eth0 25000Mb/s")
	require.Equal(t, 1, bytes.Count(logs.Bytes(), []byte("\n")), "one line")

	logs.Reset()
	_, err = DiscoverAndLog(context.Background(), logger, WithNVML(s), WithSysfsRoot(filepath.Join(f.root, "missing")))
	require.NoError(t, err, "a missing sysfs class dir means no NICs")
}
