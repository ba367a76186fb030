package kvevents

import (
	"testing"

	"github.com/handoff-io/handoff/internal/purity"
)

const module = "github.com/handoff-io/handoff/"

// allowedImports: the pure pools' composition (for its events), the prefix
// names (SHA-256, which a pool may not reach but a router's index may),
// msgpack, and the standard library's pure parts.
var allowedImports = map[string]bool{
	"bytes": true, "errors": true, "fmt": true, "slices": true,
	module + "hybrid": true, module + "prefix": true, module + "internal/msgpackcheck": true,
	"github.com/vmihailenco/msgpack/v5": true, "github.com/vmihailenco/msgpack/v5/msgpcode": true,
}

// TestDeps keeps IO out: no network, process, slog or context, even
// transitively.
func TestDeps(t *testing.T) {
	purity.CheckImports(t, allowedImports, "net", "os/exec", "os/signal", "plugin", "runtime/cgo", "log/slog", "context")
}

func TestNoGoroutines(t *testing.T) { purity.CheckNoGoroutines(t) }
