package transfer

// The decoder's per-request driver: a handoff runs one request's RecvSession.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/trace"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/transfer/wire"
)

// handoff is the driver state of one Handoff: the session plus the IO handles
// its actions need. Owned by the Handoff goroutine.
type handoff struct {
	d        *Decoder
	req      Request
	start    time.Time // Handoff's start: a monotonic reading, see now
	deadline time.Time
	sess     session.RecvSession
	reply    string // the reply subject of attempt 1: the inbox and tok
	tok      string // the call's token, a suffix of reply
	attempt  int    // the attempt last sent
	c        *call
	mailbox  call       // what c points to: one allocation for the handoff
	span     trace.Span // the handoff's span when traced (see trace.go), else nil

	kvB    uint64
	mB     uint64
	grant  *rdma.Grant
	doneCh <-chan struct{} // the grant's Done while it is watched, else nil
	// failCh is the grant's Failed while it is watched, else nil. Until an
	// OK reply arrives the handoff waits on failCh, not doneCh: a commit
	// alone decides nothing (the reply must agree), so it need not wake the
	// handoff; a grant that fails still does.
	failCh  <-chan struct{}
	replied bool // an OK reply arrived: the commit is what is awaited now
	// held is the Done of a revoked grant left quarantined (a live writer
	// still inside a copy into the destination), nil otherwise: the
	// destination stays out of use until it closes.
	held <-chan struct{}

	cause error // the most specific error behind a failure
	fits  bool  // some instance refused for want of room now, not for length (ErrTooLong)
	ok    wire.PrefillReply
	// notes are deaths and losses taken from c, held back while the
	// actions of what was delivered before them run (see run).
	notes []session.Event
}

// Handoff runs one request's handoff and returns once it is delivered or
// failed. On failure the grant is revoked before it returns, so no byte lands
// in req.Dest any more and the caller may free it, except when the error is
// a *QuarantinedError (a live writer may still copy into it: free it once
// Released is closed). The error wraps one of the package sentinels; a
// remote refusal is a *RemoteError.
func (d *Decoder) Handoff(ctx context.Context, req Request) (Result, error) {
	start := time.Now()
	if req.Dest.Mamba.Length == 0 || len(req.Tokens) == 0 {
		return Result{}, fmt.Errorf("%w: request %d without destination or tokens", ErrInvalidConfig, req.ID)
	}
	deadline := req.Deadline
	if dl, ok := ctx.Deadline(); ok && (deadline.IsZero() || dl.Before(deadline)) {
		deadline = dl
	}
	if deadline.IsZero() {
		deadline = start.Add(d.cfg.DefaultTimeout)
	} else {
		// On the monotonic clock from here on, as every time this handoff
		// compares against it (a wall-clock step must not move it).
		deadline = start.Add(deadline.Sub(start))
	}
	attempts := d.cfg.MaxAttempts
	if req.Holder != "" {
		if !wire.ValidToken(req.Holder) {
			return Result{}, fmt.Errorf("%w: request %d: holder %q is not an instance id", ErrInvalidConfig, req.ID, req.Holder)
		}
		attempts = 1 // only the holder has it
	}
	h := new(handoff)
	h.mailbox.init()
	h.d, h.req, h.start, h.deadline = d, req, start, deadline
	h.kvB, h.mB = req.Dest.bytes()
	h.sess.Reset(session.RecvParams{
		RequestID: req.ID, MaxDraftTokens: d.cfg.MaxDraftTokens, Deadline: deadline, MaxAttempts: attempts,
		QuietWait: max(d.cfg.NoResponderWait, 0), Holder: req.Holder,
	})
	var sb [64]byte
	h.reply = string(strconv.AppendUint(append(append(sb[:0], d.inbox...), '.'), d.seq.Add(1), 36))
	h.tok = h.reply[len(d.inbox)+1:]
	h.c = &h.mailbox
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return Result{}, ErrClosed
	}
	d.calls[h.tok] = h.c
	d.wg.Add(1)
	d.mu.Unlock()
	d.started.Add(1)
	d.inflight.Add(1)
	defer func() {
		d.mu.Lock()
		delete(d.calls, h.tok)
		d.mu.Unlock()
		d.inflight.Add(-1)
		d.wg.Done()
	}()

	h.span = startHandoffSpan(ctx, &req)
	res, err := h.run(ctx, start)
	if h.span != nil {
		endHandoffSpan(h.span, &res, h.sess.Attempts(), err)
	}
	if err != nil {
		d.failed.Add(1)
		return Result{}, err
	}
	d.delivered.Add(1)
	return res, nil
}

