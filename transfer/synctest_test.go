package transfer

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/transfer/wire"
)

// recorder is a publisher that keeps what the decoder publishes; the test
// plays the prefill worker by answering through Decoder.onReply.
type recorder struct {
	mu       sync.Mutex
	requests []*nats.Msg
	cancels  []wire.Cancel
	sent     chan *nats.Msg
	// hold, when set, keeps PublishRequest from returning until it is
	// received from: what arrives meanwhile is all there when the
	// handoff next waits.
	hold chan struct{}
}

func (r *recorder) PublishRequest(subj, reply string, data []byte) error {
	m := &nats.Msg{Subject: subj, Reply: reply, Data: bytes.Clone(data)} // data is the caller's again on return
	r.mu.Lock()
	r.requests = append(r.requests, m)
	hold := r.hold
	r.mu.Unlock()
	r.sent <- m
	if hold != nil {
		hold <- struct{}{}
	}
	return nil
}

func (r *recorder) Publish(subj string, data []byte) error {
	c, err := wire.DecodeCancel(data)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.cancels = append(r.cancels, c)
	r.mu.Unlock()
	return nil
}

// bubbleDecoder builds a Decoder without NATS: requests go to a recorder.
func bubbleDecoder(t *testing.T, eng *rdma.Engine, attempts int) (*Decoder, *recorder) {
	cfg := DecoderConfig{Instance: "d1", Namespace: "t", Fingerprint: "fp", NoRegistry: true, MaxAttempts: attempts}
	require.NoError(t, cfg.validate())
	rec := &recorder{sent: make(chan *nats.Msg, 8)}
	d := &Decoder{cfg: cfg, pub: rec, eng: eng, peer: wire.PeerOf(eng.Descriptor()), inbox: "_INBOX.test",
		calls: map[string]*call{}, done: make(chan struct{}), maxPayload: wire.DefaultMaxPayload,
		prefillSub: wire.Subject(wire.DefaultPrefix, "t", wire.SubjectPrefill, "")}
	return d, rec
}

func bubbleEngines(t *testing.T) (recv, send *rdma.Engine, dst, src rdma.Extent) {
	quiet := slog.New(slog.DiscardHandler)
	recv, err := rdma.New(rdma.Config{Agent: "recv", Transports: []rdma.Transport{rdma.TransportInproc}, Logger: quiet})
	require.NoError(t, err)
	send, err = rdma.New(rdma.Config{Agent: "send", Transports: []rdma.Transport{rdma.TransportInproc}, Logger: quiet})
	require.NoError(t, err)
	rr, err := recv.Register("state", 4096)
	require.NoError(t, err)
	sr, err := send.Register("state", 4096)
	require.NoError(t, err)
	return recv, send, rdma.Extent{Region: rr.ID(), Offset: 0, Length: 64}, rdma.Extent{Region: sr.ID(), Offset: 0, Length: 64}
}

// TestDeadlineSynctest: with no reply the handoff ends exactly at its
// deadline, cancels and revokes its grant; the prefill worker's late write and
// commit are then refused by the data plane.
func TestDeadlineSynctest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		recv, send, dst, src := bubbleEngines(t)
		defer recv.Close()
		defer send.Close()
		d, rec := bubbleDecoder(t, recv, 3)
		dest := CacheExtents{Mamba: dst}
		start := time.Now()
		_, err := d.Handoff(context.Background(), Request{ID: 7, Tokens: tokens(4), Dest: dest, Deadline: start.Add(2 * time.Second)})
		require.ErrorIs(t, err, ErrTimeout)
		require.Equal(t, 2*time.Second, time.Since(start), "ended exactly at the deadline")
		require.Zero(t, recv.Stats().GrantsOpen, "the grant is revoked: the caller may free the destination")
		require.Len(t, rec.requests, 1)
		require.Equal(t, []wire.Cancel{{V: wire.WireVersion, RequestID: 7, Grant: rec.cancelGrant(t), Code: session.CodeTimeout, From: "d1"}}, rec.cancels)

		// The worker finishes late: its write is refused, nothing lands.
		req, err := wire.DecodePrefillRequest(rec.requests[0].Data)
		require.NoError(t, err)
		_, err = send.Write(context.Background(), req.Peer.Descriptor(), req.Ticket, []rdma.Extent{src})
		require.Error(t, err)
		require.Contains(t, []session.Code{session.CodeCancelled, session.CodeTimeout}, rdmaCode(err))
	})
}

