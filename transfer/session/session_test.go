package session

import (
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var update = flag.Bool("update", false, "rewrite testdata golden transcripts")

// golden compares got with testdata/name.txt, or rewrites it under -update.
func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".txt")
	if *update {
		require.NoError(t, os.WriteFile(path, []byte(got), 0o644))
		return
	}
	want, err := os.ReadFile(path)
	require.NoError(t, err, "missing golden file; run go test -run %s -update", t.Name())
	require.Equal(t, string(want), got, "transcript differs from %s (run with -update if intended)", path)
}

type stepper interface {
	Step(Event) []Action
	State() State
	Code() Code
}

// at is one scripted event, dt after the session's epoch.
type at struct {
	dt time.Duration
	ev Event
}

var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func renderEvent(ev Event) string {
	var b strings.Builder
	b.WriteString(ev.Kind.String())
	if ev.Code != CodeOK {
		fmt.Fprintf(&b, " code=%s", ev.Code)
	}
	if ev.Instance != "" {
		fmt.Fprintf(&b, " inst=%s", ev.Instance)
	}
	if ev.Manifest.Bytes != nil {
		fmt.Fprintf(&b, " manifest=%v/%v", ev.Manifest.Bytes, ev.Manifest.CRC)
	}
	if ev.Expected != nil {
		fmt.Fprintf(&b, " expected=%v", ev.Expected)
	}
	if ev.Kind == EvPrefilled && ev.Code == CodeOK {
		fmt.Fprintf(&b, " kv=%d mamba=%d", ev.KVBytes, ev.MambaBytes)
	}
	return b.String()
}

// transcript runs script against s and renders every event with the actions
// it produced, then the final state. It also checks the machine's invariants:
// exactly one terminal action, nothing after it, no terminal action while a
// grant is open (the caller frees the destination once the handoff ended)
// and releases only when no step is in flight.
func transcript(t *testing.T, header string, s stepper, script []at) string {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "# %s\n", header)
	terminals := 0
	grantOpen, inFlight := false, false
	for _, st := range script {
		st.ev.Now = epoch.Add(st.dt)
		before := s.State()
		if st.ev.Kind == EvGranted && st.ev.Code == CodeOK && before == StateGranting {
			grantOpen = true
		}
		acts := s.Step(st.ev)
		parts := make([]string, len(acts))
		for i, a := range acts {
			parts[i] = a.String()
			switch a.Kind {
			case ActDeliver, ActFail, ActReply:
				require.False(t, grantOpen, "terminal action before the grant was revoked")
				terminals++
			case ActRevoke:
				grantOpen = false
			case ActPrefill, ActWrite, ActAdmit:
				inFlight = true
			case ActRelease:
				require.False(t, inFlight && st.ev.Kind != EvPrefilled && st.ev.Kind != EvWritten && st.ev.Kind != EvAdmitted,
					"release while a step is in flight")
			}
		}
		if st.ev.Kind == EvPrefilled || st.ev.Kind == EvWritten || st.ev.Kind == EvAdmitted {
			inFlight = false
		}
		out := strings.Join(parts, "; ")
		if len(acts) == 0 {
			out = "-"
			if before.Terminal() {
				out = "- (ignored: terminal)"
			}
		}
		fmt.Fprintf(&b, "+%-6s %-40s -> %s\n", st.dt, renderEvent(st.ev), out)
		if before.Terminal() {
			require.Empty(t, acts, "actions after the terminal state")
		}
	}
	fmt.Fprintf(&b, "= state=%s code=%s\n", s.State(), s.Code())
	require.LessOrEqual(t, terminals, 1, "more than one terminal action")
	if s.State().Terminal() {
		require.Equal(t, 1, terminals, "terminal state without a terminal action")
	}
	return b.String()
}

func ms(n int) time.Duration { return time.Duration(n) * time.Millisecond }

var (
	okManifest  = Manifest{Bytes: []uint64{4096, 512}, CRC: []uint32{0xaaaa, 0xbbbb}}
	badManifest = Manifest{Bytes: []uint64{4096, 512}, CRC: []uint32{0xaaaa, 0xcccc}}
	expected    = []uint64{4096, 512}
)

