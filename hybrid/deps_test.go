package hybrid

import (
	"testing"

	"github.com/handoff-io/handoff/internal/purity"
)

const module = "github.com/handoff-io/handoff/"

// allowedImports is everything the package may import directly: the two
// pure pools and the standard library's pure parts, nothing that does IO,
// reads the clock or escapes the type system; and reqid, the pure leaf of
// reserved request ids, which it reaches through mambacache.
var allowedImports = map[string]bool{
	"errors": true, "fmt": true, "sync": true,
	module + "kvcache": true, module + "mambacache": true, module + "internal/reqid": true,
}

// TestDeps fails when the package imports something outside the standard
// library and the two pools, or outside its allowlist.
func TestDeps(t *testing.T) { purity.CheckDeps(t, allowedImports) }

// TestNoGoroutines fails when a non-test file of the package starts a
// goroutine.
func TestNoGoroutines(t *testing.T) { purity.CheckNoGoroutines(t) }