func (r *recorder) cancelGrant(t *testing.T) uint64 {
	req, err := wire.DecodePrefillRequest(r.requests[0].Data)
	require.NoError(t, err)
	return req.Ticket.Grant
}

// TestRetryBudgetSynctest: capacity refusals are retried at once while the
// deadline allows; a refusal that arrives after the deadline is final.
func TestRetryBudgetSynctest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		recv, send, dst, _ := bubbleEngines(t)
		defer recv.Close()
		defer send.Close()
		d, rec := bubbleDecoder(t, recv, 5)
		dest := CacheExtents{Mamba: dst}
		refuse := func(m *nats.Msg, inst string) {
			req, err := wire.DecodePrefillRequest(m.Data)
			require.NoError(t, err)
			b, err := wire.EncodePrefillReply(wire.PrefillReply{RequestID: req.RequestID, Instance: inst, Code: session.CodeCapacityRefused}, 0)
			require.NoError(t, err)
			d.onReply(&nats.Msg{Subject: m.Reply, Data: b})
		}
		done := make(chan error, 1)
		start := time.Now()
		go func() {
			_, err := d.Handoff(context.Background(), Request{ID: 9, Tokens: tokens(4), Dest: dest, Deadline: start.Add(time.Second)})
			done <- err
		}()
		refuse(<-rec.sent, "p1")
		m := <-rec.sent // retried at once
		require.Equal(t, time.Duration(0), time.Since(start))
		time.Sleep(1500 * time.Millisecond) // the worker answers after the deadline
		select {
		case err := <-done:
			require.ErrorIs(t, err, ErrTimeout)
		default:
			t.Fatal("handoff still running after its deadline")
		}
		refuse(m, "p2") // late: nobody listens any more
		synctest.Wait()
		require.Zero(t, recv.Stats().GrantsOpen, "the grant is revoked: the caller may free the destination")
		require.Len(t, rec.requests, 2)
		req, err := wire.DecodePrefillRequest(rec.requests[1].Data)
		require.NoError(t, err)
		require.Equal(t, uint8(2), req.Attempt)
	})
}

// Every peer death reaches a handoff, not only the first one since it last
// looked: an unrelated instance may leave just before the one it waits on.
func TestPeerDeathsAllDelivered(t *testing.T) {
	d := &Decoder{calls: map[string]*call{}}
	c := new(call)
	c.init()
	d.calls["1"] = c
	d.peerDied("p1")
	d.peerDied("p2")
	d.peerDied("p1")
	d.controlLost("p3")
	d.controlLost("")
	d.controlLost("p3")
	require.Len(t, c.died, 1)
	require.Equal(t, []session.Event{{Kind: session.EvPeerDied, Instance: "p1"}, {Kind: session.EvPeerDied, Instance: "p2"},
		{Kind: session.EvLost, Instance: "p3"}, {Kind: session.EvLost}}, d.takeNotes(c))
	require.Empty(t, d.takeNotes(c))
}

// A prefill instance restarted under its id: the death of its old
// incarnation reaches every handoff but the ones addressed to the new one
// (by its micro service), which lives. A handoff that names no incarnation
// (sent to the queue group, or addressed where the registry said none) is
// told; so is every handoff of a death whose incarnation is not known.
func TestIncarnationDeathSparesNewIncarnation(t *testing.T) {
	d := &Decoder{calls: map[string]*call{}}
	calls := map[string]*call{
		"old": {target: "p1", svc: "svc-a"}, "new": {target: "p1", svc: "svc-b"},
		"queue": {svc: anyIncarnation}, "unknown": {target: "p1", svc: anyIncarnation}, "other": {target: "p2", svc: "svc-c"},
	}
	for name, c := range calls {
		c.init()
		d.calls[name] = c
	}
	told := func() []string {
		var out []string
		for name, c := range calls {
			if len(d.takeNotes(c)) > 0 {
				out = append(out, name)
			}
		}
		return out
	}
	d.incarnationDied("p1", "svc-a")
	require.ElementsMatch(t, []string{"old", "queue", "unknown", "other"}, told())
	d.peerDied("p1")
	require.ElementsMatch(t, []string{"old", "new", "queue", "unknown", "other"}, told())
}