// recvPrefix is the happy opening of a receiver session up to the request sent.
func recvPrefix() []at {
	return []at{
		{0, Event{Kind: EvStart}},
		{ms(1), Event{Kind: EvGranted, Expected: expected}},
		{ms(1), Event{Kind: EvSent}},
	}
}

// The queue group has no responder for a while (workers restarting): the
// request is sent again with a backoff for up to QuietWait.
func TestRecvSessionQuietGolden(t *testing.T) {
	deadline := epoch.Add(5 * time.Second)
	cases := []struct {
		name   string
		script []at
	}{
		{"quiet_then_served", append(recvPrefix(),
			at{ms(2), Event{Kind: EvNoResponders}},
			at{ms(40), Event{Kind: EvTick}},
			at{ms(52), Event{Kind: EvTick}},
			at{ms(52), Event{Kind: EvSent}},
			at{ms(53), Event{Kind: EvNoResponders, Attempt: 2}},
			at{ms(153), Event{Kind: EvTick}},
			at{ms(153), Event{Kind: EvSent}},
			at{ms(160), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(161), Event{Kind: EvReply, Instance: "p1", Manifest: okManifest, Attempt: 3}},
		)},
		// The worker died after its commit and before its reply: it is
		// awaited for a second, then the request fails.
		{"peer_gone_after_commit_no_reply", append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(5), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(6), Event{Kind: EvPeerDied, Instance: "p1"}},
			at{ms(500), Event{Kind: EvTick}},
			at{ms(1006), Event{Kind: EvTick}},
		)},
		{"quiet_past_wait", append(recvPrefix(),
			at{ms(2), Event{Kind: EvNoResponders}},
			at{ms(52), Event{Kind: EvTick}},
			at{ms(52), Event{Kind: EvSent}},
			at{ms(53), Event{Kind: EvNoResponders}},
			at{ms(153), Event{Kind: EvTick}},
			at{ms(153), Event{Kind: EvSent}},
			at{ms(154), Event{Kind: EvNoResponders}},
		)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := NewRecvSession(RecvParams{RequestID: 7, Deadline: deadline, MaxAttempts: 3, QuietWait: 300 * time.Millisecond})
			header := fmt.Sprintf("recv %s: request 7, deadline +5s, 3 attempts, quiet wait 300ms", tc.name)
			golden(t, "recv_"+tc.name, transcript(t, header, s, tc.script))
		})
	}
}

