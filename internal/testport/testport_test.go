//go:build unix

package testport

import (
	"fmt"
	"net"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// What tests rely on Reserve for: the port refuses connections
// while no server listens, a server binds it, and again after a stop; a
// bind without SO_REUSEADDR (not a Go listener's) is refused.
func TestReserve(t *testing.T) {
	port := Reserve(t)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	_, err := net.Dial("tcp", addr)
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	for range 2 { // a start and a restart
		ln, err := net.Listen("tcp", addr)
		require.NoError(t, err, "a server binds the reserved port")
		c, err := net.Dial("tcp", addr)
		require.NoError(t, err)
		c.Close()
		ln.Close()
	}
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	require.NoError(t, err)
	defer syscall.Close(fd)
	require.ErrorIs(t, syscall.Bind(fd, &syscall.SockaddrInet4{Port: port, Addr: [4]byte{127, 0, 0, 1}}), syscall.EADDRINUSE)
}