func (h *handoff) run(ctx context.Context, start time.Time) (Result, error) {
	timer := time.NewTimer(h.deadline.Sub(start))
	defer timer.Stop()
	// The queue of actions to execute; a Step's actions are copied in at once
	// (the session reuses its slice).
	var queue [8]session.Action
	acts := append(queue[:0], h.step(session.Event{Kind: session.EvStart, Now: start})...)
	armed := h.deadline // what timer fires at
	for {
		for len(acts) > 0 {
			a := acts[0]
			acts = acts[1:]
			switch a.Kind {
			case session.ActDeliver:
				if log := h.d.cfg.Logger; log.Enabled(ctx, slog.LevelDebug) {
					log.Debug("handoff delivered", "seq", h.req.ID, "peer", h.sess.Instance())
				}
				if h.d.aff != nil {
					h.d.aff.remember(h.req.Tokens, h.req.CacheKey, h.ok.Instance)
				}
				return Result{
					FirstToken: h.ok.FirstToken, Logprobs: h.ok.Logprobs, Cached: int(h.ok.Cached), Instance: h.ok.Instance, Attempts: h.sess.Attempts(),
					Prefill: time.Duration(h.ok.PrefillNanos), Transfer: time.Duration(h.ok.WriteNanos),
					Total: time.Since(start), KVBytes: h.kvB, MambaBytes: h.mB, Drafts: h.ok.Drafts,
				}, nil
			case session.ActFail:
				err := h.failure(a.Code)
				if log := h.d.cfg.Logger; log.Enabled(ctx, slog.LevelDebug) {
					log.Debug("handoff failed", "seq", h.req.ID, "err", err)
				}
				return Result{}, err
			default:
				if ev, ok := h.exec(a); ok {
					acts = append(acts, h.step(ev)...)
				}
			}
		}
		var ev session.Event
		var early []session.Action // outcomes of events taken along with ev
		if len(h.notes) > 0 {
			early, ev = h.takeNotes()
			ev.Now = h.now()
			acts = append(append(queue[:0], early...), h.step(ev)...) // acts was drained
			armed = h.rearm(ev, armed, timer)
			continue
		}
		grantCh := h.failCh
		if h.replied {
			grantCh = h.doneCh
			// The writer commits before it replies, so the grant is usually
			// done once the reply is in: take it without the full select.
			select {
			case <-grantCh: // nil once taken: never ready
				ev = h.grantEvent()
				ev.Now = h.now()
				acts = append(queue[:0], h.step(ev)...) // acts was drained
				continue
			default:
			}
		}
		select {
		case m := <-h.c.replies:
			ev = h.replyEvent(m)
		case <-grantCh:
			ev = h.grantEvent()
		case <-h.c.died:
			notes := h.d.takeNotes(h.c)
			if len(notes) == 0 {
				continue // taken with an earlier signal
			}
			// A reply or commit already delivered came before the death or
			// loss was seen (a draining worker replies, then leaves the
			// registry): apply it first, or a handoff that succeeded would
			// fail, and act on it before the notes: a refusal's retry names
			// its instance once sent, and the refuser's death then concerns
			// nothing of this handoff (applied before, it took the refuser
			// for the retry's server: a cancel, a new grant, an attempt).
			h.notes = notes
			if acts = append(queue[:0], h.delivered()...); len(acts) > 0 {
				continue
			}
			early, ev = h.takeNotes()
		case <-timer.C:
			// What was delivered before the tick counts before it: a
			// reply that came as a grace period ran out is not lost.
			if acts = append(queue[:0], h.delivered()...); len(acts) > 0 {
				timer.Reset(0) // the tick is taken again, after them
				armed = time.Time{}
				continue
			}
			ev = session.Event{Kind: session.EvTick}
		case <-ctx.Done():
			h.setCause(context.Cause(ctx))
			ev = session.Event{Kind: session.EvCancel, Code: session.CodeCancelled}
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				ev.Code = session.CodeTimeout
			}
		case <-h.d.done:
			ev = session.Event{Kind: session.EvCancel, Code: session.CodeClosed}
		}
		ev.Now = h.now()
		acts = append(append(queue[:0], early...), h.step(ev)...) // acts was drained
		armed = h.rearm(ev, armed, timer)
	}
}

