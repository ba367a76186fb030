package session

import (
	"testing"

	"github.com/handoff-io/handoff/internal/purity"
)

// allowedImports is everything the package may import directly: the
// standard library's pure parts, and reqid, the pure leaf that says which
// request ids are reserved. Time enters only as the values events carry;
// nothing reads the clock.
var allowedImports = map[string]bool{
	"fmt": true, "math": true, "slices": true, "strings": true, "time": true,
	"github.com/handoff-io/handoff/internal/reqid": true,
}

// TestDeps fails when the package imports something outside its allowlist:
// no NATS, no data plane, no IO.
func TestDeps(t *testing.T) { purity.CheckDeps(t, allowedImports) }

// TestNoGoroutines fails when a non-test file of the package starts a
// goroutine: the machines are stepped by their driver.
func TestNoGoroutines(t *testing.T) { purity.CheckNoGoroutines(t) }
