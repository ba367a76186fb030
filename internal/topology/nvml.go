//go:build cgo

package topology

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// nvmlHandle is the NVML library as Discover sees it.
type nvmlHandle = nvml.Interface

// WithNVML makes Discover query lib instead of the system NVML library
// (nvml.New()). Tests pass go-nvml's mocks.
func WithNVML(lib nvml.Interface) Option {
	return func(c *config) { c.nvml = lib }
}

// nvmlCall names a failed NVML query and keeps the nvml.Return reachable
// through errors.Is.
func nvmlCall(op string, ret nvml.Return) error {
	return fmt.Errorf("nvml %s: %w", op, ret)
}

// nvmlOptional classifies the Return of a query whose answer some devices or
// drivers do not have: known reports SUCCESS, err is set for real failures.
func nvmlOptional(op string, ret nvml.Return) (known bool, err error) {
	switch ret {
	case nvml.SUCCESS:
		return true, nil
	case nvml.ERROR_NOT_SUPPORTED, nvml.ERROR_FUNCTION_NOT_FOUND, nvml.ERROR_INVALID_ARGUMENT, nvml.ERROR_NOT_FOUND:
		return false, nil
	default:
		return false, nvmlCall(op, ret)
	}
}

func discoverGPUs(ctx context.Context, cfg config) (gpus []GPU, err error) {
	lib := cfg.nvml
	if lib == nil {
		lib = nvml.New()
	}
	ret := lib.Init()
	if ret == nvml.ERROR_LIBRARY_NOT_FOUND {
		cfg.logger.LogAttrs(ctx, slog.LevelInfo, "topology: NVML library not found; topology has no GPUs")
		return nil, nil
	}
	if ret != nvml.SUCCESS {
		return nil, nvmlCall("init", ret)
	}
	defer func() {
		if ret := lib.Shutdown(); ret != nvml.SUCCESS {
			err = errors.Join(err, nvmlCall("shutdown", ret))
		}
	}()

	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, nvmlCall("device count", ret)
	}
	devs := make([]nvml.Device, n)
	gpus = make([]GPU, n)
	for i := range n {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		d, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, nvmlCall(fmt.Sprintf("device %d handle", i), ret)
		}
		devs[i] = d
		g, err := readGPU(i, d)
		if err != nil {
			return nil, err
		}
		gpus[i] = g
	}
	for i := range devs {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if err := readPeers(i, devs, gpus); err != nil {
			return nil, err
		}
	}
	return gpus, nil
}

func readGPU(i int, d nvml.Device) (GPU, error) {
	g := GPU{Index: i, NUMANode: -1}
	var ret nvml.Return
	if g.UUID, ret = d.GetUUID(); ret != nvml.SUCCESS {
		return GPU{}, nvmlCall(fmt.Sprintf("device %d uuid", i), ret)
	}
	if g.Name, ret = d.GetName(); ret != nvml.SUCCESS {
		return GPU{}, nvmlCall(fmt.Sprintf("device %d name", i), ret)
	}
	pci, ret := d.GetPciInfo()
	if ret != nvml.SUCCESS {
		return GPU{}, nvmlCall(fmt.Sprintf("device %d pci info", i), ret)
	}
	bus, err := pciInfoBusID(pci)
	if err != nil {
		return GPU{}, fmt.Errorf("device %d: %w", i, err)
	}
	g.PCIBusID = bus
	mem, ret := d.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return GPU{}, nvmlCall(fmt.Sprintf("device %d memory", i), ret)
	}
	g.MemoryBytes = mem.Total
	numa, ret := d.GetNumaNodeId()
	known, err := nvmlOptional(fmt.Sprintf("device %d numa node", i), ret)
	if err != nil {
		return GPU{}, err
	}
	if known && numa >= 0 {
		g.NUMANode = numa
	}
	return g, nil
}

