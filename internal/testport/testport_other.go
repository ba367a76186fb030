//go:build !unix

package testport

import (
	"net"
	"testing"

	"github.com/stretchr/testify/require"
)

// Reserve returns a loopback port that was free a moment ago: without
// unix's SO_REUSEADDR semantics nothing holds it, so this is the racy pick
// Reserve avoids on unix.
func Reserve(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
