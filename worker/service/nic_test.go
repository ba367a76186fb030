package service

import (
	"bytes"
	"errors"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/topology"
	"github.com/handoff-io/handoff/rdma"
)

const nicTestGPU = "GPU-6a1f0e3c-1111-2222-3333-444455556666"

// nicTestHost is a GPU with two NICs: eth0, listed first, on the other
// socket, and ib0 under the GPU's PCIe switch.
func nicTestHost() topology.Host {
	return topology.Host{
		GPUs: []topology.GPU{{Index: 0, UUID: nicTestGPU, PCIBusID: "0000:03:00.0", NUMANode: 0, PCIPath: []string{"0000:00:01.0", "0000:01:00.0", "0000:02:00.0"}}},
		NICs: []topology.NIC{
			{Name: "eth0", PCIBusID: "0000:41:00.0", NUMANode: 1, SpeedMbps: 100000, PCIPath: []string{"0000:40:01.0"}},
			{Name: "ib0", PCIBusID: "0000:04:00.0", NUMANode: 0, SpeedMbps: 400000, PCIPath: []string{"0000:00:01.0", "0000:01:00.0", "0000:02:01.0"}},
		},
	}
}

func cidr(t *testing.T, s string) net.Addr {
	t.Helper()
	ip, n, err := net.ParseCIDR(s)
	require.NoError(t, err)
	n.IP = ip
	return n
}

func addrsFrom(addrs map[string][]net.Addr) func(string) ([]net.Addr, error) {
	return func(name string) ([]net.Addr, error) {
		if a, ok := addrs[name]; ok {
			return a, nil
		}
		return nil, errors.New("no such interface")
	}
}

// nicAdvertise advertises the NIC that shares the GPU's PCIe switch for a
// wildcard listener, and leaves any address the operator chose alone.
func TestNICAdvertise(t *testing.T) {
	host := nicTestHost()
	addrs := map[string][]net.Addr{
		"ib0":  {cidr(t, "fe80::1/64"), cidr(t, "2001:db8::5/64"), cidr(t, "192.168.7.2/24")},
		"eth0": {cidr(t, "10.0.0.9/8")},
	}
	addrsOf := addrsFrom(addrs)
	for _, c := range []struct {
		name, addr, advertise, uuid, want string
	}{
		{"unspecified port only", ":7400", "", nicTestGPU, "192.168.7.2:7400"},
		{"unspecified ip, ephemeral port", "0.0.0.0:0", "", nicTestGPU, "192.168.7.2:0"},
		{"unspecified ipv6", "[::]:7400", "", nicTestGPU, "192.168.7.2:7400"},
		{"host named", "10.0.0.9:7400", "", nicTestGPU, ""},
		{"advertised", ":7400", "pod:7400", nicTestGPU, "pod:7400"},
		{"unknown gpu", ":7400", "", "GPU-00000000-0000-0000-0000-000000000000", ""},
	} {
		got, why := nicAdvertise(c.addr, c.advertise, host, c.uuid, addrsOf)
		require.Equal(t, c.want, got, "%s (%s)", c.name, why)
		require.NotEmpty(t, why, c.name)
	}
	addrs["ib0"] = []net.Addr{cidr(t, "fe80::1/64"), cidr(t, "2001:db8::5/64")}
	got, _ := nicAdvertise(":7400", "", host, nicTestGPU, addrsOf)
	require.Equal(t, "[2001:db8::5]:7400", got, "IPv6 when the NIC has no IPv4")
	addrs["ib0"] = []net.Addr{cidr(t, "fe80::1/64")}
	got, why := nicAdvertise(":7400", "", host, nicTestGPU, addrsOf)
	require.Empty(t, got, "a link-local address only")
	require.Contains(t, why, "no unicast address")
}

// With the caches on a GPU, a wildcard --data-addr stays a wildcard
// listener: the engine advertises the GPU's NIC (with the port it got),
// and a peer that reaches the host through another interface (loopback
// here) still connects. A listen or advertised address the operator gave
// is honoured as given.
func TestGPUDataPathKeepsWildcardListener(t *testing.T) {
	addrsOf := addrsFrom(map[string][]net.Addr{"ib0": {cidr(t, "192.0.2.7/24")}})
	start := func(listen, advertise string) (rdma.Config, rdma.Descriptor, string) {
		t.Helper()
		var logs bytes.Buffer
		rc := rdma.Config{Agent: "w1", Transports: []rdma.Transport{rdma.TransportTCP}, TCPAddr: listen, Advertise: advertise,
			Logger: slog.New(slog.DiscardHandler)}
		gpuDataPath(&rc, nicTestHost(), nicTestGPU, addrsOf, slog.New(slog.NewTextHandler(&logs, nil)))
		require.Equal(t, listen, rc.TCPAddr, "the listen address is never moved")
		eng, err := rdma.New(rc)
		require.NoError(t, err)
		t.Cleanup(func() { _ = eng.Close() })
		return rc, eng.Descriptor(), logs.String()
	}

	rc, desc, logs := start("0.0.0.0:0", "")
	h, port, err := net.SplitHostPort(desc.TCPAddr)
	require.NoError(t, err)
	require.Equal(t, "192.0.2.7", h, "peers dial the GPU's NIC")
	require.NotEqual(t, "0", port, "with the port the listener got")
	require.Equal(t, "192.0.2.7:0", rc.Advertise)
	require.Contains(t, logs, "listen=0.0.0.0:0")
	require.Contains(t, logs, "advertise=192.0.2.7:0")
	c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", port), 5*time.Second)
	require.NoError(t, err, "the wildcard listener accepts on another interface")
	require.NoError(t, c.Close())

	_, desc, logs = start("127.0.0.1:0", "")
	require.Contains(t, desc.TCPAddr, "127.0.0.1:", "an explicit listen address is advertised as given")
	require.Contains(t, logs, "the listen address names its host")

	_, desc, _ = start("0.0.0.0:0", "pod.example:7400")
	require.Equal(t, "pod.example:7400", desc.TCPAddr, "an explicit advertised address is honoured")
}
