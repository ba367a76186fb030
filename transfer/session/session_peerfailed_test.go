package session

import (
	"fmt"
	"testing"
	"time"
)

// A serving worker's reply peer_failed (its write failed: the data-path
// connection went mid-write) is the same news as the grant failing by that
// connection, and arrives first whenever the reset reaches the worker's end
// before the decoder's (or never reaches the decoder's): it is retried
// fenced on another instance in the same way, within the attempt budget.
func TestRecvSessionPeerFailedReplyGolden(t *testing.T) {
	deadline := epoch.Add(100 * time.Millisecond)
	cases := []struct {
		name   string
		script []at
	}{
		{"peer_failed_reply_retried", append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(5), Event{Kind: EvReply, Code: CodePeerFailed, Instance: "p1"}},
			at{ms(5), Event{Kind: EvGranted, Expected: expected}},
			at{ms(5), Event{Kind: EvSent, Instance: "p2"}},
			at{ms(8), Event{Kind: EvCommitted, Manifest: okManifest}},
			at{ms(9), Event{Kind: EvReply, Instance: "p2", Manifest: okManifest}},
		)},
		{"peer_failed_reply_last_attempt", append(recvPrefix()[:3],
			at{ms(1), Event{Kind: EvSent, Instance: "p1"}},
			at{ms(2), Event{Kind: EvReply, Code: CodeCapacityRefused, Instance: "p1"}},
			at{ms(2), Event{Kind: EvSent, Instance: "p2"}},
			at{ms(3), Event{Kind: EvReply, Code: CodeCapacityRefused, Instance: "p2"}},
			at{ms(3), Event{Kind: EvSent, Instance: "p3"}},
			at{ms(5), Event{Kind: EvReply, Code: CodePeerFailed, Instance: "p3"}},
		)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := NewRecvSession(RecvParams{RequestID: 7, Deadline: deadline, MaxAttempts: 3})
			header := fmt.Sprintf("recv %s: request 7, deadline +100ms, 3 attempts", tc.name)
			golden(t, "recv_"+tc.name, transcript(t, header, s, tc.script))
		})
	}
}
