//go:build !(linux && cgo && ucx)

package rdma

import (
	"context"
	"fmt"

	"github.com/handoff-io/handoff/internal/ucx"
)

// ucxSupported reports whether this build has the ucx transport: linux,
// cgo and -tags ucx (ucx_linux.go). Without it Config.validate refuses
// TransportUCX, so neither function below is reached.
const ucxSupported = false

type ucxServer struct {
	landings
	addr []byte
}

func startUCX(*Engine) (*ucxServer, error) {
	return nil, fmt.Errorf("%w: transport ucx: %w", ErrUnsupported, ucx.ErrUnavailable)
}

func (*ucxServer) close() {}

func dialUCX(context.Context, *Engine, Descriptor) (link, error) {
	return nil, fmt.Errorf("%w: transport ucx: %w", ErrUnsupported, ucx.ErrUnavailable)
}
