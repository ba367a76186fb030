package topology

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestNormalizePCIBusID(t *testing.T) {
	for _, tc := range []struct {
		in, want string
		err      bool
	}{
		{in: "00000000:17:00.0", want: "0000:17:00.0"}, // NVML's 8-digit domain
		{in: "0000:17:00.0", want: "0000:17:00.0"},     // sysfs
		{in: "00000000:DB:00.0", want: "0000:db:00.0"}, // upper case hex
		{in: "17:00.0", want: "0000:17:00.0"},          // no domain
		{in: "0001:0a:1f.7", want: "0001:0a:1f.7"},     // highest device and function
		{in: " 0000:17:00.0\n", want: "0000:17:00.0"},  // surrounding space
		{in: "1:2:3.4", want: "0001:02:03.4"},          // unpadded
		{in: "", err: true},
		{in: "0000:17:00", err: true},        // no function
		{in: "0000:17:20.0", err: true},      // device > 0x1f
		{in: "0000:17:00.8", err: true},      // function > 7
		{in: "0000:117:00.0", err: true},     // bus too wide
		{in: "000010000:17:00.0", err: true}, // domain too wide
		{in: "00010000:17:00.0", err: true},  // domain > 16 bits
		{in: "0000:zz:00.0", err: true},      // not hex
		{in: "0000:17:00.0:1", err: true},    // too many fields
		{in: "0000:-1:00.0", err: true},      // sign
		{in: "0000:17:00.+1", err: true},     // sign
		{in: "0000:17:.0", err: true},        // empty device
	} {
		got, err := NormalizePCIBusID(tc.in)
		if tc.err {
			require.ErrorIs(t, err, ErrBadPCIBusID, "%q", tc.in)
			continue
		}
		require.NoError(t, err, "%q", tc.in)
		require.Equal(t, tc.want, got, "%q", tc.in)
	}
}

func FuzzNormalizePCIBusID(f *testing.F) {
	for _, s := range []string{"00000000:17:00.0", "0000:db:00.0", "17:00.0", "1:2:3.4", "x", "0000:17:00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, err := NormalizePCIBusID(s)
		if err != nil {
			require.ErrorIs(t, err, ErrBadPCIBusID)
			return
		}
		require.True(t, pciBDFRe.MatchString(got), "%q -> %q", s, got)
		again, err := NormalizePCIBusID(got)
		require.NoError(t, err)
		require.Equal(t, got, again, "idempotent")
	})
}

func TestPCILevel(t *testing.T) {
	root0 := []string{"pci0000:00"}
	sw := []string{"pci0000:00", "0000:00:01.0", "0000:01:00.0"}
	for _, tc := range []struct {
		name         string
		a, b         []string
		numaA, numaB int
		want         LinkLevel
	}{
		{"same switch", append(sw, "0000:02:00.0"), append(sw, "0000:02:01.0"), 0, 0, LevelPIX},
		{"same root port, direct", []string{"pci0000:00", "0000:00:01.0"}, []string{"pci0000:00", "0000:00:01.0"}, 0, 0, LevelPIX},
		{"two switch levels", append(sw, "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"), append(sw, "0000:02:01.0"), 0, 0, LevelPXB},
		{"same root complex", append(root0, "0000:00:01.0"), append(root0, "0000:00:02.0"), 0, 0, LevelPHB},
		{"other root complex, same node", []string{"pci0000:00", "0000:00:01.0"}, []string{"pci0000:40", "0000:40:01.0"}, 0, 0, LevelNode},
		{"other root complex, other node", []string{"pci0000:00"}, []string{"pci0000:80"}, 0, 1, LevelSys},
		{"other root complex, single-node kernel", []string{"pci0000:00"}, []string{"pci0000:80"}, -1, -1, LevelNode},
		{"other root complex, one node unknown", []string{"pci0000:00"}, []string{"pci0000:80"}, 0, -1, LevelUnknown},
		{"no paths, same node", nil, nil, 1, 1, LevelNode},
		{"no paths, other node", nil, []string{"pci0000:00"}, 0, 1, LevelSys},
		{"no paths, nothing known", nil, nil, -1, -1, LevelUnknown},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, PCILevel(tc.a, tc.b, tc.numaA, tc.numaB))
			require.Equal(t, tc.want, PCILevel(tc.b, tc.a, tc.numaB, tc.numaA), "symmetric")
		})
	}
}

func TestLinkLevelText(t *testing.T) {
	for l := LevelUnknown; l <= LevelSys; l++ {
		b, err := l.MarshalText()
		require.NoError(t, err)
		var back LinkLevel
		require.NoError(t, back.UnmarshalText(b))
		require.Equal(t, l, back)
	}
	var l LinkLevel
	require.Error(t, l.UnmarshalText([]byte("nvlink")))
	require.Equal(t, "level(9)", LinkLevel(9).String())
	require.Greater(t, LevelUnknown.rank(), LevelSys.rank(), "unknown ranks farthest")
}