func TestRecvSessionGolden(t *testing.T) {
	deadline := epoch.Add(100 * time.Millisecond)
	cases := []struct {
		name   string
		id     uint64
		script []at
	}{
		{"happy", 7, append(recvPrefix(),
			at{ms(5), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(6), Event{Kind: EvReply, Instance: "p1", Manifest: okManifest}},
		)},
		{"reply_before_commit", 7, append(recvPrefix(),
			at{ms(5), Event{Kind: EvReply, Instance: "p1", Manifest: okManifest}},
			at{ms(6), Event{Kind: EvCommitted, Manifest: okManifest}},
		)},
		{"late_commit_after_timeout", 7, append(recvPrefix(),
			at{ms(50), Event{Kind: EvTick}},
			at{ms(100), Event{Kind: EvTick}},
			at{ms(101), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(102), Event{Kind: EvReply, Instance: "p1", Manifest: okManifest}},
		)},
		{"cancel_during_write", 7, append(recvPrefix(),
			at{ms(10), Event{Kind: EvCancel}},
			at{ms(11), Event{Kind: EvGrantFailed, Code: CodeCancelled}},
			at{ms(12), Event{Kind: EvReply, Code: CodeCancelled, Instance: "p1"}},
			at{ms(13), Event{Kind: EvCancel}},
		)},
		{"duplicate_reply", 7, append(recvPrefix(),
			at{ms(5), Event{Kind: EvReply, Instance: "p1", Manifest: okManifest}},
			at{ms(5), Event{Kind: EvReply, Instance: "p1", Manifest: okManifest}},
			at{ms(6), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(7), Event{Kind: EvReply, Instance: "p1", Manifest: okManifest}},
		)},
		{"duplicate_commit_and_failure_reply", 7, append(recvPrefix(),
			at{ms(5), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(5), Event{Kind: EvCommitted, Manifest: badManifest}},
			at{ms(6), Event{Kind: EvReply, Code: CodePrefillFailed, Instance: "p1"}},
		)},
		{"manifest_mismatch", 7, append(recvPrefix(),
			at{ms(5), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(6), Event{Kind: EvReply, Instance: "p1", Manifest: badManifest}},
		)},
		{"no_responders_retry_exhausted", 7, append(recvPrefix(),
			at{ms(2), Event{Kind: EvNoResponders}},
			at{ms(2), Event{Kind: EvSent}},
			at{ms(3), Event{Kind: EvNoResponders}},
			at{ms(3), Event{Kind: EvSent}},
			at{ms(4), Event{Kind: EvNoResponders}},
		)},
		// A direct request nobody answers: that instance is gone (its
		// registry entry not yet expired); the retry must not pick it again.
		{"no_responders_direct_excluded", 7, append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(2), Event{Kind: EvNoResponders}},
			at{ms(2), Event{Kind: EvSent, Instance: "p2"}},
			at{ms(8), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(9), Event{Kind: EvReply, Instance: "p2", Manifest: okManifest}},
		)},
		{"capacity_refused_then_served", 7, append(recvPrefix(),
			at{ms(2), Event{Kind: EvReply, Code: CodeCapacityRefused, Instance: "p1"}},
			at{ms(2), Event{Kind: EvSent, Instance: "p2"}},
			at{ms(8), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(9), Event{Kind: EvReply, Instance: "p2", Manifest: okManifest}},
		)},
		{"capacity_refused_past_deadline", 7, append(recvPrefix(),
			at{ms(100), Event{Kind: EvReply, Code: CodeCapacityRefused, Instance: "p1"}},
		)},
		{"layout_mismatch_refused", 7, append(recvPrefix(),
			at{ms(2), Event{Kind: EvReply, Code: CodeLayoutMismatch, Instance: "p1"}},
		)},
		{"peer_death_and_cancel_while_granting", 7, []at{
			{0, Event{Kind: EvStart}},
			{ms(1), Event{Kind: EvPeerDied, Instance: "p1"}},
			{ms(1), Event{Kind: EvCancel, Code: CodeClosed}},
			{ms(2), Event{Kind: EvGranted, Expected: expected}},
		}},
		{"peer_death_while_granting", 7, []at{
			{0, Event{Kind: EvStart}},
			{ms(1), Event{Kind: EvTick}},
			{ms(100), Event{Kind: EvTick}},
			{ms(101), Event{Kind: EvGranted, Expected: expected}},
		}},
		// The addressed instance dies before any commit: the grant is revoked
		// (fencing its late writes), a fresh one opened, and the next attempt
		// goes to a live instance; the last attempt's death fails.
		{"peer_death_waiting_targeted", 7, append(recvPrefix(),
			at{ms(2), Event{Kind: EvReply, Code: CodeCapacityRefused, Instance: "p1"}},
			at{ms(2), Event{Kind: EvSent, Instance: "p2"}},
			at{ms(3), Event{Kind: EvPeerDied, Instance: "p1"}},
			at{ms(4), Event{Kind: EvPeerDied, Instance: "p2"}},
			at{ms(4), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(4), Event{Kind: EvGranted, Expected: expected}},
			at{ms(4), Event{Kind: EvSent, Instance: "p3"}},
			at{ms(5), Event{Kind: EvReply, Code: CodeCancelled, Instance: "p2"}},
			at{ms(6), Event{Kind: EvPeerDied, Instance: "p3"}},
			at{ms(7), Event{Kind: EvCommitted, Manifest: okManifest}},
		)},
		{"peer_death_after_reply", 7, append(recvPrefix(),
			at{ms(5), Event{Kind: EvReply, Instance: "p1", Manifest: okManifest}},
			at{ms(6), Event{Kind: EvPeerDied, Instance: "p1"}},
			at{ms(6), Event{Kind: EvGranted, Expected: expected}},
			at{ms(6), Event{Kind: EvSent, Instance: "p2"}},
			at{ms(7), Event{Kind: EvReply, Instance: "p1", Manifest: badManifest}},
			at{ms(8), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(9), Event{Kind: EvReply, Instance: "p2", Manifest: okManifest}},
		)},
		{"control_lost_resent_served", 7, append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(3), Event{Kind: EvLost}},
			at{ms(3), Event{Kind: EvGranted, Expected: expected}},
			at{ms(3), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(4), Event{Kind: EvReply, Code: CodeCancelled, Instance: "p1", Attempt: 1}},
			at{ms(8), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(9), Event{Kind: EvReply, Instance: "p1", Manifest: okManifest, Attempt: 2}},
		)},
		{"control_lost_by_serving_instance", 7, append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(2), Event{Kind: EvLost, Instance: "p2"}},
			at{ms(3), Event{Kind: EvLost, Instance: "p1"}},
			at{ms(3), Event{Kind: EvGranted, Expected: expected}},
			at{ms(3), Event{Kind: EvSent, Instance: "p2"}},
			at{ms(8), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(9), Event{Kind: EvReply, Instance: "p2", Manifest: okManifest}},
		)},
		{"control_lost_after_reply", 7, append(recvPrefix(),
			at{ms(5), Event{Kind: EvReply, Instance: "p1", Manifest: okManifest}},
			at{ms(6), Event{Kind: EvLost}},
			at{ms(7), Event{Kind: EvCommitted, Manifest: okManifest}},
		)},
		{"control_lost_no_attempt_left", 7, append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(2), Event{Kind: EvReply, Code: CodeCapacityRefused, Instance: "p1"}},
			at{ms(2), Event{Kind: EvSent, Instance: "p2"}},
			at{ms(3), Event{Kind: EvReply, Code: CodeCapacityRefused, Instance: "p2"}},
			at{ms(3), Event{Kind: EvSent, Instance: "p3"}},
			at{ms(5), Event{Kind: EvLost}},
			at{ms(8), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(9), Event{Kind: EvReply, Instance: "p3", Manifest: okManifest}},
		)},
		{"peer_death_retry_served", 7, append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(3), Event{Kind: EvPeerDied, Instance: "p1"}},
			at{ms(3), Event{Kind: EvGranted, Expected: expected}},
			at{ms(3), Event{Kind: EvSent, Instance: "p2"}},
			at{ms(4), Event{Kind: EvReply, Code: CodeCancelled, Instance: "p1"}},
			at{ms(5), Event{Kind: EvReply, Code: CodeCapacityRefused, Instance: "p2"}},
			at{ms(5), Event{Kind: EvSent, Instance: "p3"}},
			at{ms(8), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(9), Event{Kind: EvReply, Instance: "p3", Manifest: okManifest}},
		)},
		{"peer_death_regrant_refused", 7, append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(3), Event{Kind: EvPeerDied, Instance: "p1"}},
			at{ms(3), Event{Kind: EvCancel}},
			at{ms(3), Event{Kind: EvGranted, Code: CodeClosed}},
		)},
		{"peer_death_no_live_instance", 7, append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(3), Event{Kind: EvPeerDied, Instance: "p1"}},
			at{ms(3), Event{Kind: EvGranted, Expected: expected}},
			at{ms(3), Event{Kind: EvSent, Code: CodePeerFailed}},
		)},
		{"peer_death_past_deadline", 7, append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(100), Event{Kind: EvPeerDied, Instance: "p1"}},
		)},
		{"peer_death_after_commit", 7, append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(5), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(6), Event{Kind: EvPeerDied, Instance: "p1"}},
			at{ms(50), Event{Kind: EvTick}},
			at{ms(99), Event{Kind: EvTick}},
		)},
		// A draining worker replies, then leaves the registry; the two
		// reach the decoder by different paths, the reply last.
		{"peer_gone_after_commit_reply_follows", 7, append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(5), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(6), Event{Kind: EvPeerDied, Instance: "p1"}},
			at{ms(7), Event{Kind: EvReply, Instance: "p1", Manifest: okManifest}},
		)},
		{"peer_death_data_path", 7, append(recvPrefix(),
			at{ms(5), Event{Kind: EvGrantFailed, Code: CodePeerFailed}},
			at{ms(6), Event{Kind: EvReply, Instance: "p1", Manifest: okManifest}},
		)},
		{"peer_death_data_path_targeted", 7, append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(5), Event{Kind: EvGrantFailed, Code: CodePeerFailed}},
			at{ms(5), Event{Kind: EvGranted, Expected: expected}},
			at{ms(5), Event{Kind: EvSent, Instance: "p2"}},
			at{ms(6), Event{Kind: EvReply, Instance: "p1", Manifest: okManifest}},
			at{ms(8), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(9), Event{Kind: EvReply, Instance: "p2", Manifest: okManifest}},
		)},
		{"peer_death_data_path_last_attempt", 7, append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(2), Event{Kind: EvReply, Code: CodeCapacityRefused, Instance: "p1"}},
			at{ms(2), Event{Kind: EvSent, Instance: "p2"}},
			at{ms(3), Event{Kind: EvReply, Code: CodeCapacityRefused, Instance: "p2"}},
			at{ms(3), Event{Kind: EvSent, Instance: "p3"}},
			at{ms(5), Event{Kind: EvGrantFailed, Code: CodePeerFailed}},
		)},
		{"peer_death_after_deliver", 7, append(recvPrefix(),
			at{ms(5), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(6), Event{Kind: EvReply, Instance: "p1", Manifest: okManifest}},
			at{ms(7), Event{Kind: EvPeerDied, Instance: "p1"}},
		)},
		{"grant_refused_reserved_row", 7, []at{
			{0, Event{Kind: EvStart}},
			{ms(1), Event{Kind: EvGranted, Code: CodeDummyRequest}},
		}},
		{"payload_too_large", 7, []at{
			{0, Event{Kind: EvStart}},
			{ms(1), Event{Kind: EvGranted, Expected: expected}},
			{ms(1), Event{Kind: EvSent, Code: CodePayloadTooLarge}},
		}},
		{"dummy_id_zero", 0, []at{{0, Event{Kind: EvStart}}}},
		{"dummy_padding_sentinel", math.MaxUint64 - 1, []at{{0, Event{Kind: EvStart}}}},
		{"expired_before_start", 7, []at{{ms(100), Event{Kind: EvStart}}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := NewRecvSession(RecvParams{RequestID: tc.id, MaxDraftTokens: 2, Deadline: deadline, MaxAttempts: 3})
			header := fmt.Sprintf("recv %s: request %d, deadline +100ms, 3 attempts", tc.name, tc.id)
			golden(t, "recv_"+tc.name, transcript(t, header, s, tc.script))
		})
	}
}

