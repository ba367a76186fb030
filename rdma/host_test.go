package rdma

import (
	"net"
	"os"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Engines in one mount namespace may use shm; the identity names it, so
// containers that share only the kernel fall back to tcp.
func TestHostIdentityNamesMountNamespace(t *testing.T) {
	ns, err := os.Readlink("/proc/self/ns/mnt")
	if err != nil {
		t.Skipf("no mount namespace link here: %v", err)
	}
	id := hostIdentity()
	require.True(t, strings.HasSuffix(id, "/"+ns), "host identity %q lacks the mount namespace %q", id, ns)
	require.Equal(t, id, hostIdentity(), "host identity must be stable")
}

func TestDefaultAdvertise(t *testing.T) {
	loop := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 7400}
	require.Equal(t, "127.0.0.1:7400", defaultAdvertise(loop), "a concrete listener is advertised as is")
	wild := &net.TCPAddr{IP: net.IPv6unspecified, Port: 7400}
	got := defaultAdvertise(wild)
	h, _ := os.Hostname()
	if _, err := net.LookupHost(h); err == nil {
		require.Equal(t, net.JoinHostPort(h, "7400"), got)
	} else {
		require.Equal(t, wild.String(), got)
	}
}

// A configured address is advertised as given, except that its port 0
// (an ephemeral listener) is the listener's: peers cannot dial port 0.
func TestAdvertisedPortZero(t *testing.T) {
	ln := &net.TCPAddr{IP: net.IPv4zero, Port: 41234}
	require.Equal(t, "192.0.2.7:41234", advertised("192.0.2.7:0", ln))
	require.Equal(t, "[2001:db8::5]:41234", advertised("[2001:db8::5]:0", ln))
	require.Equal(t, "pod.example:7400", advertised("pod.example:7400", ln), "a port given is honoured")
	require.Equal(t, defaultAdvertise(ln), advertised("", ln))
}

// TCPListenAddr is the address the listener got (the kernel's port for
// ":0"), not the advertised one, and empty without tcp.
func TestTCPListenAddr(t *testing.T) {
	e, err := New(Config{Agent: "listen", Transports: []Transport{TransportTCP}, Advertise: "proxy.example:7400", Logger: quietLogger()})
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	require.Equal(t, "proxy.example:7400", e.Descriptor().TCPAddr)
	addr := e.TCPListenAddr()
	host, port, err := net.SplitHostPort(addr)
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1", host)
	require.NotEqual(t, "0", port)
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err, "the listen address must be dialable")
	c.Close()

	if runtime.GOOS == "linux" {
		shm, err := New(Config{Agent: "shm-only", Transports: []Transport{TransportSHM}, Logger: quietLogger()})
		require.NoError(t, err)
		defer func() { require.NoError(t, shm.Close()) }()
		require.Empty(t, shm.TCPListenAddr())
	}
}
