package mambacache

import (
	"testing"

	"github.com/handoff-io/handoff/internal/purity"
)

// allowedImports is everything the package may import directly: the
// standard library's pure parts, nothing that does IO, reads the clock or
// escapes the type system, and reqid, the pure leaf that says which
// request ids are reserved.
var allowedImports = map[string]bool{
	"errors": true, "fmt": true, "math": true, "math/bits": true, "sync": true,
	"strconv": true, "strings": true, // ParseDraftSchedule
	"github.com/handoff-io/handoff/internal/reqid": true,
}

// TestDeps fails when the package imports something outside the standard
// library or outside its allowlist.
func TestDeps(t *testing.T) { purity.CheckDeps(t, allowedImports) }

// TestNoGoroutines fails when a non-test file of the package starts a
// goroutine: the pool is a data structure, the caller owns concurrency.
func TestNoGoroutines(t *testing.T) { purity.CheckNoGoroutines(t) }