// takeNotes steps the held notes but the last, which it returns to be
// stepped as the event, with their actions.
func (h *handoff) takeNotes() ([]session.Action, session.Event) {
	notes := h.notes
	h.notes = nil
	var acts []session.Action
	for _, n := range notes[:len(notes)-1] {
		n.Now = h.now()
		acts = append(acts, h.step(n)...)
	}
	return acts, notes[len(notes)-1]
}

// rearm sets timer for when the session wants a tick, if that moved or a
// tick was just taken (it came early), and returns what it is armed for.
func (h *handoff) rearm(ev session.Event, armed time.Time, timer *time.Timer) time.Time {
	want := h.sess.WakeAt()
	if (!want.Equal(armed) || ev.Kind == session.EvTick) && !h.sess.State().Terminal() {
		timer.Reset(time.Until(want))
		return want
	}
	return armed
}

// now reads the clock as the monotonic time since the handoff's start: half
// the cost of time.Now (one clock read, not two), and as good for the
// deadline checks, which compare monotonic readings.
func (h *handoff) now() time.Time { return h.start.Add(time.Since(h.start)) }

// grantEvent is the event of the grant's end (h.doneCh or h.failCh closed).
func (h *handoff) grantEvent() session.Event {
	h.doneCh, h.failCh = nil, nil
	if err := h.grant.Err(); err != nil { // failed: Done may wait on a quarantine
		h.setCause(err)
		return session.Event{Kind: session.EvGrantFailed, Code: rdmaCode(err)}
	}
	m, err := h.grant.Wait(context.Background()) // committed: returns at once
	if err != nil {
		h.setCause(err)
		return session.Event{Kind: session.EvGrantFailed, Code: rdmaCode(err)}
	}
	return session.Event{Kind: session.EvCommitted, Manifest: session.Manifest(m)}
}

// delivered steps the replies and the grant's end that are already there,
// without waiting, and returns the actions.
func (h *handoff) delivered() []session.Action {
	var acts []session.Action
	for {
		select {
		case m := <-h.c.replies:
			ev := h.replyEvent(m)
			ev.Now = time.Now()
			acts = append(acts, h.step(ev)...)
			continue
		case <-h.doneCh: // nil once taken: never ready
			ev := h.grantEvent()
			ev.Now = time.Now()
			acts = append(acts, h.step(ev)...)
			continue
		default:
		}
		return acts
	}
}

// exec performs a non-terminal action. It returns the outcome event of
// synchronous actions.
func (h *handoff) exec(a session.Action) (session.Event, bool) {
	now := h.now
	switch a.Kind {
	case session.ActOpenGrant:
		// A re-grant after a dead peer: the old grant is revoked already, and
		// what it carried (its end, an OK reply of its attempt) is dropped.
		h.grant, h.doneCh, h.failCh, h.replied, h.ok = nil, nil, nil, false, wire.PrefillReply{}
		exts := h.req.Dest.extents()
		g, err := h.d.eng.OpenGrant(rdma.GrantSpec{RequestID: h.req.ID, Extents: exts, Deadline: h.deadline})
		if err != nil {
			h.setCause(err)
			return session.Event{Kind: session.EvGranted, Now: now(), Code: rdmaCode(err)}, true
		}
		h.grant = g
		expected := make([]uint64, len(exts))
		for i, e := range exts {
			expected[i] = e.Length
		}
		h.doneCh, h.failCh = g.Done(), g.Failed()
		return session.Event{Kind: session.EvGranted, Now: now(), Expected: expected}, true
	case session.ActSendRequest:
		target, err := h.send(a)
		if err != nil {
			h.setCause(err)
			return session.Event{Kind: session.EvSent, Now: now(), Code: codeOf(err)}, true
		}
		if a.Attempt > 1 {
			h.d.retries.Add(1)
		}
		return session.Event{Kind: session.EvSent, Now: now(), Instance: target}, true
	case session.ActPublishCancel:
		subj := wire.Subject(h.d.cfg.Prefix, h.d.cfg.Namespace, wire.SubjectCancel, "")
		if a.Instance != "" {
			subj = wire.Subject(h.d.cfg.Prefix, h.d.cfg.Namespace, wire.SubjectInstanceCancel, a.Instance)
		}
		var grant uint64
		if h.grant != nil {
			grant = h.grant.Ticket().Grant
		}
		b, err := wire.EncodeCancel(wire.Cancel{RequestID: h.req.ID, Grant: grant, Code: a.Code, From: h.d.cfg.Instance})
		if err == nil {
			err = h.d.pub.Publish(subj, b)
			h.d.published.Add(1)
		}
		if err != nil { // best effort: the revoke that follows is the fence
			h.d.cfg.Logger.Warn("publish cancel", "seq", h.req.ID, "err", err)
		}
	case session.ActRevoke:
		if h.grant != nil {
			h.grant.Revoke()
			if h.grant.Quarantined() {
				h.held = h.grant.Done()
			}
		}
	}
	return session.Event{}, false
}

