package topology

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
)

// ErrDiscovery wraps every error returned by Discover. The underlying cause
// (an nvml.Return where NVML refused a query, or an fs error) stays reachable
// through errors.Is/As.
var ErrDiscovery = errors.New("topology: discovery")

// ErrBadPCIBusID is returned by NormalizePCIBusID for text that is not a PCI
// bus id.
var ErrBadPCIBusID = errors.New("topology: malformed PCI bus id")

// Host is what this host offers the data path: GPUs and network
// interfaces, with the facts placement decisions need. It is plain data,
// produced once by Discover; every decision over it is a pure function.
type Host struct {
	GPUs []GPU `json:"gpus"`
	NICs []NIC `json:"nics"`
}

// GPU is one device as NVML reports it.
type GPU struct {
	Index       int    `json:"index"`
	UUID        string `json:"uuid"`
	Name        string `json:"name"`
	PCIBusID    string `json:"pci_bus_id"` // normalised, see NormalizePCIBusID
	NUMANode    int    `json:"numa_node"`  // -1 when unknown
	MemoryBytes uint64 `json:"memory_bytes"`
	// NVLinks is the number of active NVLink links of this GPU (0 without NVLink).
	NVLinks int `json:"nvlinks"`
	// PCIPath lists the PCI ancestors from the root complex down to (not
	// including) the device, as read from sysfs; empty when sysfs lacks it.
	PCIPath []string `json:"pci_path,omitempty"`
	// Peers holds one entry per other GPU, in index order.
	Peers []GPUPeer `json:"peers,omitempty"`
}

// GPUPeer describes how a GPU reaches another one.
type GPUPeer struct {
	Index int       `json:"index"`
	Level LinkLevel `json:"level"` // common PCI ancestor, as nvidia-smi topo -m names it
	// P2P statuses for reads, writes and NVLink between the pair.
	P2PRead   P2PStatus `json:"p2p_read"`
	P2PWrite  P2PStatus `json:"p2p_write"`
	P2PNVLink P2PStatus `json:"p2p_nvlink"`
	// NVLinks counts active links whose remote end is the peer itself. On
	// NVSwitch systems every link ends at a switch, so this is 0 there and
	// P2PNVLink tells whether the pair talks over NVLink.
	NVLinks int `json:"nvlinks"`
}

// NIC is one network interface backed by a device (virtual interfaces such as
// lo, bridges and veths are left out), or an RDMA device with no netdev.
type NIC struct {
	Name     string `json:"name"`
	PCIBusID string `json:"pci_bus_id,omitempty"` // empty when the device is not on PCI
	NUMANode int    `json:"numa_node"`            // -1 when unknown
	// RDMA is true when an InfiniBand-class device (verbs) sits on the same
	// PCI function; RDMADevices names them (e.g. mlx5_0).
	RDMA        bool     `json:"rdma"`
	RDMADevices []string `json:"rdma_devices,omitempty"`
	SpeedMbps   int      `json:"speed_mbps"` // 0 when unknown (link down, virtual)
	PCIPath     []string `json:"pci_path,omitempty"`
}

// LinkLevel is how far apart two PCI devices are, closest first. The names
// follow nvidia-smi topo -m. The zero value is LevelUnknown, which ranks
// farthest.
type LinkLevel uint8

const (
	LevelUnknown  LinkLevel = iota
	LevelInternal           // same board (multi-GPU card)
	LevelPIX                // at most one PCIe switch between them
	LevelPXB                // several PCIe bridges, no host bridge
	LevelPHB                // through one PCIe host bridge (same root complex)
	LevelNode               // across host bridges within one NUMA node
	LevelSys                // across NUMA nodes (SMP interconnect)
)

var levelNames = [...]string{"unknown", "internal", "pix", "pxb", "phb", "node", "sys"}

func (l LinkLevel) String() string {
	if int(l) < len(levelNames) {
		return levelNames[l]
	}
	return "level(" + strconv.Itoa(int(l)) + ")"
}

// MarshalText encodes the level by name.
func (l LinkLevel) MarshalText() ([]byte, error) { return []byte(l.String()), nil }

// UnmarshalText decodes a level name written by MarshalText.
func (l *LinkLevel) UnmarshalText(b []byte) error {
	for i, n := range levelNames {
		if n == string(b) {
			*l = LinkLevel(i)
			return nil
		}
	}
	return fmt.Errorf("topology: unknown link level %q", b)
}

