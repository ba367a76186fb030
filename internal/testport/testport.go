//go:build unix

// Package testport hands tests loopback ports that nothing else can take
// between the moment a test learns the number and the moment its server
// binds it. A port picked by binding :0 and closing the listener is free
// only for a moment: any outgoing connection or other test may be given it
// before the server binds it ("address already in use"), and a server that
// a test stops and restarts on the same port leaves that window open for as
// long as it is down. Where a server can bind :0 itself and report its
// address, that is better still; Reserve is for the rest.
package testport

import (
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// Reserve returns a loopback port reserved until the test ends, for a
// server that must be told its port before it starts: an in-process NATS
// server, which a test may stop and start again on the same port (its
// clients know that URL), and whose cluster routes are configured before
// any node starts (JetStream clustering needs them); and a worker's data
// port behind a proxy, which the proxy forwards to.
//
// The reservation is a socket bound to 127.0.0.1:port with SO_REUSEADDR,
// not listening. Linux keeps a port so bound out of its ephemeral picks
// (an outgoing connection's local port, a bind to port 0) and refuses it to
// a bind without SO_REUSEADDR; a listener that sets SO_REUSEADDR, as every
// Go listener does, binds the same address while it is reserved. So the
// server gets the port whenever it starts, and nothing else is handed it
// while the server is down. The socket accepts nothing: a connection to the
// port while no server listens there is refused, as on a free port.
func Reserve(t testing.TB) int {
	t.Helper()
	// Close-on-exec before any child can be started with it.
	syscall.ForkLock.RLock()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err == nil {
		syscall.CloseOnExec(fd)
	}
	syscall.ForkLock.RUnlock()
	require.NoError(t, err, "reserve a port: socket")
	t.Cleanup(func() { _ = syscall.Close(fd) })
	require.NoError(t, syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1), "reserve a port: SO_REUSEADDR")
	require.NoError(t, syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}), "reserve a port: bind")
	sa, err := syscall.Getsockname(fd)
	require.NoError(t, err, "reserve a port: getsockname")
	return sa.(*syscall.SockaddrInet4).Port
}