// send publishes the prefill request for attempt a: to the instance a names
// (the holder), else, for a retry, to a live prefill instance that has not
// refused this request, when the registry knows one; otherwise to the queue
// group.
func (h *handoff) send(a session.Action) (string, error) {
	d := h.d
	subj := d.prefillSub
	// The session names no incarnation. It names the request's Holder, when
	// set, on every attempt (RecvParams.Holder).
	target, svc := a.Instance, anyIncarnation
	if target == "" && a.Attempt == 1 && d.cfg.States != nil && d.reg != nil {
		if inst, _, ok := d.pickByState(h.req.Tokens, a.Exclude); ok {
			target, svc = inst.ID, inst.Service
			d.byState.Add(1)
		}
	}
	if target == "" && a.Attempt == 1 && d.aff != nil && d.reg != nil {
		if inst, ok := d.pickAffine(h.req.Tokens, h.req.CacheKey, a.Exclude); ok {
			target, svc = inst.ID, inst.Service
			d.byAffinity.Add(1)
		}
	}
	if target == "" && (a.Attempt > 1 || d.cfg.DirectFirst || a.Live) && d.reg != nil {
		inst := d.pick(a.Exclude)
		target, svc = inst.ID, inst.Service
	}
	if target == "" && a.Live {
		// The queue group could hand the request back to the instance reported
		// dead (it may only be partitioned): only a known live one will do.
		return "", fmt.Errorf("%w: no other live prefill instance (excluded %v)", ErrPeerFailed, a.Exclude)
	}
	if target != "" {
		subj = wire.Subject(d.cfg.Prefix, d.cfg.Namespace, wire.SubjectInstancePrefill, target)
	}
	d.mu.Lock()
	h.c.target, h.c.svc = target, svc // "" after a fall-back to the queue group: pick stops counting it
	d.mu.Unlock()
	tk := h.grant.Ticket()
	msg := wire.PrefillRequest{
		RequestID: h.req.ID, From: d.cfg.Instance, Attempt: uint8(min(a.Attempt, 255)), Fingerprint: d.cfg.Fingerprint,
		Tokens: h.req.Tokens, Sampling: h.req.Sampling, Deadline: h.deadline.UnixNano(), Budget: int64(time.Until(h.deadline)), Peer: d.peer,
		Ticket: tk, KVBytes: h.kvB, MambaBytes: h.mB, TP: wireTP(d.cfg.TP),
		Drafts: uint8(min(max(h.req.Drafts, 0), wire.MaxDrafts)),
		Skip:   uint32(max(h.req.Skip, 0)),
	}
	buf := getMsgBuf()
	b, err := wire.AppendPrefillRequest(*buf, &msg, d.maxPayload)
	if err != nil {
		putMsgBuf(buf, *buf)
		return "", err
	}
	d.published.Add(1)
	h.attempt = a.Attempt
	reply := h.reply
	if a.Attempt > 1 {
		// Each retry has a reply subject of its own, so that an answer is
		// told apart from the earlier attempts' (replyToken): a
		// no-responders names nothing else.
		reply += "-" + strconv.Itoa(a.Attempt)
	}
	err = h.publishRequest(subj, reply, b)
	putMsgBuf(buf, b) // the publisher copied it
	if err != nil {
		if errors.Is(err, nats.ErrMaxPayload) {
			return "", fmt.Errorf("%w: %w", ErrPayloadTooLarge, err)
		}
		return "", fmt.Errorf("%w: publish: %w", ErrClosed, err)
	}
	return target, nil
}