func sendPrefix() []at {
	return []at{
		{0, Event{Kind: EvRequest}},
		{ms(1), Event{Kind: EvAdmitted}},
	}
}

func TestSendSessionGolden(t *testing.T) {
	deadline := epoch.Add(100 * time.Millisecond)
	good := Event{Kind: EvPrefilled, KVBytes: 4096, MambaBytes: 512}
	cases := []struct {
		name   string
		id     uint64
		fp     string
		script []at
	}{
		{"happy", 7, "fp", append(sendPrefix(),
			at{ms(20), good},
			at{ms(25), Event{Kind: EvWritten, Manifest: okManifest}},
		)},
		{"cancel_during_prefill", 7, "fp", append(sendPrefix(),
			at{ms(5), Event{Kind: EvCancel}},
			at{ms(6), Event{Kind: EvCancel}},
			at{ms(7), Event{Kind: EvPrefilled, Code: CodeCancelled}},
		)},
		{"cancel_during_write", 7, "fp", append(sendPrefix(),
			at{ms(20), good},
			at{ms(21), Event{Kind: EvCancel}},
			at{ms(22), Event{Kind: EvWritten, Code: CodeCancelled}},
			at{ms(23), Event{Kind: EvCancel}},
		)},
		{"cancel_racing_accepted_commit", 7, "fp", append(sendPrefix(),
			at{ms(20), good},
			at{ms(21), Event{Kind: EvCancel}},
			at{ms(22), Event{Kind: EvWritten, Manifest: okManifest}},
		)},
		{"receiver_death_during_write", 7, "fp", append(sendPrefix(),
			at{ms(20), good},
			at{ms(22), Event{Kind: EvWritten, Code: CodePeerFailed}},
		)},
		{"receiver_revoked_after_timeout", 7, "fp", append(sendPrefix(),
			at{ms(20), good},
			at{ms(99), Event{Kind: EvWritten, Code: CodeCancelled}},
		)},
		{"peer_death_during_prefill", 7, "fp", append(sendPrefix(),
			at{ms(5), Event{Kind: EvPeerDied, Instance: "d1"}},
			at{ms(9), good},
		)},
		{"deadline_during_prefill", 7, "fp", append(sendPrefix(),
			at{ms(50), Event{Kind: EvTick}},
			at{ms(100), Event{Kind: EvTick}},
			at{ms(100), Event{Kind: EvPrefilled, Code: CodeTimeout}},
		)},
		{"prefill_failed", 7, "fp", append(sendPrefix(),
			at{ms(5), Event{Kind: EvPrefilled, Code: CodePrefillFailed}},
		)},
		{"layout_mismatch_fingerprint", 7, "other", []at{{0, Event{Kind: EvRequest}}}},
		{"layout_mismatch_bytes", 7, "fp", append(sendPrefix(),
			at{ms(20), Event{Kind: EvPrefilled, KVBytes: 8192, MambaBytes: 512}},
		)},
		{"capacity_refused", 7, "fp", []at{
			{0, Event{Kind: EvRequest}},
			{0, Event{Kind: EvAdmitted, Code: CodeCapacityRefused}},
		}},
		{"dummy_id_zero", 0, "fp", []at{{0, Event{Kind: EvRequest}}}},
		{"dummy_padding_sentinel", math.MaxUint64, "fp", []at{{0, Event{Kind: EvRequest}}}},
		{"expired_on_arrival", 7, "fp", []at{{ms(100), Event{Kind: EvRequest}}}},
		{"duplicate_request", 7, "fp", append(sendPrefix(),
			at{ms(1), Event{Kind: EvRequest}},
			at{ms(2), Event{Kind: EvAdmitted}},
			at{ms(20), good},
			at{ms(25), Event{Kind: EvWritten, Manifest: okManifest}},
			at{ms(26), Event{Kind: EvWritten, Manifest: okManifest}},
		)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := NewSendSession(SendParams{RequestID: tc.id, MaxDraftTokens: 2, Deadline: deadline,
				Fingerprint: tc.fp, Local: "fp", KVBytes: 4096, MambaBytes: 512})
			header := fmt.Sprintf("send %s: request %d, deadline +100ms, fingerprint %s (local fp)", tc.name, tc.id, tc.fp)
			golden(t, "send_"+tc.name, transcript(t, header, s, tc.script))
		})
	}
}

