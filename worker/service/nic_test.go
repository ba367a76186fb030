package service

import (
	"errors"
	"net"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/topology"
)

// nicAddr moves an unspecified listen address onto the NIC that shares the
// GPU's PCIe switch, and leaves any address the operator chose alone.
func TestNICAddr(t *testing.T) {
	const uuid = "GPU-6a1f0e3c-1111-2222-3333-444455556666"
	host := topology.Host{
		GPUs: []topology.GPU{{Index: 0, UUID: uuid, PCIBusID: "0000:03:00.0", NUMANode: 0, PCIPath: []string{"0000:00:01.0", "0000:01:00.0", "0000:02:00.0"}}},
		NICs: []topology.NIC{
			{Name: "eth0", PCIBusID: "0000:41:00.0", NUMANode: 1, SpeedMbps: 100000, PCIPath: []string{"0000:40:01.0"}},
			{Name: "ib0", PCIBusID: "0000:04:00.0", NUMANode: 0, SpeedMbps: 400000, PCIPath: []string{"0000:00:01.0", "0000:01:00.0", "0000:02:01.0"}},
		},
	}
	cidr := func(s string) net.Addr {
		ip, n, err := net.ParseCIDR(s)
		require.NoError(t, err)
		n.IP = ip
		return n
	}
	addrs := map[string][]net.Addr{
		"ib0":  {cidr("fe80::1/64"), cidr("2001:db8::5/64"), cidr("192.168.7.2/24")},
		"eth0": {cidr("10.0.0.9/8")},
	}
	addrsOf := func(name string) ([]net.Addr, error) {
		if a, ok := addrs[name]; ok {
			return a, nil
		}
		return nil, errors.New("no such interface")
	}
	for _, c := range []struct {
		name, addr, advertise, uuid, want string
	}{
		{"unspecified port only", ":7400", "", uuid, "192.168.7.2:7400"},
		{"unspecified ip", "0.0.0.0:0", "", uuid, "192.168.7.2:0"},
		{"unspecified ipv6", "[::]:7400", "", uuid, "192.168.7.2:7400"},
		{"host named", "10.0.0.9:7400", "", uuid, "10.0.0.9:7400"},
		{"advertised", ":7400", "pod:7400", uuid, ":7400"},
		{"unknown gpu", ":7400", "", "GPU-00000000-0000-0000-0000-000000000000", ":7400"},
	} {
		got, why := nicAddr(c.addr, c.advertise, host, c.uuid, addrsOf)
		require.Equal(t, c.want, got, "%s (%s)", c.name, why)
		require.NotEmpty(t, why, c.name)
	}
	addrs["ib0"] = []net.Addr{cidr("fe80::1/64"), cidr("2001:db8::5/64")}
	got, _ := nicAddr(":7400", "", host, uuid, addrsOf)
	require.Equal(t, "[2001:db8::5]:7400", got, "IPv6 when the NIC has no IPv4")
	addrs["ib0"] = []net.Addr{cidr("fe80::1/64")}
	got, why := nicAddr(":7400", "", host, uuid, addrsOf)
	require.Equal(t, ":7400", got, "a link-local address only")
	require.Contains(t, why, "no unicast address")
}