// pick chooses the live prefill instance with the same layout, not draining
// and not in exclude, with the least load: the requests it announced in flight (as of its
// last heartbeat) plus the ones this decoder addressed to it since. Ties go
// round-robin, so a burst between two heartbeats spreads out. It returns
// the instance's registry entry, or the zero Instance when none will do.
func (d *Decoder) pick(exclude []string) wire.Instance {
	insts := d.reg.Instances(wire.RolePrefill, time.Now())
	if len(insts) == 0 {
		return wire.Instance{}
	}
	mine, gone := d.picking(len(insts))
	var target wire.Instance
	best := 0
	off := int(d.picks.Add(1))
	for i := range insts {
		inst := insts[(off+i)%len(insts)]
		if !d.usable(inst, exclude, gone) {
			continue
		}
		if load := inst.Capacity.Inflight + mine[inst.ID]; target.ID == "" || load < best {
			target, best = inst, load
		}
	}
	return target
}

// pickAffine returns the prefill instance that prefilled the longest
// remembered prefix of tokens when it is usable and has a free row (the
// cost rule in affinity.go), and whether there is one.
func (d *Decoder) pickAffine(tokens []int32, key string, exclude []string) (wire.Instance, bool) {
	id, n := d.aff.lookup(tokens, key)
	if id == "" {
		return wire.Instance{}, false
	}
	insts := d.reg.Instances(wire.RolePrefill, time.Now())
	mine, gone := d.picking(len(insts))
	for _, inst := range insts {
		if inst.ID != id {
			continue
		}
		free := inst.Capacity.Inflight+mine[id] < inst.Capacity.Rows
		if d.usable(inst, exclude, gone) && free {
			if log := d.cfg.Logger; log.Enabled(context.Background(), slog.LevelDebug) {
				log.Debug("prefill by prefix affinity", "instance", id, "prefix_tokens", n)
			}
			return inst, true
		}
	}
	return wire.Instance{}, false
}

// picking returns what pick weighs instances by: the requests this
// decoder has in flight at each, and the instances reported gone.
func (d *Decoder) picking(n int) (mine map[string]int, gone map[string]int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	mine = make(map[string]int, n)
	for _, c := range d.calls {
		if c.target != "" {
			mine[c.target]++
		}
	}
	if len(d.gone) > 0 {
		gone = maps.Clone(d.gone)
	}
	return mine, gone
}

// usable reports whether inst may serve a request that excluded exclude.
func (d *Decoder) usable(inst wire.Instance, exclude []string, gone map[string]int64) bool {
	if inst.Fingerprint != d.cfg.Fingerprint || inst.Draining || containsStr(exclude, inst.ID) {
		return false
	}
	at, ok := gone[inst.ID]
	return !ok || inst.Updated != at // reported gone, no heartbeat since
}

func containsStr(xs []string, s string) bool {
	for _, x := range xs {
		if x == s {
			return true
		}
	}
	return false
}

// replyToken splits the last token of a reply subject into the call's
// token and the attempt it answers: "tok" is attempt 1, "tok-N" attempt N.
func replyToken(s string) (tok string, attempt int) {
	i := strings.LastIndexByte(s, '-')
	if i < 0 {
		return s, 1
	}
	n, err := strconv.Atoi(s[i+1:])
	if err != nil || n < 2 {
		return s, -1 // not a subject this decoder made: no call has this token
	}
	return s[:i], n
}

