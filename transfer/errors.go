package transfer

import (
	"errors"
	"fmt"

	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/transfer/wire"
)

// Sentinel errors. Every error a Decoder or Prefiller returns wraps exactly one
// of them (with %w), so callers classify failures with errors.Is. Refusals that
// arrive over the wire are RemoteErrors, which match the same sentinels.
var (
	// ErrNoPrefillWorker: no prefill worker subscribes to the subject (NATS no
	// responders). Returned by Decoder.Handoff; safe to retry later.
	ErrNoPrefillWorker = errors.New("transfer: no prefill worker")
	// ErrTimeout: the request's deadline passed before the handoff completed.
	ErrTimeout = errors.New("transfer: deadline exceeded")
	// ErrPayloadTooLarge: an encoded control message exceeds the server's max
	// payload. Checked before publishing; nothing was sent.
	ErrPayloadTooLarge = wire.ErrPayloadTooLarge
	// ErrLayoutMismatch: the peers' cache layouts differ (fingerprint or byte
	// counts). Refused before any byte moves.
	ErrLayoutMismatch = errors.New("transfer: cache layout mismatch")
	// ErrCapacityRefused: the prefill worker has no room for the request now.
	// Refused before any byte moves; safe to retry on another worker.
	ErrCapacityRefused = errors.New("transfer: capacity refused")
	// ErrTooLong: the request can never run on the prefill workers that
	// answered: its prompt and new tokens exceed what their pools hold. A
	// PrefillExecutor wraps it, with ErrCapacityRefused, for such a request;
	// Handoff's error matches it, with ErrCapacityRefused, when every
	// refusal said so. Not worth retrying as it is.
	ErrTooLong = errors.New("transfer: request too long for the pools")
	// ErrPeerFailed: the peer died, its data path failed, or it replied with a
	// failure after the request was admitted.
	ErrPeerFailed = errors.New("transfer: peer failed")
	// ErrCancelled: the request was cancelled (caller's context or a cancel
	// message from the peer).
	ErrCancelled = errors.New("transfer: cancelled")
	// ErrDummyRequest: the request id is a dummy (0, a padding sentinel) or a
	// reserved row was named. Dummies are never transferred.
	ErrDummyRequest = errors.New("transfer: dummy request cannot be transferred")
	// ErrIntegrity: the reply's manifest and the committed manifest disagree, or
	// the committed byte counts are not the granted ones.
	ErrIntegrity = errors.New("transfer: manifest mismatch")
	// ErrPrefillFailed: the prefill executor returned an error.
	ErrPrefillFailed = errors.New("transfer: prefill failed")
	// ErrBadMessage: a control message could not be decoded, has an unknown
	// version or is inconsistent.
	ErrBadMessage = wire.ErrBadMessage
	// ErrClosed: the Decoder or Prefiller was shut down.
	ErrClosed = errors.New("transfer: closed")
	// ErrInvalidConfig: a Config failed validation.
	ErrInvalidConfig = errors.New("transfer: invalid config")
)

// QuarantinedError is the error of a handoff that failed while a live
// writer was still inside a copy into its destination and could not be
// fenced in time (a stopped or frozen prefill process; rdma.Grant.Quarantined).
// The caller must keep the destination (its KV blocks and Mamba row) out of
// every pool until Released is closed: the copy ended or the writer exited.
// It wraps the handoff's failure.
type QuarantinedError struct {
	Err      error
	released <-chan struct{}
}

func (e *QuarantinedError) Error() string {
	return e.Err.Error() + " (destination quarantined until the writer's copy ends)"
}

func (e *QuarantinedError) Unwrap() error { return e.Err }

// Released is closed once no byte can land in the destination any more.
func (e *QuarantinedError) Released() <-chan struct{} { return e.released }

// codeErrors is the sentinel of each failure class: a session.Code, which
// the sessions decide and replies and cancels carry.
var codeErrors = [session.NumCodes]error{
	session.CodeOK:              nil,
	session.CodeNoPrefillWorker: ErrNoPrefillWorker,
	session.CodeTimeout:         ErrTimeout,
	session.CodePayloadTooLarge: ErrPayloadTooLarge,
	session.CodeLayoutMismatch:  ErrLayoutMismatch,
	session.CodeCapacityRefused: ErrCapacityRefused,
	session.CodePeerFailed:      ErrPeerFailed,
	session.CodeCancelled:       ErrCancelled,
	session.CodeDummyRequest:    ErrDummyRequest,
	session.CodeIntegrity:       ErrIntegrity,
	session.CodePrefillFailed:   ErrPrefillFailed,
	session.CodeBadMessage:      ErrBadMessage,
	session.CodeClosed:          ErrClosed,
}

// codeErr returns the sentinel of c (nil for CodeOK, ErrBadMessage for
// unknown codes).
func codeErr(c session.Code) error {
	if c < session.NumCodes {
		return codeErrors[c]
	}
	return ErrBadMessage
}

// codeOf classifies err: the code of the first sentinel it matches, CodeOK for
// nil, CodePeerFailed for anything unclassified.
func codeOf(err error) session.Code {
	if err == nil {
		return session.CodeOK
	}
	var re *RemoteError
	if errors.As(err, &re) {
		return re.Code
	}
	for c := session.Code(1); c < session.NumCodes; c++ {
		if errors.Is(err, codeErrors[c]) {
			return c
		}
	}
	return session.CodePeerFailed
}

// RemoteError is a failure reported by the peer over the control plane. Its Is
// matches the sentinel of its code, so errors.Is(err, ErrCapacityRefused) holds
// for a remote capacity refusal.
type RemoteError struct {
	Code     session.Code
	Msg      string
	Instance string // the peer instance that reported it, when known
	// TooLong: a capacity refusal of a request too long for the peer's
	// pools (wire.PrefillReply.TooLong); the error then matches ErrTooLong.
	TooLong bool
}

func (e *RemoteError) Error() string {
	if e.Instance != "" {
		return fmt.Sprintf("transfer: remote %s (%s): %s", e.Code, e.Instance, e.Msg)
	}
	return fmt.Sprintf("transfer: remote %s: %s", e.Code, e.Msg)
}

// Is reports whether target is the sentinel of e's code, or ErrTooLong for
// a refusal that said so.
func (e *RemoteError) Is(target error) bool {
	if target == ErrTooLong {
		return e.TooLong && e.Code == session.CodeCapacityRefused
	}
	s := codeErr(e.Code)
	return s != nil && s == target
}
