package reshard

import (
	"testing"

	"github.com/handoff-io/handoff/internal/purity"
)

// allowedImports is everything the package may import directly: pure
// standard-library packages and the two pure pool packages whose layouts it
// reshards; and reqid, the pure leaf of reserved request ids, which it
// reaches through mambacache.
var allowedImports = map[string]bool{
	"errors": true, "fmt": true, "iter": true, "math": true, "slices": true, "strings": true,
	"github.com/handoff-io/handoff/kvcache":        true,
	"github.com/handoff-io/handoff/mambacache":     true,
	"github.com/handoff-io/handoff/internal/reqid": true,
}

// TestDeps fails when the package imports something outside its allowlist.
func TestDeps(t *testing.T) { purity.CheckDeps(t, allowedImports) }

// TestNoGoroutines fails when a non-test file of the package starts a
// goroutine: the plan is data, the transfer owns concurrency.
func TestNoGoroutines(t *testing.T) { purity.CheckNoGoroutines(t) }