func (h *handoff) replyEvent(m *nats.Msg) session.Event {
	_, attempt := replyToken(m.Subject[len(h.d.inbox)+1:])
	if attempt != h.attempt {
		// An answer to an earlier attempt: the session drops it, and
		// nothing of it may stand as this attempt's reply or cause.
		return session.Event{Kind: session.EvReply, Code: session.CodeBadMessage, Attempt: attempt}
	}
	if m.Header.Get("Status") == "503" {
		return session.Event{Kind: session.EvNoResponders, Attempt: attempt}
	}
	r, err := wire.DecodePrefillReply(m.Data)
	if h.req.Drafts <= 0 {
		// A decoder without speculation ignores draft tokens (a peer may
		// ship them unasked); one that asked for K refuses more than K.
		r.Drafts = nil
	}
	if err != nil || r.RequestID != h.req.ID || len(r.Drafts) > max(h.req.Drafts, 0) {
		if err == nil && r.RequestID != h.req.ID {
			err = fmt.Errorf("%w: reply names request %d", ErrBadMessage, r.RequestID)
		} else if err == nil {
			err = fmt.Errorf("%w: reply with %d draft tokens, %d asked for", ErrBadMessage, len(r.Drafts), h.req.Drafts)
		}
		h.setCause(err)
		return session.Event{Kind: session.EvReply, Code: session.CodeBadMessage}
	}
	if r.Code == session.CodeOK && !h.sess.Ignores(r.Instance) {
		h.ok = r
		h.replied = true
	} else {
		// Too long only while every reply was a refusal saying so: an
		// instance merely full may take the request later, and one that
		// admitted it (and then failed) holds it.
		h.fits = h.fits || !(r.Code == session.CodeCapacityRefused && r.TooLong)
		h.setCause(&RemoteError{Code: r.Code, Msg: r.Msg, Instance: r.Instance, TooLong: r.TooLong && !h.fits})
	}
	return session.Event{Kind: session.EvReply, Code: r.Code, Instance: r.Instance, Manifest: session.Manifest(r.Manifest), Attempt: attempt}
}

func (h *handoff) setCause(err error) { h.cause = err }

// failure builds the error Handoff returns for code. It wraps the most
// specific cause seen (a remote refusal, a data-plane or pool error, the
// context's) unless that cause belongs to another class (say, an earlier
// attempt's refusal behind a final no-responders): then it is only quoted,
// so that the error matches exactly one of the package's sentinels.
func (h *handoff) failure(code session.Code) error {
	err := h.failureErr(code)
	if h.held != nil {
		select {
		case <-h.held:
		default:
			return &QuarantinedError{Err: err, released: h.held}
		}
	}
	return err
}

func (h *handoff) failureErr(code session.Code) error {
	if h.cause == nil {
		return fmt.Errorf("transfer: request %d: %w", h.req.ID, codeErr(code))
	}
	if errors.Is(h.cause, codeErr(code)) {
		return fmt.Errorf("transfer: request %d: %w", h.req.ID, h.cause)
	}
	for c := session.Code(1); c < session.NumCodes; c++ {
		if c != code && errors.Is(h.cause, codeErr(c)) {
			return fmt.Errorf("transfer: request %d: %w (after: %v)", h.req.ID, codeErr(code), h.cause)
		}
	}
	return fmt.Errorf("transfer: request %d: %w: %w", h.req.ID, codeErr(code), h.cause)
}

// rdmaCode classifies a data-plane error.
func rdmaCode(err error) session.Code {
	switch {
	case err == nil:
		return session.CodeOK
	case errors.Is(err, rdma.ErrBadRequestID), errors.Is(err, rdma.ErrForbidden):
		return session.CodeDummyRequest
	case errors.Is(err, rdma.ErrDeadline), errors.Is(err, context.DeadlineExceeded):
		return session.CodeTimeout
	case errors.Is(err, rdma.ErrRevoked), errors.Is(err, rdma.ErrUnknownGrant),
		errors.Is(err, rdma.ErrStaleEpoch), errors.Is(err, rdma.ErrBadToken), errors.Is(err, context.Canceled):
		return session.CodeCancelled
	case errors.Is(err, rdma.ErrManifestMismatch):
		return session.CodeIntegrity
	case errors.Is(err, rdma.ErrOutOfRange):
		return session.CodeLayoutMismatch
	case errors.Is(err, rdma.ErrClosed):
		return session.CodeClosed
	default:
		return session.CodePeerFailed
	}
}

// step applies ev to the session and returns its actions; at debug level
// it logs the transition (the request's trace through its session).
func (h *handoff) step(ev session.Event) []session.Action {
	acts := h.sess.Step(ev)
	if log := h.d.cfg.Logger; log.Enabled(context.Background(), slog.LevelDebug) {
		log.Debug("handoff step", "seq", h.req.ID, "event", ev.Kind.String(), "code", ev.Code.String(),
			"peer", ev.Instance, "attempt", ev.Attempt, "state", h.sess.State().String(), "actions", fmt.Sprint(acts))
	}
	return acts
}
