package topology

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// fakeSysfs builds a sysfs-shaped tree with relative symlinks, as the kernel
// lays it out.
type fakeSysfs struct {
	t    *testing.T
	root string
}

func newFakeSysfs(t *testing.T) *fakeSysfs {
	t.Helper()
	return &fakeSysfs{t: t, root: t.TempDir()}
}

func (f *fakeSysfs) write(rel, content string) {
	f.t.Helper()
	p := filepath.Join(f.root, rel)
	require.NoError(f.t, os.MkdirAll(filepath.Dir(p), 0o755))
	require.NoError(f.t, os.WriteFile(p, []byte(content), 0o644))
}

// link makes rel a symlink to target (both relative to the root), written as
// a relative link.
func (f *fakeSysfs) link(rel, target string) {
	f.t.Helper()
	p := filepath.Join(f.root, rel)
	require.NoError(f.t, os.MkdirAll(filepath.Dir(p), 0o755))
	r, err := filepath.Rel(filepath.Dir(p), filepath.Join(f.root, target))
	require.NoError(f.t, err)
	require.NoError(f.t, os.Symlink(r, p))
}

// pci creates a PCI function at devices/<path> with its numa_node and its
// bus/pci/devices link; it returns the path.
func (f *fakeSysfs) pci(numa int, path string) string {
	f.t.Helper()
	dir := filepath.Join("devices", path)
	f.write(filepath.Join(dir, "numa_node"), strconv.Itoa(numa)+"\n")
	f.link(filepath.Join("bus", "pci", "devices", filepath.Base(path)), dir)
	return dir
}

// netdev creates interface name under device dir devDir (relative to root,
// "" for a virtual interface).
func (f *fakeSysfs) netdev(name, devDir, speed string) {
	f.t.Helper()
	var ifDir string
	if devDir == "" {
		ifDir = filepath.Join("devices", "virtual", "net", name)
		f.write(filepath.Join(ifDir, "mtu"), "1500\n")
	} else {
		ifDir = filepath.Join(devDir, "net", name)
		f.link(filepath.Join(ifDir, "device"), devDir)
	}
	if speed != "" {
		f.write(filepath.Join(ifDir, "speed"), speed+"\n")
	}
	f.link(filepath.Join("class", "net", name), ifDir)
}

func (f *fakeSysfs) ibdev(name, devDir string, rates ...string) {
	f.t.Helper()
	dir := filepath.Join(devDir, "infiniband", name)
	f.link(filepath.Join(dir, "device"), devDir)
	for i, r := range rates {
		f.write(filepath.Join(dir, "ports", strconv.Itoa(i+1), "rate"), r+"\n")
	}
	f.link(filepath.Join("class", "infiniband", name), dir)
}

func TestDiscoverNICs(t *testing.T) {
	f := newFakeSysfs(t)
	// Socket 0: a switch with a ConnectX NIC (RoCE netdev + verbs device).
	sw0 := "pci0000:00/0000:00:01.0/0000:01:00.0"
	cx0 := f.pci(0, sw0+"/0000:02:00.0/0000:03:00.0")
	f.netdev("ens1f0", cx0, "400000")
	f.ibdev("mlx5_0", cx0, "400 Gb/sec (4X NDR)")
	// Socket 1: an InfiniBand HCA with no netdev, and a virtio NIC with link down.
	ib1 := f.pci(1, "pci0000:80/0000:80:01.0/0000:81:00.0")
	f.ibdev("mlx5_1", ib1, "200 Gb/sec (4X HDR)", "100 Gb/sec (2X HDR)")
	vio := f.pci(-1, "pci0000:00/0000:00:03.0")
	f.write(filepath.Join(vio, "virtio2", "vendor"), "0x1af4\n")
	f.netdev("eth0", filepath.Join(vio, "virtio2"), "-1")
	// Virtual interfaces are skipped.
	f.netdev("lo", "", "")
	f.netdev("docker0", "", "-1")

	nics, err := discoverNICs(f.root)
	require.NoError(t, err)
	require.Equal(t, []NIC{
		{Name: "ens1f0", PCIBusID: "0000:03:00.0", NUMANode: 0, RDMA: true, RDMADevices: []string{"mlx5_0"}, SpeedMbps: 400000,
			PCIPath: []string{"pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0"}},
		{Name: "eth0", PCIBusID: "0000:00:03.0", NUMANode: -1, PCIPath: []string{"pci0000:00"}},
		{Name: "mlx5_1", PCIBusID: "0000:81:00.0", NUMANode: 1, RDMA: true, RDMADevices: []string{"mlx5_1"}, SpeedMbps: 200000,
			PCIPath: []string{"pci0000:80", "0000:80:01.0"}},
	}, nics)
}

func TestDiscoverNICsEmptyRoot(t *testing.T) {
	nics, err := discoverNICs(t.TempDir())
	require.NoError(t, err)
	require.Empty(t, nics)
}

func TestDiscoverNICsUnreadableClassDir(t *testing.T) {
	f := newFakeSysfs(t)
	f.write(filepath.Join("class", "net"), "not a directory")
	_, err := discoverNICs(f.root)
	require.Error(t, err)

	_, err = Discover(context.Background(), WithSysfsRoot(f.root), nvmlAbsent(), WithLogger(slog.New(slog.DiscardHandler)))
	require.ErrorIs(t, err, ErrDiscovery)
}

func TestParseIBRate(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
		ok   bool
	}{
		{"400 Gb/sec (4X NDR)", 400000, true},
		{"25 Gb/sec (1X EDR)\n", 25000, true},
		{"2.5 Gb/sec (1X SDR)", 2500, true},
		{"", 0, false},
		{"fast", 0, false},
		{"100 Mb/sec", 0, false},
		{"-5 Gb/sec", 0, false},
	} {
		got, ok := parseIBRate(tc.in)
		require.Equal(t, tc.ok, ok, tc.in)
		require.Equal(t, tc.want, got, tc.in)
	}
}