// TestControlLostResendSynctest: the decoder's NATS connection drops and
// comes back while its request is unanswered (the request, or the reply,
// may be gone with it). The handoff resends at once, fenced: the first
// attempt's grant is revoked (its late write lands nothing), a fresh grant
// goes out with attempt 2, and the worker's answer to it delivers, long
// before the deadline.
func TestControlLostResendSynctest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		recv, send, dst, src := bubbleEngines(t)
		defer recv.Close()
		defer send.Close()
		d, rec := bubbleDecoder(t, recv, 3)
		dest := CacheExtents{Mamba: dst}
		type out struct {
			res Result
			err error
		}
		done := make(chan out, 1)
		start := time.Now()
		go func() {
			res, err := d.Handoff(context.Background(), Request{ID: 5, Tokens: tokens(4), Dest: dest, Deadline: start.Add(30 * time.Second)})
			done <- out{res, err}
		}()
		first := <-rec.sent
		time.Sleep(time.Second)
		d.controlLost("") // what watchReconnects does on a reconnect
		second := <-rec.sent
		require.Equal(t, time.Second, time.Since(start), "resent as soon as the connection was back")
		r1, err := wire.DecodePrefillRequest(first.Data)
		require.NoError(t, err)
		r2, err := wire.DecodePrefillRequest(second.Data)
		require.NoError(t, err)
		require.Equal(t, uint8(2), r2.Attempt)
		require.NotEqual(t, r1.Ticket.Grant, r2.Ticket.Grant, "the resend writes into a fresh grant")
		require.NotEqual(t, first.Reply, second.Reply, "each attempt has a reply subject of its own")

		// The first attempt's worker was alive after all: its write lands
		// nothing, and its answer is dropped.
		_, err = send.Write(context.Background(), r1.Peer.Descriptor(), r1.Ticket, []rdma.Extent{src})
		require.Error(t, err)
		m, err := send.Write(context.Background(), r2.Peer.Descriptor(), r2.Ticket, []rdma.Extent{src})
		require.NoError(t, err)
		b, err := wire.EncodePrefillReply(wire.PrefillReply{RequestID: 5, Instance: "p1", FirstToken: 42, Manifest: m}, 0)
		require.NoError(t, err)
		d.onReply(&nats.Msg{Subject: second.Reply, Data: b})
		o := <-done
		require.NoError(t, o.err)
		require.Equal(t, int32(42), o.res.FirstToken)
		require.Equal(t, 2, o.res.Attempts)
		rec.mu.Lock()
		require.Len(t, rec.cancels, 1, "the first attempt is cancelled")
		require.Equal(t, session.CodeCancelled, rec.cancels[0].Code)
		rec.mu.Unlock()
	})
}

// TestPeerDeathAfterUnrelatedDeathSynctest: the worker that replied dies right
// after another one; the handoff fails at once with ErrPeerFailed instead of
// waiting for its deadline.
func TestPeerDeathAfterUnrelatedDeathSynctest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		recv, send, dst, _ := bubbleEngines(t)
		defer recv.Close()
		defer send.Close()
		d, rec := bubbleDecoder(t, recv, 1)
		dest := CacheExtents{Mamba: dst}
		done := make(chan error, 1)
		start := time.Now()
		go func() {
			_, err := d.Handoff(context.Background(), Request{ID: 5, Tokens: tokens(4), Dest: dest, Deadline: start.Add(time.Minute)})
			done <- err
		}()
		m := <-rec.sent
		req, err := wire.DecodePrefillRequest(m.Data)
		require.NoError(t, err)
		b, err := wire.EncodePrefillReply(wire.PrefillReply{RequestID: req.RequestID, Instance: "p2", Code: session.CodeOK}, 0)
		require.NoError(t, err)
		d.onReply(&nats.Msg{Subject: m.Reply, Data: b}) // replied; the commit never comes
		synctest.Wait()
		d.peerDied("p1")
		d.peerDied("p2")
		require.ErrorIs(t, <-done, ErrPeerFailed)
		require.Equal(t, time.Duration(0), time.Since(start))
		require.Zero(t, recv.Stats().GrantsOpen, "the grant is revoked: the caller may free the destination")
	})
}

