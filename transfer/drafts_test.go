package transfer

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/transfer/wire"
)

// TestHandoffShipsDrafts: the prefill worker's draft tokens travel with
// the first token, cut to what the decoder asked for; a decoder that asks
// for none gets none.
func TestHandoffShipsDrafts(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.drafts = []int32{65, 66, 67, 68, 69}
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", f.fp, x, nil)
	for _, tc := range []struct {
		ask  int
		want []int32
	}{{3, []int32{65, 66, 67}}, {0, nil}, {8, []int32{65, 66, 67, 68, 69}}} {
		id := uint64(10 + tc.ask)
		res, err := ds.handoff(context.Background(), d, Request{ID: id, Tokens: tokens(9), Drafts: tc.ask, Deadline: time.Now().Add(5 * time.Second)})
		require.NoError(t, err, "ask %d", tc.ask)
		require.Equal(t, tc.want, res.Drafts, "ask %d", tc.ask)
		require.NoError(t, ds.m.Free(id))
	}
	ds.requireInitial(t)
}

// TestHandoffRefusesTooManyDrafts: a reply with more draft tokens than
// the decoder asked for is a bad message, refused at once, not a cache to
// decode from; a decoder that asked for none ignores drafts shipped
// unasked (the rogue writes nothing, so that handoff ends at its deadline,
// not as a bad message).
func TestHandoffRefusesTooManyDrafts(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(64, 8))
	d := f.decoder("d1", ds, nil)
	nc := natstest.Connect(t, f.srv)
	sub, err := nc.Subscribe(wire.Subject(wire.DefaultPrefix, f.ns, wire.SubjectPrefill, ""), func(m *nats.Msg) {
		req, err := wire.DecodePrefillRequest(m.Data)
		if err != nil {
			return
		}
		b, _ := wire.EncodePrefillReply(wire.PrefillReply{RequestID: req.RequestID, Code: session.CodeOK, Instance: "rogue",
			Drafts: wire.Tokens{1, 2, 3}}, 0)
		_ = m.Respond(b)
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	start := time.Now()
	_, err = ds.handoff(context.Background(), d, Request{ID: 7, Tokens: tokens(9), Drafts: 2, Deadline: time.Now().Add(5 * time.Second)})
	require.ErrorIs(t, err, ErrBadMessage)
	require.ErrorContains(t, err, "3 draft tokens, 2 asked for")
	require.Less(t, time.Since(start), 4*time.Second, "refused, not timed out")

	_, err = ds.handoff(context.Background(), d, Request{ID: 8, Tokens: tokens(9), Deadline: time.Now().Add(500 * time.Millisecond)})
	require.Error(t, err)
	require.NotErrorIs(t, err, ErrBadMessage, "drafts shipped unasked refused the reply: %v", err)
	require.NotContains(t, err.Error(), "draft tokens")
	ds.requireInitial(t)
}