// rank orders levels closest first with unknown last.
func (l LinkLevel) rank() int {
	if l == LevelUnknown || int(l) >= len(levelNames) {
		return len(levelNames)
	}
	return int(l)
}

// P2PStatus is NVML's answer to "can these two GPUs talk peer to peer".
type P2PStatus string

const (
	P2PUnknown               P2PStatus = ""
	P2POK                    P2PStatus = "ok"
	P2PChipsetNotSupported   P2PStatus = "chipset not supported"
	P2PGPUNotSupported       P2PStatus = "gpu not supported"
	P2PTopologyNotSupported  P2PStatus = "topology not supported"
	P2PDisabledByRegkey      P2PStatus = "disabled by regkey"
	P2PNotSupported          P2PStatus = "not supported"
	P2PStatusUnknownByDriver P2PStatus = "unknown"
)

// NormalizePCIBusID returns a bus id in the sysfs form "dddd:bb:dd.f", lower
// case. It accepts NVML's 8-digit domain ("00000000:17:00.0"), a 4-digit
// domain, or no domain ("17:00.0", domain 0). A domain wider than 16 bits
// must be zero-padded (NVML pads to 8 digits).
func NormalizePCIBusID(s string) (string, error) {
	orig := s
	s = strings.ToLower(strings.TrimSpace(s))
	parts := strings.Split(s, ":")
	var dom, bus, devfn string
	switch len(parts) {
	case 2:
		dom, bus, devfn = "0", parts[0], parts[1]
	case 3:
		dom, bus, devfn = parts[0], parts[1], parts[2]
	default:
		return "", fmt.Errorf("%w: %q", ErrBadPCIBusID, orig)
	}
	dev, fn, ok := strings.Cut(devfn, ".")
	if !ok {
		return "", fmt.Errorf("%w: %q", ErrBadPCIBusID, orig)
	}
	d, err1 := parseHexField(dom, 8, 0xffff)
	b, err2 := parseHexField(bus, 2, 0xff)
	v, err3 := parseHexField(dev, 2, 0x1f)
	f, err4 := parseHexField(fn, 1, 7)
	if err := errors.Join(err1, err2, err3, err4); err != nil {
		return "", fmt.Errorf("%w: %q", ErrBadPCIBusID, orig)
	}
	return fmt.Sprintf("%04x:%02x:%02x.%x", d, b, v, f), nil
}

func parseHexField(s string, maxDigits int, maxVal uint64) (uint64, error) {
	if s == "" || len(s) > maxDigits {
		return 0, errors.New("bad width")
	}
	v, err := strconv.ParseUint(s, 16, 32)
	if err != nil {
		return 0, err
	}
	if v > maxVal {
		return 0, errors.New("out of range")
	}
	return v, nil
}

// PCILevel classifies the distance between two devices from their PCI
// ancestor paths (root complex first, device excluded) and NUMA nodes (-1 when
// unknown). With no paths it can only tell NODE from SYS.
//
// Sharing no ancestor means different host bridges: NODE on the same NUMA node
// (two -1 count as the same: the kernel reports -1 on single-node machines),
// SYS otherwise, unknown when only one side knows its node. Sharing only the
// root complex is PHB. Sharing a bridge below it is PIX when each side is at
// most one bridge below the common one (one switch), PXB otherwise.
func PCILevel(pathA, pathB []string, numaA, numaB int) LinkLevel {
	numaLevel := func() LinkLevel {
		switch {
		case numaA == numaB:
			return LevelNode
		case numaA < 0 || numaB < 0:
			return LevelUnknown
		default:
			return LevelSys
		}
	}
	if len(pathA) == 0 || len(pathB) == 0 {
		if numaA < 0 && numaB < 0 {
			return LevelUnknown
		}
		return numaLevel()
	}
	c := 0
	for c < len(pathA) && c < len(pathB) && pathA[c] == pathB[c] {
		c++
	}
	switch {
	case c == 0:
		return numaLevel()
	case c == 1:
		return LevelPHB
	case len(pathA)-c <= 1 && len(pathB)-c <= 1:
		return LevelPIX
	default:
		return LevelPXB
	}
}

// NICAffinity is a NIC seen from one GPU.
type NICAffinity struct {
	NIC   NIC       `json:"nic"`
	Level LinkLevel `json:"level"`
}