// After a fenced retry (the serving instance was reported dead), the
// no-responders the NATS server sends for the dead instance's attempt must
// not count against the retry: with two instances the handoff would fail
// while the second serves it, with three a third attempt would go out on
// the same grant as the second.
func TestLateNoRespondersOfAbandonedAttempt(t *testing.T) {
	for _, n := range []int{2, 3} {
		t.Run(fmt.Sprintf("%d instances", n), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				recv, send, dst, _ := bubbleEngines(t)
				defer recv.Close()
				defer send.Close()
				d, rec := bubbleDecoder(t, recv, 3)
				d.cfg.DirectFirst = true
				d.reg = prefillRegistry([]string{"p1", "p2", "p3"}[:n]...)
				type out struct {
					res Result
					err error
				}
				done := make(chan out, 1)
				go func() {
					res, err := d.Handoff(context.Background(), Request{ID: 5, Tokens: tokens(4),
						Dest: CacheExtents{Mamba: dst}, Deadline: time.Now().Add(time.Minute)})
					done <- out{res, err}
				}()
				m1 := <-rec.sent
				dead := m1.Subject[len(m1.Subject)-len("p1.prefill"):][:2]
				d.peerDied(dead) // its writer's connection went: a fenced retry
				m2 := <-rec.sent
				r2, err := wire.DecodePrefillRequest(m2.Data)
				require.NoError(t, err)
				require.NotEqual(t, m1.Reply, m2.Reply, "each attempt has its own reply subject")
				// The server's no-responders for attempt 1 arrives now.
				d.onReply(&nats.Msg{Subject: m1.Reply, Header: nats.Header{"Status": []string{"503"}}})
				synctest.Wait()
				require.Len(t, rec.requests, 2, "no third attempt while the second is served")
				select {
				case o := <-done:
					t.Fatalf("the handoff ended while attempt 2 is served: %v", o.err)
				default:
				}
				// Attempt 2 is still awaited: its answer never comes, and the
				// handoff ends at its deadline (the bubble's clock), on
				// grant r2's revocation.
				o := <-done
				require.ErrorIs(t, o.err, ErrTimeout, "grant %d", r2.Ticket.Grant)
			})
		})
	}
}

// An instance the data plane reported gone (its last connection closed: a
// SIGKILL) is not picked for new handoffs while its registry entry shows no
// heartbeat since: the entry stays fresh for up to the TTL, and a request
// sent to it would spend an attempt on a no-responders.
func TestPickPassesOverWriterGone(t *testing.T) {
	d := &Decoder{cfg: DecoderConfig{Fingerprint: "fp"}, calls: map[string]*call{}}
	reg := prefillRegistry("p1", "p2")
	d.reg = reg
	seen := func() map[string]int {
		n := map[string]int{}
		for range 10 {
			n[d.pick(nil).ID]++
		}
		return n
	}
	require.Positive(t, seen()["p1"], "both are picked before")
	d.writerGone("p1", d.entriesOf("p1"), d.entriesOf("p1"))
	require.Equal(t, map[string]int{"p2": 10}, seen())
	// A heartbeat after the report: p1 is alive after all.
	e := reg.entries["p1"]
	e.Updated++
	reg.entries["p1"] = e
	require.Positive(t, seen()["p1"])
}

