package rdma

import (
	"os"
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
