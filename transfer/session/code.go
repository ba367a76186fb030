package session

import "fmt"

// Code is a failure class: the outcome the sessions decide and the peers
// exchange (package transfer puts it on the wire and maps each to its
// sentinel error). CodeOK means success. Codes are stable: they are part of
// the wire format.
type Code uint16

const (
	CodeOK Code = iota
	CodeNoPrefillWorker
	CodeTimeout
	CodePayloadTooLarge
	CodeLayoutMismatch
	CodeCapacityRefused
	CodePeerFailed
	CodeCancelled
	CodeDummyRequest
	CodeIntegrity
	CodePrefillFailed
	CodeBadMessage
	CodeClosed
	// NumCodes is the number of codes defined: every Code below it is known.
	NumCodes
)

var codeNames = [NumCodes]string{
	"ok", "no_prefill_worker", "timeout", "payload_too_large", "layout_mismatch",
	"capacity_refused", "peer_failed", "cancelled", "dummy_request", "integrity",
	"prefill_failed", "bad_message", "closed",
}

// String returns the code's stable lower-case name (used in logs, metrics and
// transcripts).
func (c Code) String() string {
	if c < NumCodes {
		return codeNames[c]
	}
	return fmt.Sprintf("code(%d)", uint16(c))
}

// Manifest is what a commit reports of the bytes written: per extent, in
// grant order, its length and crc32c. It has the shape of rdma.Manifest, which
// a driver converts to it (a struct conversion: no copy). It is declared
// here, not taken from rdma, because the session imports nothing but the
// standard library (TestDeps): the one Manifest on the wire and the data
// path is rdma's; this is the pure core's view of it.
type Manifest struct {
	Bytes []uint64
	CRC   []uint32
}