// A prefill instance the data plane reported gone whose id a new
// incarnation took over during the ping (a quick restart): the new one is
// not recorded as gone, so new handoffs may go to it at once, and a
// handoff already addressed to it is not told of the old one's death.
func TestWriterGoneSparesNewIncarnation(t *testing.T) {
	d := &Decoder{cfg: DecoderConfig{Fingerprint: "fp"}, calls: map[string]*call{}}
	reg := &Registry{cfg: RegistryConfig{TTL: time.Hour}, entries: map[string]wire.Instance{}, seen: map[string]time.Time{}}
	d.reg = reg
	put := func(svc string) {
		reg.entries["p1"] = wire.Instance{ID: "p1", Role: wire.RolePrefill, Fingerprint: "fp", Updated: time.Now().UnixNano(), Service: svc}
		reg.seen["p1"] = time.Now()
	}
	put("svc-a")
	pinged := d.entriesOf("p1")
	put("svc-b") // the new incarnation announces during the ping
	toNew := &call{target: "p1", svc: "svc-b"}
	toNew.init()
	d.calls["new"] = toNew
	toOld := &call{target: "p1", svc: "svc-a"}
	toOld.init()
	d.calls["old"] = toOld
	d.writerGone("p1", pinged, d.entriesOf("p1"))
	require.Equal(t, "p1", d.pick(nil).ID, "the new incarnation is usable")
	require.Empty(t, d.takeNotes(toNew))
	require.Equal(t, []session.Event{{Kind: session.EvPeerDied, Instance: "p1"}}, d.takeNotes(toOld))

	// Without a restart, the instance found dead is passed over.
	put("svc-b")
	d.writerGone("p1", d.entriesOf("p1"), d.entriesOf("p1"))
	require.Empty(t, d.pick(nil).ID)
	require.Equal(t, []session.Event{{Kind: session.EvPeerDied, Instance: "p1"}}, d.takeNotes(toNew))
}

// A refusal and the refuser's death can reach a handoff together (a
// draining prefill refuses, exits and leaves the registry within
// milliseconds). The refusal is acted on first, as it came first: its
// retry goes to the other instance, and the death of an instance that
// serves nothing of the handoff costs nothing. Acting on the death first
// took the refuser for the server of the retry not yet sent: a cancel
// to every instance, a new grant, a third request (found in review).
// Both arrive while the handoff is busy (publishing); which of the two
// ready signals its next wait takes is random: twenty rounds.
func TestRefusalThenDeathOfRefuser(t *testing.T) {
	for round := range 20 {
		synctest.Test(t, func(t *testing.T) {
			recv, send, dst, _ := bubbleEngines(t)
			defer recv.Close()
			defer send.Close()
			d, rec := bubbleDecoder(t, recv, 3)
			d.cfg.DirectFirst = true
			d.reg = prefillRegistry("p1", "p2")
			rec.hold = make(chan struct{})
			done := make(chan error, 1)
			go func() {
				_, err := d.Handoff(context.Background(), Request{ID: 5, Tokens: tokens(4), Dest: CacheExtents{Mamba: dst}, Deadline: time.Now().Add(time.Minute)})
				done <- err
			}()
			m1 := <-rec.sent // the handoff is held in its publish
			refuser := m1.Subject[len(m1.Subject)-len("p1.prefill"):][:2]
			req, err := wire.DecodePrefillRequest(m1.Data)
			require.NoError(t, err)
			b, err := wire.EncodePrefillReply(wire.PrefillReply{RequestID: req.RequestID, Instance: refuser, Code: session.CodeCapacityRefused}, 0)
			require.NoError(t, err)
			d.onReply(&nats.Msg{Subject: m1.Reply, Data: b})
			d.peerDied(refuser)
			rec.mu.Lock()
			hold := rec.hold
			rec.hold = nil
			rec.mu.Unlock()
			<-hold
			m2 := <-rec.sent
			require.NotContains(t, m2.Subject, refuser+".prefill", "round %d: the retry went to the refuser", round)
			synctest.Wait()
			rec.mu.Lock()
			n, cancels := len(rec.requests), len(rec.cancels)
			rec.mu.Unlock()
			require.Equal(t, 2, n, "round %d: one retry, on the other instance", round)
			require.Zero(t, cancels, "round %d: nothing to cancel: no instance serves the handoff", round)
			r2, err := wire.DecodePrefillRequest(m2.Data)
			require.NoError(t, err)
			require.Equal(t, req.Ticket.Grant, r2.Ticket.Grant, "round %d: a refusal keeps the grant", round)
			require.ErrorIs(t, <-done, ErrTimeout) // attempt 2 is never answered
		})
	}
}