// NICsFor ranks the NICs for the GPU with the given index, best first: the
// closest PCI level, then RDMA-capable before not, then the faster link, then
// by name. It returns nil when no GPU has that index.
func (t Host) NICsFor(gpuIndex int) []NICAffinity {
	i := slices.IndexFunc(t.GPUs, func(g GPU) bool { return g.Index == gpuIndex })
	if i < 0 {
		return nil
	}
	g := t.GPUs[i]
	out := make([]NICAffinity, 0, len(t.NICs))
	for _, n := range t.NICs {
		out = append(out, NICAffinity{NIC: n, Level: PCILevel(g.PCIPath, n.PCIPath, g.NUMANode, n.NUMANode)})
	}
	slices.SortStableFunc(out, func(a, b NICAffinity) int {
		if d := a.Level.rank() - b.Level.rank(); d != 0 {
			return d
		}
		if a.NIC.RDMA != b.NIC.RDMA {
			if a.NIC.RDMA {
				return -1
			}
			return 1
		}
		if d := b.NIC.SpeedMbps - a.NIC.SpeedMbps; d != 0 {
			return d
		}
		return strings.Compare(a.NIC.Name, b.NIC.Name)
	})
	return out
}

// BestNIC returns the first NIC of NICsFor, restricted to RDMA-capable NICs
// when rdmaOnly is set. ok is false when there is none.
func (t Host) BestNIC(gpuIndex int, rdmaOnly bool) (NICAffinity, bool) {
	for _, a := range t.NICsFor(gpuIndex) {
		if !rdmaOnly || a.NIC.RDMA {
			return a, true
		}
	}
	return NICAffinity{}, false
}

// RDMANICs returns the RDMA-capable NICs.
func (t Host) RDMANICs() []NIC {
	var out []NIC
	for _, n := range t.NICs {
		if n.RDMA {
			out = append(out, n)
		}
	}
	return out
}

// Summary renders the topology on one line for a start-up log.
func (t Host) Summary() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d GPU", len(t.GPUs))
	if len(t.GPUs) != 1 {
		b.WriteByte('s')
	}
	if len(t.GPUs) > 0 {
		b.WriteString(" (")
		for i, g := range groupGPUs(t.GPUs) {
			if i > 0 {
				b.WriteString(", ")
			}
			b.WriteString(g)
		}
		b.WriteString(")")
	}
	fmt.Fprintf(&b, ", %d NIC", len(t.NICs))
	if len(t.NICs) != 1 {
		b.WriteByte('s')
	}
	if len(t.NICs) > 0 {
		b.WriteString(" (")
		for i, n := range t.NICs {
			if i > 0 {
				b.WriteString(", ")
			}
			b.WriteString(n.Name)
			if n.SpeedMbps > 0 {
				fmt.Fprintf(&b, " %dMb/s", n.SpeedMbps)
			}
			if n.NUMANode >= 0 {
				fmt.Fprintf(&b, " numa%d", n.NUMANode)
			}
			if n.RDMA {
				b.WriteString(" rdma")
			}
		}
		b.WriteString(")")
	}
	if len(t.GPUs) > 0 && len(t.NICs) > 0 {
		b.WriteString(", gpu->nic")
		for _, g := range t.GPUs {
			if a, ok := t.BestNIC(g.Index, false); ok {
				fmt.Fprintf(&b, " %d:%s/%s", g.Index, a.NIC.Name, a.Level)
			}
		}
	}
	return b.String()
}

// groupGPUs collapses identical models: "8x NVIDIA H200 141GB HBM3e 141GiB nvlink18".
func groupGPUs(gpus []GPU) []string {
	type key struct {
		name    string
		gib     uint64
		nvlinks int
	}
	var order []key
	count := map[key]int{}
	for _, g := range gpus {
		k := key{g.Name, g.MemoryBytes >> 30, g.NVLinks}
		if count[k] == 0 {
			order = append(order, k)
		}
		count[k]++
	}
	out := make([]string, 0, len(order))
	for _, k := range order {
		s := fmt.Sprintf("%dx %s %dGiB", count[k], k.name, k.gib)
		if k.nvlinks > 0 {
			s += fmt.Sprintf(" nvlink%d", k.nvlinks)
		}
		out = append(out, s)
	}
	return out
}

// LogValue lets a Host be logged as structured attributes.
func (t Host) LogValue() slog.Value {
	return slog.GroupValue(
		slog.Int("gpus", len(t.GPUs)),
		slog.Int("nics", len(t.NICs)),
		slog.Int("rdma_nics", len(t.RDMANICs())),
		slog.String("summary", t.Summary()),
	)
}
