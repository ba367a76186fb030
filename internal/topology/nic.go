package topology

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// sysfs layout read here (root is "/sys" outside tests):
//
//	class/net/<if>/device        -> link to the device (a PCI function, or a child of one such as virtioN)
//	class/net/<if>/speed         link speed in Mb/s; -1 or EINVAL when down or virtual
//	class/infiniband/<ib>/device -> link to the PCI function of an RDMA device
//	class/infiniband/<ib>/ports/<n>/rate  e.g. "400 Gb/sec (4X NDR)"
//	bus/pci/devices/<bdf>        -> link into devices/pci<dom>:<bus>/.../<bdf>
//	<pci function dir>/numa_node NUMA node or -1
var (
	pciBDFRe  = regexp.MustCompile(`^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`)
	pciRootRe = regexp.MustCompile(`^pci[0-9a-f]{4}:[0-9a-f]{2}$`)
)

// pciLocation is where a device sits in the PCI tree.
type pciLocation struct {
	busID    string   // the nearest PCI function at or above the device
	path     []string // ancestors from the root complex, busID excluded
	numaNode int
}

// locatePCI resolves a sysfs device link (absolute path under root) to its PCI
// location. ok is false when no PCI function lies on the resolved path.
func locatePCI(devLink string) (pciLocation, bool, error) {
	resolved, err := filepath.EvalSymlinks(devLink)
	if err != nil {
		return pciLocation{}, false, err
	}
	comps := strings.Split(filepath.ToSlash(resolved), "/")
	last := -1
	for i, c := range comps {
		if pciBDFRe.MatchString(c) {
			last = i
		}
	}
	if last < 0 {
		return pciLocation{}, false, nil
	}
	var path []string
	for _, c := range comps[:last] {
		if pciBDFRe.MatchString(c) || pciRootRe.MatchString(c) {
			path = append(path, c)
		}
	}
	dir := filepath.FromSlash(strings.Join(comps[:last+1], "/"))
	return pciLocation{busID: comps[last], path: path, numaNode: readNUMANode(dir)}, true, nil
}

// readNUMANode reads dir/numa_node; -1 when missing or unreadable.
func readNUMANode(dir string) int {
	n, err := readIntFile(filepath.Join(dir, "numa_node"))
	if err != nil || n < 0 {
		return -1
	}
	return n
}

func readIntFile(name string) (int, error) {
	b, err := os.ReadFile(name)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

// parseIBRate turns an infiniband port rate such as "400 Gb/sec (4X NDR)" or
// "25 Gb/sec (1X EDR)" into Mb/s. ok is false for text it does not know.
func parseIBRate(s string) (int, bool) {
	fields := strings.Fields(s)
	if len(fields) < 2 || !strings.HasPrefix(fields[1], "Gb/s") {
		return 0, false
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil || v <= 0 || v > 1e6 {
		return 0, false
	}
	return int(v * 1000), true
}

// pciDeviceLocation locates the PCI function with the given normalised bus id.
func pciDeviceLocation(root, busID string) (pciLocation, bool) {
	loc, ok, err := locatePCI(filepath.Join(root, "bus", "pci", "devices", busID))
	if err != nil || !ok {
		return pciLocation{busID: busID, numaNode: -1}, false
	}
	return loc, true
}

type ibDevice struct {
	name      string
	loc       pciLocation
	onPCI     bool
	speedMbps int
}

// discoverNICs lists the NICs under a sysfs root. Interfaces without a device
// link (lo, bridges, veths, tunnels) are skipped. A missing class/net or
// class/infiniband directory means none of that kind; other fs errors are
// returned.
func discoverNICs(root string) ([]NIC, error) {
	ibs, err := discoverIB(root)
	if err != nil {
		return nil, err
	}
	netDir := filepath.Join(root, "class", "net")
	entries, err := os.ReadDir(netDir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("read %s: %w", netDir, err)
	}
	var nics []NIC
	matched := map[string]bool{}
	for _, e := range entries {
		name := e.Name()
		devLink := filepath.Join(netDir, name, "device")
		if _, err := os.Lstat(devLink); err != nil {
			continue // virtual interface
		}
		nic := NIC{Name: name, NUMANode: -1}
		if loc, ok, err := locatePCI(devLink); err == nil && ok {
			nic.PCIBusID, nic.PCIPath, nic.NUMANode = loc.busID, loc.path, loc.numaNode
		}
		if sp, err := readIntFile(filepath.Join(netDir, name, "speed")); err == nil && sp > 0 {
			nic.SpeedMbps = sp
		}
		for _, ib := range ibs {
			if nic.PCIBusID != "" && ib.onPCI && ib.loc.busID == nic.PCIBusID {
				nic.RDMA = true
				nic.RDMADevices = append(nic.RDMADevices, ib.name)
				matched[ib.name] = true
				if nic.SpeedMbps == 0 {
					nic.SpeedMbps = ib.speedMbps
				}
			}
		}
		nics = append(nics, nic)
	}
	for _, ib := range ibs {
		if matched[ib.name] {
			continue
		}
		nic := NIC{Name: ib.name, NUMANode: -1, RDMA: true, RDMADevices: []string{ib.name}, SpeedMbps: ib.speedMbps}
		if ib.onPCI {
			nic.PCIBusID, nic.PCIPath, nic.NUMANode = ib.loc.busID, ib.loc.path, ib.loc.numaNode
		}
		nics = append(nics, nic)
	}
	slices.SortFunc(nics, func(a, b NIC) int { return strings.Compare(a.Name, b.Name) })
	return nics, nil
}

func discoverIB(root string) ([]ibDevice, error) {
	ibDir := filepath.Join(root, "class", "infiniband")
	entries, err := os.ReadDir(ibDir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", ibDir, err)
	}
	var out []ibDevice
	for _, e := range entries {
		d := ibDevice{name: e.Name(), loc: pciLocation{numaNode: -1}}
		if loc, ok, err := locatePCI(filepath.Join(ibDir, d.name, "device")); err == nil && ok {
			d.loc, d.onPCI = loc, true
		}
		ports, _ := os.ReadDir(filepath.Join(ibDir, d.name, "ports"))
		for _, p := range ports {
			b, err := os.ReadFile(filepath.Join(ibDir, d.name, "ports", p.Name(), "rate"))
			if err != nil {
				continue
			}
			if v, ok := parseIBRate(string(b)); ok && v > d.speedMbps {
				d.speedMbps = v
			}
		}
		out = append(out, d)
	}
	return out, nil
}