// TestDeliveredBeforeTickCounts: a commit and a reply that arrived while
// the handoff was busy (held in its publish) count before a tick that came
// due meanwhile, here the deadline's: they came first, so the handoff is
// delivered, not timed out. A select that took whichever was ready failed
// about one round in two.
func TestDeliveredBeforeTickCounts(t *testing.T) {
	for round := range 20 {
		synctest.Test(t, func(t *testing.T) {
			recv, send, dst, src := bubbleEngines(t)
			defer recv.Close()
			defer send.Close()
			d, rec := bubbleDecoder(t, recv, 1)
			rec.hold = make(chan struct{})
			type out struct {
				res Result
				err error
			}
			done := make(chan out, 1)
			start := time.Now()
			go func() {
				res, err := d.Handoff(context.Background(), Request{ID: 5, Tokens: tokens(4), Dest: CacheExtents{Mamba: dst}, Deadline: start.Add(time.Second)})
				done <- out{res, err}
			}()
			m1 := <-rec.sent // the handoff is held in its publish
			req, err := wire.DecodePrefillRequest(m1.Data)
			require.NoError(t, err)
			m, err := send.Write(context.Background(), req.Peer.Descriptor(), req.Ticket, []rdma.Extent{src})
			require.NoError(t, err)
			b, err := wire.EncodePrefillReply(wire.PrefillReply{RequestID: req.RequestID, Instance: "p1", FirstToken: 42, Manifest: m}, 0)
			require.NoError(t, err)
			d.onReply(&nats.Msg{Subject: m1.Reply, Data: b})
			time.Sleep(2 * time.Second) // the deadline passes while the handoff is held
			<-rec.hold
			o := <-done
			require.NoError(t, o.err, "round %d: committed and replied before the deadline", round)
			require.Equal(t, int32(42), o.res.FirstToken)
		})
	}
}

// prefillRegistry is a registry, without NATS, that holds fresh entries of
// prefill instances ids with the decoders' fingerprint "fp".
func prefillRegistry(ids ...string) *Registry {
	reg := &Registry{cfg: RegistryConfig{TTL: time.Hour}, entries: map[string]wire.Instance{}, seen: map[string]time.Time{}}
	for _, id := range ids {
		reg.entries[id] = wire.Instance{ID: id, Role: wire.RolePrefill, Fingerprint: "fp", Updated: time.Now().UnixNano()}
		reg.seen[id] = time.Now()
	}
	return reg
}

// TestHolderNoRespondersBacksOffSynctest: a state pulled from a holder
// whose subject has no subscriber (it restarted, or its state server is not
// subscribed yet) is asked again after the quiet backoff, not at once: a
// handful of requests, each carrying the whole prompt, then
// ErrNoPrefillWorker before the deadline.
func TestHolderNoRespondersBacksOffSynctest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		recv, send, dst, _ := bubbleEngines(t)
		defer recv.Close()
		defer send.Close()
		d, rec := bubbleDecoder(t, recv, 3)
		go func() {
			// No subscriber: every request is answered no-responders, up to
			// a bound (a resend at once would spin without the clock moving).
			n := 0
			for m := range rec.sent {
				if n++; n <= 50 {
					d.onReply(&nats.Msg{Subject: m.Reply, Header: nats.Header{"Status": []string{"503"}}})
				}
			}
		}()
		start := time.Now()
		_, err := d.Handoff(context.Background(), Request{ID: 7, Tokens: tokens(4), Dest: CacheExtents{Mamba: dst},
			Deadline: start.Add(time.Second), Holder: "ghost"})
		close(rec.sent)
		require.ErrorIs(t, err, ErrNoPrefillWorker)
		require.Less(t, time.Since(start), time.Second, "failed before the deadline")
		require.LessOrEqual(t, d.Stats().Published, uint64(6), "sent at once again and again")
		holder := wire.Subject(wire.DefaultPrefix, "t", wire.SubjectInstancePrefill, "ghost")
		for _, m := range rec.requests {
			require.Equal(t, holder, m.Subject, "only the holder has the state")
		}
		require.Zero(t, recv.Stats().GrantsOpen)
	})
}