// pciInfoBusID prefers NVML's bus id string and falls back to its numeric
// fields when the string is empty.
func pciInfoBusID(p nvml.PciInfo) (string, error) {
	var b []byte
	for _, c := range p.BusId {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	if len(b) == 0 {
		return fmt.Sprintf("%04x:%02x:%02x.0", p.Domain, p.Bus, p.Device), nil
	}
	return NormalizePCIBusID(string(b))
}

var p2pStatusNames = map[nvml.GpuP2PStatus]P2PStatus{
	nvml.P2P_STATUS_OK:                         P2POK,
	nvml.P2P_STATUS_CHIPSET_NOT_SUPPORTED:      P2PChipsetNotSupported,
	nvml.P2P_STATUS_GPU_NOT_SUPPORTED:          P2PGPUNotSupported,
	nvml.P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED: P2PTopologyNotSupported,
	nvml.P2P_STATUS_DISABLED_BY_REGKEY:         P2PDisabledByRegkey,
	nvml.P2P_STATUS_NOT_SUPPORTED:              P2PNotSupported,
	nvml.P2P_STATUS_UNKNOWN:                    P2PStatusUnknownByDriver,
}

var topologyLevels = map[nvml.GpuTopologyLevel]LinkLevel{
	nvml.TOPOLOGY_INTERNAL:   LevelInternal,
	nvml.TOPOLOGY_SINGLE:     LevelPIX,
	nvml.TOPOLOGY_MULTIPLE:   LevelPXB,
	nvml.TOPOLOGY_HOSTBRIDGE: LevelPHB,
	nvml.TOPOLOGY_NODE:       LevelNode,
	nvml.TOPOLOGY_SYSTEM:     LevelSys,
}

// readPeers fills gpus[i].Peers and gpus[i].NVLinks.
func readPeers(i int, devs []nvml.Device, gpus []GPU) error {
	d := devs[i]
	for j, o := range devs {
		if j == i {
			continue
		}
		p := GPUPeer{Index: j}
		lvl, ret := d.GetTopologyCommonAncestor(o)
		known, err := nvmlOptional(fmt.Sprintf("device %d-%d common ancestor", i, j), ret)
		if err != nil {
			return err
		}
		if known {
			p.Level = topologyLevels[lvl]
		}
		for _, c := range []struct {
			idx nvml.GpuP2PCapsIndex
			dst *P2PStatus
		}{{nvml.P2P_CAPS_INDEX_READ, &p.P2PRead}, {nvml.P2P_CAPS_INDEX_WRITE, &p.P2PWrite}, {nvml.P2P_CAPS_INDEX_NVLINK, &p.P2PNVLink}} {
			st, ret := d.GetP2PStatus(o, c.idx)
			known, err := nvmlOptional(fmt.Sprintf("device %d-%d p2p status", i, j), ret)
			if err != nil {
				return err
			}
			if known {
				s, ok := p2pStatusNames[st]
				if !ok {
					s = P2PStatusUnknownByDriver
				}
				*c.dst = s
			}
		}
		gpus[i].Peers = append(gpus[i].Peers, p)
	}
	for link := range nvml.NVLINK_MAX_LINKS {
		state, ret := d.GetNvLinkState(link)
		known, err := nvmlOptional(fmt.Sprintf("device %d nvlink %d state", i, link), ret)
		if err != nil {
			return err
		}
		if !known {
			break // no NVLink, or past the last link
		}
		if state != nvml.FEATURE_ENABLED {
			continue
		}
		gpus[i].NVLinks++
		remote, ret := d.GetNvLinkRemotePciInfo(link)
		known, err = nvmlOptional(fmt.Sprintf("device %d nvlink %d remote", i, link), ret)
		if err != nil {
			return err
		}
		if !known {
			continue
		}
		bus, err := pciInfoBusID(remote)
		if err != nil {
			continue // a switch may report a bus id we cannot parse; it is not a peer GPU
		}
		for k := range gpus[i].Peers {
			if gpus[gpus[i].Peers[k].Index].PCIBusID == bus {
				gpus[i].Peers[k].NVLinks++
			}
		}
	}
	return nil
}