// hgx is a two-socket board: GPU 0 shares a switch with mlx5_0, GPU 1 sits
// on socket 1 with mlx5_1, and eth0 is a slow management NIC.
func hgx() Host {
	sw0 := []string{"pci0000:15", "0000:15:01.0", "0000:16:00.0"}
	sw1 := []string{"pci0000:97", "0000:97:01.0", "0000:98:00.0"}
	return Host{
		GPUs: []GPU{
			{Index: 0, Name: "H200", NUMANode: 0, MemoryBytes: 141 << 30, NVLinks: 18, PCIPath: append(sw0[:3:3], "0000:17:00.0")},
			{Index: 1, Name: "H200", NUMANode: 1, MemoryBytes: 141 << 30, NVLinks: 18, PCIPath: append(sw1[:3:3], "0000:99:00.0")},
			{Index: 2, Name: "L4", NUMANode: -1, MemoryBytes: 24 << 30},
		},
		NICs: []NIC{
			{Name: "eth0", NUMANode: 0, SpeedMbps: 1000, PCIPath: []string{"pci0000:00", "0000:00:1c.0"}},
			{Name: "mlx5_0", NUMANode: 0, RDMA: true, SpeedMbps: 400000, PCIPath: append(sw0[:3:3], "0000:17:01.0")},
			{Name: "mlx5_1", NUMANode: 1, RDMA: true, SpeedMbps: 400000, PCIPath: append(sw1[:3:3], "0000:99:01.0")},
			{Name: "roce0", NUMANode: 0, RDMA: true, SpeedMbps: 100000, PCIPath: []string{"pci0000:40", "0000:40:01.0"}},
		},
	}
}

func nicOrder(as []NICAffinity) []string {
	var out []string
	for _, a := range as {
		out = append(out, a.NIC.Name+"/"+a.Level.String())
	}
	return out
}

func TestNICsFor(t *testing.T) {
	topo := hgx()
	for _, tc := range []struct {
		gpu  int
		want []string
	}{
		// Same switch first; then same node, RDMA before not (roce0 before eth0); other socket last.
		{0, []string{"mlx5_0/pix", "roce0/node", "eth0/node", "mlx5_1/sys"}},
		{1, []string{"mlx5_1/pix", "mlx5_0/sys", "roce0/sys", "eth0/sys"}},
		// Nothing known about GPU 2: all unknown, so RDMA, speed, name decide.
		{2, []string{"mlx5_0/unknown", "mlx5_1/unknown", "roce0/unknown", "eth0/unknown"}},
		{9, nil},
	} {
		require.Equal(t, tc.want, nicOrder(topo.NICsFor(tc.gpu)), "gpu %d", tc.gpu)
	}
	require.Nil(t, Host{}.NICsFor(0))
	require.Empty(t, Host{GPUs: []GPU{{Index: 0}}}.NICsFor(0))
}

func TestBestNIC(t *testing.T) {
	topo := hgx()
	a, ok := topo.BestNIC(0, true)
	require.True(t, ok)
	require.Equal(t, "mlx5_0", a.NIC.Name)

	noRDMA := Host{GPUs: topo.GPUs, NICs: topo.NICs[:1]}
	_, ok = noRDMA.BestNIC(0, true)
	require.False(t, ok)
	a, ok = noRDMA.BestNIC(0, false)
	require.True(t, ok)
	require.Equal(t, "eth0", a.NIC.Name)
	_, ok = topo.BestNIC(42, false)
	require.False(t, ok)

	require.Len(t, topo.RDMANICs(), 3)
}

func TestSummary(t *testing.T) {
	require.Equal(t, "0 GPUs, 0 NICs", Host{}.Summary())
	require.Equal(t, "0 GPUs, 1 NIC (eth0 numa0)", Host{NICs: []NIC{{Name: "eth0", NUMANode: 0}}}.Summary())
	got := hgx().Summary()
	require.Equal(t, "3 GPUs (2x H200 141GiB nvlink18, 1x L4 24GiB), "+
		"4 NICs (eth0 1000Mb/s numa0, mlx5_0 400000Mb/s numa0 rdma, mlx5_1 400000Mb/s numa1 rdma, roce0 100000Mb/s numa0 rdma), "+
		"gpu->nic 0:mlx5_0/pix 1:mlx5_1/pix 2:mlx5_0/unknown", got)
	require.NotContains(t, got, "\n")
}

func TestHostJSON(t *testing.T) {
	topo := hgx()
	topo.GPUs[0].Peers = []GPUPeer{{Index: 1, Level: LevelSys, P2PRead: P2POK, P2PWrite: P2POK, P2PNVLink: P2POK}}
	b, err := json.Marshal(topo)
	require.NoError(t, err)
	require.True(t, strings.Contains(string(b), `"level":"sys"`), string(b))
	var back Host
	require.NoError(t, json.Unmarshal(b, &back))
	require.Equal(t, topo, back)
}