func TestIsDummyID(t *testing.T) {
	cases := []struct {
		id    uint64
		draft int
		want  bool
	}{
		{0, 0, true}, {1, 0, false}, {math.MaxUint64, 0, true}, {math.MaxUint64 - 1, 0, false},
		{math.MaxUint64 - 3, 3, true}, {math.MaxUint64 - 4, 3, false}, {42, 3, false}, {math.MaxUint64, -1, true},
	}
	for _, c := range cases {
		require.Equal(t, c.want, IsDummyID(c.id, c.draft), "id %d draft %d", c.id, c.draft)
	}
}

// TestSessionsRandom drives both machines with random event sequences (in
// time order, as a driver feeds them) and checks the invariants that hold
// for every order: at most one terminal action, nothing after it, no
// terminal action (after which the caller frees the destination) and no
// grant opened while the previous grant is not revoked (each grant of a
// fenced retry counts on its own), every lease released exactly once and
// never while a step is in flight.
func TestSessionsRandom(t *testing.T) {
	for seed := range uint64(4000) {
		r := newRand(seed)
		recv := NewRecvSession(RecvParams{RequestID: 9, Deadline: epoch.Add(100 * time.Millisecond), MaxAttempts: 3})
		terminal := 0
		// unrevoked: a grant the session took is open (not revoked since).
		unrevoked, grants := false, 0
		now := epoch
		for i := 0; i < 16; i++ {
			ev := randomEvent(r, true, &now)
			wasGranted := recv.granted
			acts := recv.Step(ev)
			if ev.Kind == EvGranted && ev.Code == CodeOK && !wasGranted && recv.granted {
				unrevoked = true
				grants++
			}
			for _, a := range acts {
				switch a.Kind {
				case ActOpenGrant:
					require.False(t, unrevoked, "seed %d: grant %d opened before grant %d was revoked", seed, grants+1, grants)
				case ActRevoke:
					unrevoked = false
				case ActDeliver, ActFail:
					require.False(t, unrevoked, "seed %d: %s before grant %d was revoked", seed, a.Kind, grants)
					terminal++
				}
			}
		}
		require.LessOrEqual(t, terminal, 1, "seed %d", seed)

		send := NewSendSession(SendParams{RequestID: 9, Deadline: epoch.Add(100 * time.Millisecond), Fingerprint: "fp", Local: "fp", KVBytes: 1, MambaBytes: 1})
		leased, released, replies, busy := false, 0, 0, false
		now = epoch
		for i := 0; i < 12; i++ {
			ev := randomEvent(r, false, &now)
			wasBusy := send.busy
			acts := send.Step(ev)
			for _, a := range acts {
				switch a.Kind {
				case ActRelease:
					require.False(t, busy && !(wasBusy && !send.busy), "seed %d: release during a step", seed)
					released++
				case ActReply:
					replies++
				}
			}
			if ev.Kind == EvAdmitted && ev.Code == CodeOK && wasBusy {
				leased = true
			}
			busy = send.busy
		}
		require.LessOrEqual(t, replies, 1, "seed %d", seed)
		require.LessOrEqual(t, released, 1, "seed %d", seed)
		if send.State().Terminal() && leased {
			require.Equal(t, 1, released, "seed %d: lease not released", seed)
		}
	}
}

