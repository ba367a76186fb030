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

var update = flag.Bool("update", false, "rewrite the transcripts of the testdata scripts")

// TestGolden runs every script in testdata (see script) and compares the
// transcript its session produces with the one below the script's "----",
// or rewrites it under -update.
func TestGolden(t *testing.T) {
	paths, err := filepath.Glob(filepath.Join("testdata", "*.txt"))
	require.NoError(t, err)
	require.NotEmpty(t, paths)
	for _, path := range paths {
		t.Run(strings.TrimSuffix(filepath.Base(path), ".txt"), func(t *testing.T) {
			sc, err := readScript(path)
			require.NoError(t, err)
			s, err := newStepper(sc.directive)
			require.NoError(t, err)
			got := transcript(t, s, sc.events)
			if *update {
				require.NoError(t, os.WriteFile(path, []byte(sc.input()+got), 0o644))
				return
			}
			require.Equal(t, sc.want, got, "transcript differs from %s (run with -update if intended)", path)
		})
	}
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
func transcript(t *testing.T, s stepper, script []at) string {
	t.Helper()
	var b strings.Builder
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

var (
	okManifest  = Manifest{Bytes: []uint64{4096, 512}, CRC: []uint32{0xaaaa, 0xbbbb}}
	badManifest = Manifest{Bytes: []uint64{4096, 512}, CRC: []uint32{0xaaaa, 0xcccc}}
	expected    = []uint64{4096, 512}
)

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

		send := NewWriteSession(WriteParams{RequestID: 9, Deadline: epoch.Add(100 * time.Millisecond), Fingerprint: "fp", Local: "fp", KVBytes: 1, MambaBytes: 1})
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

// WakeAt is the earliest time the session acts on a tick: the deadline, a
// resend after no responder, or the end of a late reply's grace.
func TestWakeAt(t *testing.T) {
	t0 := time.Unix(1000, 0)
	dl := t0.Add(5 * time.Second)
	exp := []uint64{4096, 512}
	man := Manifest{Bytes: exp, CRC: []uint32{1, 2}}
	tests := []struct {
		name   string
		quiet  time.Duration
		events []Event
		want   time.Time
	}{
		{"waiting: the deadline", 0, []Event{
			{Kind: EvStart, Now: t0}, {Kind: EvGranted, Now: t0, Expected: exp}, {Kind: EvSent, Now: t0, Instance: "p1"},
		}, dl},
		{"no responder: the resend", time.Second, []Event{
			{Kind: EvStart, Now: t0}, {Kind: EvGranted, Now: t0, Expected: exp}, {Kind: EvSent, Now: t0},
			{Kind: EvNoResponders, Now: t0.Add(time.Millisecond)},
		}, t0.Add(time.Millisecond + quietFirst)},
		{"committed, serving instance gone: the grace", 0, []Event{
			{Kind: EvStart, Now: t0}, {Kind: EvGranted, Now: t0, Expected: exp}, {Kind: EvSent, Now: t0, Instance: "p1"},
			{Kind: EvCommitted, Now: t0, Manifest: man}, {Kind: EvPeerDied, Now: t0.Add(time.Millisecond), Instance: "p1"},
		}, t0.Add(time.Millisecond + lateReplyGrace)},
		{"grace past the deadline: the deadline", 0, []Event{
			{Kind: EvStart, Now: t0}, {Kind: EvGranted, Now: t0, Expected: exp}, {Kind: EvSent, Now: t0, Instance: "p1"},
			{Kind: EvCommitted, Now: t0, Manifest: man}, {Kind: EvPeerDied, Now: dl.Add(-time.Millisecond), Instance: "p1"},
		}, dl},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := NewRecvSession(RecvParams{RequestID: 7, Deadline: dl, MaxAttempts: 3, QuietWait: tt.quiet})
			for _, ev := range tt.events {
				s.Step(ev)
			}
			require.Equal(t, StateWaiting, s.State())
			require.Equal(t, tt.want, s.WakeAt())
		})
	}
}
