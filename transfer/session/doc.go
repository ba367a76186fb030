// Package session is the per-request handoff protocol as two pure state
// machines, one per data-path role: RecvSession for the side that opens a
// grant and receives bytes (decode, for prefill-to-decode handoff),
// WriteSession for the side that writes into a grant (prefill). They do no IO,
// start no goroutines and read no clock (TestDeps and TestNoGoroutines hold
// them to it): a driver (package transfer's Decoder and Prefiller) feeds
// events, with the current time, and executes the returned actions in order,
// feeding each action's outcome back as an event.
//
// Invariants both machines keep:
//   - exactly one terminal action: ActDeliver or ActFail on the receiver,
//     one ActReply on the writer;
//   - every event after the terminal state is ignored (no actions), which
//     makes cleanup idempotent: late commits, duplicate replies and repeated
//     cancels change nothing;
//   - resources are released only when nothing can touch them any more: the
//     receiver fails only after revoking its grant (no byte lands after
//     Revoke), so its caller may free the destination it allocated once the
//     handoff ended; the writer releases only after its in-flight step
//     (prefill, write) returned.
package session
