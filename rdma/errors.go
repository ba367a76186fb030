package rdma

import (
	"errors"
	"fmt"
)

// Sentinel errors. Every error the package returns wraps one of them, so
// callers test with errors.Is. A refusal reported by a remote receiver comes
// back as a *RemoteError that wraps the same sentinel.
var (
	// ErrClosed: any call on an Engine after Close.
	ErrClosed = errors.New("rdma: engine closed")
	// ErrUnknownGrant: a frame or commit names a grant the receiver does not have.
	ErrUnknownGrant = errors.New("rdma: unknown grant")
	// ErrBadToken: a frame or commit carries the wrong grant token.
	ErrBadToken = errors.New("rdma: bad grant token")
	// ErrStaleEpoch: a frame or commit carries an epoch the grant has moved past.
	ErrStaleEpoch = errors.New("rdma: stale grant epoch")
	// ErrOutOfRange: an extent lies outside its region, overflows, overlaps
	// another extent of the same grant, or source and destination lengths differ.
	ErrOutOfRange = errors.New("rdma: extent out of range")
	// ErrForbidden: OpenGrant over a range marked with Region.Forbid.
	ErrForbidden = errors.New("rdma: extent overlaps a forbidden range")
	// ErrRevoked: the grant was revoked (Grant.Revoke, Engine.Close).
	ErrRevoked = errors.New("rdma: grant revoked")
	// ErrDeadline: the grant's deadline passed before the commit.
	ErrDeadline = errors.New("rdma: grant deadline exceeded")
	// ErrManifestMismatch: the commit's manifest does not match what landed.
	ErrManifestMismatch = errors.New("rdma: commit manifest mismatch")
	// ErrMalformedFrame: a frame failed to decode; the connection is closed.
	ErrMalformedFrame = errors.New("rdma: malformed frame")
	// ErrPeerClosed: the peer closed the connection (or died) mid-request.
	ErrPeerClosed = errors.New("rdma: peer closed")
	// ErrStaleDescriptor: Connect, Write or OpenStream named a descriptor
	// of an older incarnation of an agent than the one this engine is
	// linked to (the agent restarted under the same id;
	// Descriptor.Incarnation). That incarnation is gone, and its grants
	// with it, so it wraps ErrPeerClosed: callers treat it as the peer's
	// failure. The live link is left alone.
	ErrStaleDescriptor = fmt.Errorf("%w: descriptor of an older incarnation", ErrPeerClosed)
	// ErrNoTransport: the two engines serve no transport in common, or none connected.
	ErrNoTransport = errors.New("rdma: no common transport")
	// ErrUnsupported: the operation is not available on this platform or transport.
	ErrUnsupported = errors.New("rdma: unsupported")
	// ErrBadRequestID: OpenGrant with request id 0 (the padding dummy is never transferred).
	ErrBadRequestID = errors.New("rdma: request id 0 cannot be granted")
	// ErrCommitted: a frame or commit for a grant that already completed.
	ErrCommitted = errors.New("rdma: grant already committed")
	// ErrWrongPeer: the agent reached at a descriptor's address is not the agent named by it.
	ErrWrongPeer = errors.New("rdma: reached the wrong agent")
	// ErrTooManyGrants: OpenGrant while MaxGrants grants are open.
	ErrTooManyGrants = errors.New("rdma: too many open grants")
	// ErrBusy: OpenGrant over bytes an open grant holds; a destination is
	// reusable only once its grant is Done.
	ErrBusy = errors.New("rdma: extent overlaps an open grant")
	// ErrQuarantined: a grant failed while a live writer was still inside a
	// copy into it (Grant.Quarantined); its destination is reusable only
	// once the grant is Done.
	ErrQuarantined = errors.New("rdma: a live writer is still copying into the grant")
)

// Status codes carried by reply frames. The numbering is part of the wire
// format: append only.
const (
	codeOK uint32 = iota
	codeUnknownGrant
	codeBadToken
	codeStaleEpoch
	codeOutOfRange
	codeForbidden
	codeRevoked
	codeDeadline
	codeManifestMismatch
	codeMalformed
	codePeerClosed
	codeClosed
	codeCommitted
	codeWrongPeer
	codeUnsupported
	codeBadRequestID
	codeTooManyGrants
	codeInternal
	codeBusy
	codeQuarantined
	numCodes
)

var codeSentinels = [numCodes]error{
	codeUnknownGrant:     ErrUnknownGrant,
	codeBadToken:         ErrBadToken,
	codeStaleEpoch:       ErrStaleEpoch,
	codeOutOfRange:       ErrOutOfRange,
	codeForbidden:        ErrForbidden,
	codeRevoked:          ErrRevoked,
	codeDeadline:         ErrDeadline,
	codeManifestMismatch: ErrManifestMismatch,
	codeMalformed:        ErrMalformedFrame,
	codePeerClosed:       ErrPeerClosed,
	codeClosed:           ErrClosed,
	codeCommitted:        ErrCommitted,
	codeWrongPeer:        ErrWrongPeer,
	codeUnsupported:      ErrUnsupported,
	codeBadRequestID:     ErrBadRequestID,
	codeTooManyGrants:    ErrTooManyGrants,
	codeBusy:             ErrBusy,
	codeQuarantined:      ErrQuarantined,
}

// codePriority orders the codes codeOf tries: an error can wrap several
// sentinels (a late frame is both stale and revoked), and the reply names
// the most telling one, the reason the grant ended.
var codePriority = [...]uint32{
	codeRevoked, codeClosed, codeDeadline, codeCommitted, codeQuarantined, codeManifestMismatch,
	codePeerClosed, codeMalformed, codeBadToken, codeUnknownGrant, codeForbidden,
	codeOutOfRange, codeStaleEpoch, codeWrongPeer, codeUnsupported, codeBadRequestID,
	codeTooManyGrants, codeBusy,
}

// codeOf maps an error to the status code sent in a reply frame.
func codeOf(err error) uint32 {
	if err == nil {
		return codeOK
	}
	for _, c := range codePriority {
		if errors.Is(err, codeSentinels[c]) {
			return c
		}
	}
	return codeInternal
}

// RemoteError is a refusal reported by the receiving engine. It wraps the
// sentinel named by Code, so errors.Is(err, ErrRevoked) works across processes.
type RemoteError struct {
	Agent AgentID // the receiver
	Code  uint32
	Msg   string // the receiver's own error text
}

func (e *RemoteError) Error() string {
	return fmt.Sprintf("rdma: peer %s refused: %s", e.Agent, e.Msg)
}

// Unwrap returns the sentinel for Code (nil for an unknown code).
func (e *RemoteError) Unwrap() error {
	if e.Code < numCodes {
		return codeSentinels[e.Code]
	}
	return nil
}