type rng struct{ s uint64 }

func newRand(seed uint64) *rng { return &rng{seed*0x9e3779b97f4a7c15 + 1} }

func (r *rng) intn(n int) int {
	r.s ^= r.s << 13
	r.s ^= r.s >> 7
	r.s ^= r.s << 17
	return int(r.s % uint64(n))
}

// randomEvent returns a random event at *now or up to 15 ms after it, and
// advances *now to it: a driver's clock does not go back.
func randomEvent(r *rng, recv bool, now *time.Time) Event {
	codes := []Code{CodeOK, CodeOK, CodeOK, CodeCapacityRefused, CodePeerFailed, CodeCancelled, CodeTimeout}
	var kinds []EventKind
	if recv {
		kinds = []EventKind{EvStart, EvGranted, EvSent, EvNoResponders, EvReply, EvCommitted, EvGrantFailed, EvTick, EvCancel, EvPeerDied, EvLost}
	} else {
		kinds = []EventKind{EvRequest, EvAdmitted, EvPrefilled, EvWritten, EvTick, EvCancel, EvPeerDied}
	}
	*now = now.Add(time.Duration(r.intn(16)) * time.Millisecond)
	ev := Event{
		Kind: kinds[r.intn(len(kinds))], Code: codes[r.intn(len(codes))],
		Now:      *now,
		Instance: []string{"", "p1", "p2"}[r.intn(3)], Manifest: okManifest, Expected: expected,
		KVBytes: 1, MambaBytes: 1,
	}
	if r.intn(4) == 0 {
		ev.Manifest = badManifest
	}
	return ev
}
