package agent

import (
	"errors"
	"fmt"

	"github.com/handoff-io/handoff/rdma"
)

// Sentinel errors. Every error the package returns wraps one of them (or an
// rdma sentinel, for failures of the data path), so callers test with
// errors.Is. The local API carries each as a code (Code) beside the message.
var (
	// ErrInvalidLayout: a register message whose layout is incomplete, does
	// not split over its TP size, or disagrees with the memory passed.
	ErrInvalidLayout = errors.New("agent: invalid layout")
	// ErrLayoutMismatch: a ticket from an agent whose layout fingerprint,
	// dtypes or TP size differ from this one's; the message names the peer.
	ErrLayoutMismatch = errors.New("agent: layout mismatch")
	// ErrNotRegistered: a grant or send before the engine registered its memory.
	ErrNotRegistered = errors.New("agent: memory not registered")
	// ErrRegistered: a second register on one connection.
	ErrRegistered = errors.New("agent: memory already registered")
	// ErrBadRequest: a malformed message, an unknown op, a block or row
	// outside the registered pools, or a count that does not match a ticket.
	ErrBadRequest = errors.New("agent: bad request")
	// ErrBadTicket: a ticket that does not decode.
	ErrBadTicket = errors.New("agent: bad ticket")
	// ErrReserved: a grant or send that names a row the engine declared
	// reserved; the data plane refuses it too (rdma.ErrForbidden).
	ErrReserved = errors.New("agent: reserved row")
	// ErrUnknown: a grant or send id this connection does not hold.
	ErrUnknown = errors.New("agent: unknown grant or send")
	// ErrPeerCred: a connection from another user (SO_PEERCRED).
	ErrPeerCred = errors.New("agent: peer is another user")
	// ErrUnsafeSocketDir: the socket directory is not private (0700, ours).
	ErrUnsafeSocketDir = errors.New("agent: socket directory is not private")
	// ErrSocketInUse: another agent answers on the socket's path (two
	// agents of one name).
	ErrSocketInUse = errors.New("agent: socket in use by a running agent")
	// ErrClosed: the agent or the connection is closed.
	ErrClosed = errors.New("agent: closed")
	// ErrCancelled: a send given up (OpCancel), or cut by the engine's
	// connection ending.
	ErrCancelled = errors.New("agent: send cancelled")
	// ErrPeerUnreachable: an offer that no agent of that name answered on NATS.
	ErrPeerUnreachable = errors.New("agent: peer agent unreachable")
	// ErrFrameTooLarge: a frame longer than MaxFrame.
	ErrFrameTooLarge = errors.New("agent: frame too large")
)

// codes names the sentinels on the wire. Append only: clients match on them.
var codes = []struct {
	code string
	err  error
}{
	{"invalid_layout", ErrInvalidLayout},
	{"layout_mismatch", ErrLayoutMismatch},
	{"not_registered", ErrNotRegistered},
	{"registered", ErrRegistered},
	{"bad_request", ErrBadRequest},
	{"bad_ticket", ErrBadTicket},
	{"reserved", ErrReserved},
	{"unknown", ErrUnknown},
	{"closed", ErrClosed},
	{"frame_too_large", ErrFrameTooLarge},
	{"peer_unreachable", ErrPeerUnreachable},
	{"cancelled", ErrCancelled},
	{"forbidden", rdma.ErrForbidden},
	{"revoked", rdma.ErrRevoked},
	{"deadline", rdma.ErrDeadline},
	{"busy", rdma.ErrBusy},
	{"out_of_range", rdma.ErrOutOfRange},
	{"stale_epoch", rdma.ErrStaleEpoch},
	{"unknown_grant", rdma.ErrUnknownGrant},
	{"manifest_mismatch", rdma.ErrManifestMismatch},
	{"peer_closed", rdma.ErrPeerClosed},
	{"no_transport", rdma.ErrNoTransport},
	{"committed", rdma.ErrCommitted},
	{"quarantined", rdma.ErrQuarantined},
	{"rdma_closed", rdma.ErrClosed},
	{"unsupported", rdma.ErrUnsupported},
}

// Code returns the wire code of err: the first sentinel it wraps, in the
// table's order, or "internal".
func Code(err error) string {
	for _, c := range codes {
		if errors.Is(err, c.err) {
			return c.code
		}
	}
	return "internal"
}

// RemoteError is a failure an agent reported over the local API: its code
// and message. Is matches the sentinel the code names.
type RemoteError struct {
	Code string
	Msg  string
}

func (e *RemoteError) Error() string { return fmt.Sprintf("%s (%s)", e.Msg, e.Code) }

// Is reports whether target is the sentinel e's code names.
func (e *RemoteError) Is(target error) bool {
	for _, c := range codes {
		if c.code == e.Code {
			return c.err == target
		}
	}
	return false
}
