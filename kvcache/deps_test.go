package kvcache

import (
	"testing"

	"github.com/handoff-io/handoff/internal/purity"
)

// allowedImports is everything the package may import directly: the
// standard library's pure parts, nothing that does IO, reads the clock or
// escapes the type system.
var allowedImports = map[string]bool{
	"errors": true, "fmt": true, "math": true, "math/bits": true, "slices": true, "sync": true,
}

// TestDeps fails when the package imports something outside the standard
// library or outside its allowlist.
func TestDeps(t *testing.T) { purity.CheckDeps(t, allowedImports) }

// TestNoGoroutines fails when a non-test file of the package starts a
// goroutine: the pool is a data structure, the caller owns concurrency.
func TestNoGoroutines(t *testing.T) { purity.CheckNoGoroutines(t) }
