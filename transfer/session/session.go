package session

import (
	"fmt"
	"strings"
	"time"

	"github.com/handoff-io/handoff/internal/reqid"
)

// IsDummyID reports whether id can never be transferred: the ADP dummy id 0 or
// a CUDA-graph padding sentinel in [2^64-1-maxDraftTokens, 2^64-1]
// (reqid.IsDummy, the one definition).
func IsDummyID(id uint64, maxDraftTokens int) bool { return reqid.IsDummy(id, maxDraftTokens) }

// ActionKind names what a session asks its driver to do.
type ActionKind uint8

const (
	// Receiver actions.
	ActOpenGrant     ActionKind = iota + 1 // open the receive grant; feed EvGranted
	ActSendRequest                         // publish the prefill request (Instance: "" queue group, else that instance); feed EvSent on failure
	ActPublishCancel                       // tell the serving instance (Instance, "" all) to stop
	ActRevoke                              // revoke/close the grant; on return no byte lands
	ActDeliver                             // terminal success: hand the request to the scheduler
	ActFail                                // terminal failure with Code
	// Writer actions.
	ActAdmit   // admit within capacity or refuse; feed EvAdmitted
	ActPrefill // run prefill; feed EvPrefilled
	ActWrite   // write KV runs and the Mamba row, commit; feed EvWritten
	ActAbort   // interrupt the step in flight (cancel its context)
	ActRelease // free the admitted resources
	ActReply   // terminal: reply with Code (CodeOK carries the first token and manifest)
)

var actionNames = map[ActionKind]string{
	ActOpenGrant: "open-grant", ActSendRequest: "send-request",
	ActPublishCancel: "publish-cancel", ActRevoke: "revoke", ActDeliver: "deliver",
	ActFail: "fail", ActAdmit: "admit", ActPrefill: "prefill", ActWrite: "write", ActAbort: "abort",
	ActRelease: "release", ActReply: "reply",
}

func (k ActionKind) String() string {
	if s, ok := actionNames[k]; ok {
		return s
	}
	return fmt.Sprintf("action(%d)", uint8(k))
}

// Action is one step the driver must execute.
type Action struct {
	Kind     ActionKind
	Code     Code     // ActFail, ActReply, ActPublishCancel
	Instance string   // ActSendRequest, ActPublishCancel: target instance ("" = any / all)
	Attempt  int      // ActSendRequest: 1-based attempt number
	Exclude  []string // ActSendRequest: instances that refused this request
	// Live (ActSendRequest): address only a live instance not in Exclude, never
	// the queue group, which may still route to an instance reported dead but
	// only partitioned; when none is known the send fails with peer_failed.
	Live bool
}

func (a Action) String() string {
	var b strings.Builder
	b.WriteString(a.Kind.String())
	switch a.Kind {
	case ActFail, ActReply:
		fmt.Fprintf(&b, " code=%s", a.Code)
	case ActPublishCancel:
		fmt.Fprintf(&b, " to=%s code=%s", orAny(a.Instance), a.Code)
	case ActSendRequest:
		fmt.Fprintf(&b, " to=%s attempt=%d", orAny(a.Instance), a.Attempt)
		if len(a.Exclude) > 0 {
			fmt.Fprintf(&b, " exclude=%s", strings.Join(a.Exclude, ","))
		}
		if a.Live {
			b.WriteString(" live")
		}
	}
	return b.String()
}

func orAny(s string) string {
	if s == "" {
		return "*"
	}
	return s
}

// EventKind names an input of a session.
type EventKind uint8

const (
	// Receiver events.
	EvStart        EventKind = iota + 1 // begin the session
	EvGranted                           // outcome of ActOpenGrant (Code)
	EvSent                              // outcome of ActSendRequest: sent to Instance, or failed locally (Code) and nothing was sent
	EvNoResponders                      // nobody serves the subject
	EvReply                             // the prefill reply (Code, Instance, Manifest)
	EvCommitted                         // the grant's commit was accepted (Manifest)
	EvGrantFailed                       // the grant ended without a commit (Code)
	// Writer events.
	EvRequest  // a prefill request arrived
	EvAdmitted // outcome of ActAdmit (Code)
	EvPrefilled
	EvWritten // outcome of ActWrite (Code, Manifest)
	// Both.
	EvTick     // time passed (Now)
	EvCancel   // the caller or the peer cancelled (Code, default cancelled)
	EvPeerDied // Instance is gone (registry expiry, transport loss)
	// EvLost: a control connection dropped and came back (this side's, or
	// Instance's): a request or reply in flight may have been lost with it.
	EvLost
)

var eventNames = map[EventKind]string{
	EvStart: "start", EvGranted: "granted", EvSent: "sent",
	EvNoResponders: "no-responders", EvReply: "reply", EvCommitted: "committed",
	EvGrantFailed: "grant-failed", EvRequest: "request", EvAdmitted: "admitted",
	EvPrefilled: "prefilled", EvWritten: "written", EvTick: "tick", EvCancel: "cancel",
	EvPeerDied: "peer-died", EvLost: "lost",
}

func (k EventKind) String() string {
	if s, ok := eventNames[k]; ok {
		return s
	}
	return fmt.Sprintf("event(%d)", uint8(k))
}

// Event is one input of a session. Now is the driver's clock at the event.
type Event struct {
	Kind       EventKind
	Now        time.Time
	Code       Code
	Instance   string
	Manifest   Manifest
	Expected   []uint64 // EvGranted: bytes per granted extent, for the manifest check
	KVBytes    uint64   // EvPrefilled: source KV bytes
	MambaBytes uint64   // EvPrefilled: source Mamba bytes
	// Attempt is the attempt an EvReply or EvNoResponders answers, where the
	// driver knows it (0: unknown). An answer to an earlier attempt than the
	// last one sent is dropped: after a fenced retry, the no-responders of
	// the dead instance's attempt must not count against the new one.
	Attempt int
}

// State is a session's phase.
type State uint8

const (
	StateNew State = iota
	StateGranting
	StateWaiting
	StateAdmitting
	StatePrefilling
	StateWriting
	StateDone   // terminal success
	StateFailed // terminal failure
)

var stateNames = [...]string{"new", "granting", "waiting", "admitting", "prefilling", "writing", "done", "failed"}

func (s State) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return fmt.Sprintf("state(%d)", uint8(s))
}

// Terminal reports whether s is final.
func (s State) Terminal() bool { return s == StateDone || s == StateFailed }
