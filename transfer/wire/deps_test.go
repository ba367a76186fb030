package wire

import (
	"testing"

	"github.com/handoff-io/handoff/internal/purity"
)

// allowedImports is everything the package may import directly: the
// standard library's parts for encoding, msgpack, the data plane's
// vocabulary (rdma's Descriptor, Ticket, Manifest and Extent travel in the
// messages), session's Code, which replies and cancels carry, and
// msgpackcheck, which measures what the codecs skip.
var allowedImports = map[string]bool{
	"bytes": true, "encoding/binary": true, "errors": true, "fmt": true, "math": true,
	"reflect": true, "slices": true, "strings": true, "sync": true, "time": true, "unsafe": true,
	"github.com/vmihailenco/msgpack/v5":                   true,
	"github.com/handoff-io/handoff/rdma":                  true,
	"github.com/handoff-io/handoff/transfer/session":      true,
	"github.com/handoff-io/handoff/internal/msgpackcheck": true,
}

// TestDeps fails when the package imports something outside its allowlist
// or depends, through rdma or otherwise, on NATS, tracing or metrics: the
// messages are bytes, the drivers in package transfer send them. (rdma
// brings net, context and log/slog; the allowlist keeps them indirect.)
func TestDeps(t *testing.T) {
	purity.CheckImports(t, allowedImports, "github.com/nats-io", "go.opentelemetry.io", "github.com/prometheus")
}

// TestNoGoroutines fails when a non-test file of the package starts a
// goroutine: encoding and decoding happen on the caller's.
func TestNoGoroutines(t *testing.T) { purity.CheckNoGoroutines(t) }
