package session

import (
	"slices"
	"time"
)

// RecvParams configure a RecvSession.
type RecvParams struct {
	RequestID      uint64
	MaxDraftTokens int
	Deadline       time.Time
	MaxAttempts    int // prefill attempts a worker heard (no-responder sends are bounded by QuietWait), >= 1
	// QuietWait is how long a request the prefill queue group has no
	// responder for keeps being sent again, with a backoff, before it fails
	// with no_prefill_worker: workers restarting, or resubscribing after a
	// NATS reconnect, come back within it. 0: retried at once, like a
	// refusal, within MaxAttempts.
	QuietWait time.Duration
	// Holder, when set, is the one instance every attempt goes to: it alone
	// has what is asked for (a state pulled from the decode instance that
	// holds it). When its subject has no subscriber (it restarted, or its
	// server is not subscribed yet) nobody else can serve, so it is asked
	// again after the quiet backoff, within QuietWait, never at once.
	Holder string
}

// RecvSession is the receiver's per-request state machine. Not safe for
// concurrent use; one driver owns it.
type RecvSession struct {
	p     RecvParams
	state State
	code  Code

	busy    bool // ActOpenGrant outstanding
	pending Code // failure decided while busy
	granted bool

	attempts int
	// unheard counts the attempts no worker heard (no responder, with a
	// QuietWait): they spend no attempt of the budget, which bounds the
	// attempts a worker took and failed (spent).
	unheard     int
	outstanding bool   // a request is in flight without an answer
	target      string // instance the outstanding request was sent to ("" queue group)
	// graceFor is the instance reported gone whose reply a committed
	// request waits for until replyBy.
	graceFor string
	refused  []string // instances that refused this request or were found gone: not retried
	dead     []string // instances reported dead while serving this request: their replies are ignored
	// retryAt is when a request that found no responder is sent again
	// (zero: none pending); quiet counts those in a row since quietSince:
	// a worker that answered ends the row (see heard).
	retryAt    time.Time
	quiet      int
	quietSince time.Time
	// replyBy is when a request whose commit landed stops waiting for the
	// reply of an instance reported gone (zero: not waiting).
	replyBy time.Time

	replied        bool
	replyInstance  string
	replyManifest  Manifest
	committed      bool
	commitManifest Manifest
	expected       []uint64

	out [4]Action // what Step returns, reused by the next Step
}

// NewRecvSession returns a session in StateNew.
func NewRecvSession(p RecvParams) *RecvSession {
	s := new(RecvSession)
	s.Reset(p)
	return s
}

// Reset sets s up as NewRecvSession does, in place (a driver embeds its
// session, so reusing the driver's record reuses the session).
func (s *RecvSession) Reset(p RecvParams) {
	if p.MaxAttempts < 1 {
		p.MaxAttempts = 1
	}
	*s = RecvSession{p: p}
}

// State returns the current phase.
func (s *RecvSession) State() State { return s.state }

// Code returns the terminal failure code (CodeOK while running or on success).
func (s *RecvSession) Code() Code { return s.code }

// Attempts returns how many prefill requests were sent.
func (s *RecvSession) Attempts() int { return s.attempts }

// Instance returns the instance that replied successfully, if any.
func (s *RecvSession) Instance() string { return s.replyInstance }

// WakeAt returns when the session next wants an EvTick: the earliest of its
// deadline, the time a request no responder took is sent again, and the end
// of the grace for a late reply. The driver arms its timer at WakeAt after
// every Step; a tick that comes early does nothing.
func (s *RecvSession) WakeAt() time.Time {
	at := s.p.Deadline
	for _, t := range [...]time.Time{s.retryAt, s.replyBy} {
		if !t.IsZero() && t.Before(at) {
			at = t
		}
	}
	return at
}

// lateReplyGrace is how long a request whose commit landed waits for the
// reply of an instance reported gone: a draining worker replies, then
// leaves the registry, and the two reach the decoder by different paths.
const lateReplyGrace = time.Second

// Backoff between sends that found no responder: prefill workers may be
// restarting, or not yet resubscribed after a NATS reconnect; the request
// waits for them within its deadline rather than fail at once.
const (
	quietFirst = 50 * time.Millisecond
	quietMax   = time.Second
)

// Step applies ev and returns the actions to execute, in order. The slice is
// the session's own: it is valid until the next Step.
func (s *RecvSession) Step(ev Event) []Action {
	if s.state.Terminal() {
		return nil
	}
	switch ev.Kind {
	case EvStart:
		if s.state != StateNew {
			return nil
		}
		if IsDummyID(s.p.RequestID, s.p.MaxDraftTokens) {
			return s.fail(CodeDummyRequest)
		}
		if !ev.Now.Before(s.p.Deadline) {
			return s.fail(CodeTimeout)
		}
		s.state, s.busy = StateGranting, true
		return s.acts(Action{Kind: ActOpenGrant})
	case EvGranted:
		if s.state != StateGranting || !s.busy {
			return nil
		}
		s.busy = false
		if ev.Code == CodeOK {
			s.granted, s.expected = true, slices.Clone(ev.Expected)
		}
		if s.pending != CodeOK {
			return s.fail(s.pending)
		}
		if ev.Code != CodeOK {
			return s.fail(ev.Code)
		}
		s.state = StateWaiting
		return s.send("")
	case EvSent:
		if s.state != StateWaiting || !s.outstanding {
			return nil
		}
		if ev.Code == CodeOK { // the request left for ev.Instance ("" queue group)
			s.target = ev.Instance
			return nil
		}
		s.outstanding = false
		return s.fail(ev.Code)
	case EvNoResponders:
		if s.state != StateWaiting || !s.outstanding || s.stale(ev) {
			return nil
		}
		s.outstanding = false
		if s.p.QuietWait > 0 {
			// No worker heard it: the attempt is not spent. Sends that
			// find no responder are bounded by QuietWait (and each
			// instance asked directly, but the holder, is asked once), not
			// by the budget that a worker's real failures draw on.
			s.unheard++
		}
		if (s.target != "" && s.target != s.p.Holder) || s.p.QuietWait <= 0 {
			if s.target != "" && !slices.Contains(s.refused, s.target) {
				// Its subject has no subscriber: it is gone, or it is
				// resubscribing after a reconnect; not asked again.
				s.refused = append(s.refused, s.target)
			}
			// Another instance may serve it now; nothing was written.
			if !s.committed && s.spent() < s.p.MaxAttempts && ev.Now.Before(s.p.Deadline) {
				return s.send("")
			}
			if s.p.QuietWait <= 0 {
				return s.fail(CodeNoPrefillWorker)
			}
			// Out of attempts: the quiet wait below sends it again, to an
			// instance not asked yet or to the queue group (instances
			// that had no subscriber may have one again).
		}
		// Nobody serves the request right now (the queue group, or the
		// holder, which alone can). Nothing was written, so sending again
		// is safe: after a backoff, for up to QuietWait and while the
		// deadline allows.
		if s.quiet == 0 {
			s.quietSince = ev.Now
		}
		at := ev.Now.Add(min(quietFirst<<min(s.quiet, 5), quietMax))
		if s.committed || !at.Before(s.p.Deadline) || at.Sub(s.quietSince) > s.p.QuietWait {
			return s.fail(CodeNoPrefillWorker)
		}
		s.quiet++
		s.retryAt = at
		return nil
	case EvReply:
		if s.state != StateWaiting || !s.outstanding || s.stale(ev) {
			return nil // duplicate or unsolicited reply, or one to an earlier attempt
		}
		if s.Ignores(ev.Instance) {
			return nil // a late reply of an attempt abandoned when its instance was reported dead
		}
		s.outstanding = false
		s.heard()
		switch ev.Code {
		case CodeOK:
			s.replied, s.replyInstance, s.replyManifest = true, ev.Instance, ev.Manifest
			return s.maybeAccept()
		case CodeCapacityRefused:
			if ev.Instance != "" && !slices.Contains(s.refused, ev.Instance) {
				s.refused = append(s.refused, ev.Instance)
			}
			return s.retryOr(ev.Now, CodeCapacityRefused)
		case CodePeerFailed, CodeClosed:
			if ev.Instance != "" {
				// peer_failed: the worker's write failed on the data
				// path (its connection went mid-write): the news a grant
				// failed by that connection brings, which may arrive
				// later or never (the reset reached one end only).
				// closed: the worker's drain ran out of time and aborted
				// the request, maybe mid-write. Either way retry fenced,
				// on another instance where there is one: the worker
				// replied, so it lives, and may take the retry when it
				// is the only one.
				return s.regrantOr(ev.Now, ev.Instance, false)
			}
			return s.fail(ev.Code)
		default:
			return s.fail(ev.Code)
		}
	case EvCommitted:
		if s.state != StateWaiting || s.committed {
			return nil
		}
		s.committed, s.commitManifest = true, ev.Manifest
		return s.maybeAccept()
	case EvGrantFailed:
		if s.state != StateWaiting {
			return nil
		}
		code := ev.Code
		if code == CodeOK {
			code = CodePeerFailed
		}
		if code == CodePeerFailed && s.outstanding {
			s.heard() // a writer took the request
			// The writer's connection went mid-write (it died, or will be
			// taken for dead): retry fenced on another instance, as when
			// its death is reported first. A request sent to the queue
			// group does not know its writer; its retry goes to the group
			// again, where a dead worker no longer listens. A layer-wise
			// writer holds its grant for the whole prefill, so its death
			// reaches the grant before the control plane as often as not.
			// The writer is not taken for dead on this news alone (a
			// reset connection, a restarted link): it is excluded where
			// another instance can serve, and its death, if it died,
			// comes as EvPeerDied.
			return s.regrantOr(ev.Now, s.target, false)
		}
		return s.fail(code)
	case EvTick:
		if s.state == StateNew {
			return nil
		}
		if !ev.Now.Before(s.p.Deadline) {
			return s.fail(CodeTimeout)
		}
		if !s.replyBy.IsZero() && !ev.Now.Before(s.replyBy) && s.state == StateWaiting {
			// The reply of the instance reported gone never came: its
			// bytes are here, its first token is not. Another instance
			// prefills the request again into a fresh grant.
			s.replyBy = time.Time{}
			return s.regrantOr(ev.Now, s.graceFor, true)
		}
		if !s.retryAt.IsZero() && !ev.Now.Before(s.retryAt) && s.state == StateWaiting && !s.outstanding {
			return s.send("")
		}
		return nil
	case EvCancel:
		if s.state == StateNew {
			return s.fail(CodeCancelled)
		}
		code := ev.Code
		if code == CodeOK {
			code = CodeCancelled
		}
		return s.fail(code)
	case EvLost:
		// Only a request still unanswered can have been lost; one sent to
		// another instance than the one that lost its connection was not.
		if s.state != StateWaiting || !s.outstanding || ev.Instance != "" && s.target != "" && s.target != ev.Instance {
			return nil
		}
		return s.resend(ev.Now)
	case EvPeerDied:
		if s.state != StateWaiting || ev.Instance == "" {
			return nil
		}
		if !s.replyBy.IsZero() && s.graceFor == ev.Instance {
			// Its death was told already (a registry delete, then its
			// writer gone): the grace for its reply runs, and a commit
			// that landed is not thrown away before it ends.
			return nil
		}
		// A request sent to the queue group names no instance until its
		// reply. After a failed write on the only instance, the fenced
		// retry goes to the group, which may hand it back to that very
		// instance (excluded, not dead): when it then dies, dropping the
		// news would leave the request waiting out its deadline, holding
		// its blocks and row. So the death of an instance this request
		// excluded is taken as the serving instance's: the retry is fenced
		// like any other. Any other instance's death is not: the group
		// serves most first attempts, and one death must not re-grant
		// every request in flight at it.
		serving := s.outstanding && (s.target == ev.Instance ||
			s.target == "" && slices.Contains(s.refused, ev.Instance) && !slices.Contains(s.dead, ev.Instance))
		if serving && s.committed && s.replyBy.IsZero() {
			// Its bytes are all here; its reply may be on the way still.
			s.replyBy, s.graceFor = ev.Now.Add(lateReplyGrace), ev.Instance
			return nil
		}
		if serving || (s.replied && s.replyInstance == ev.Instance) {
			return s.regrantOr(ev.Now, ev.Instance, true)
		}
		return nil
	}
	return nil
}

// heard ends a row of no-responders: a worker answered, so a no-responders
// later on (workers restarting again) opens a quiet window of its own
// rather than count against one long past.
func (s *RecvSession) heard() { s.quiet, s.quietSince = 0, time.Time{} }

// spent is the attempts of the budget used: those sent that a worker heard.
func (s *RecvSession) spent() int { return s.attempts - s.unheard }

// stale reports whether ev answers an attempt before the last one sent.
func (s *RecvSession) stale(ev Event) bool { return ev.Attempt != 0 && ev.Attempt != s.attempts }

// Ignores reports whether a reply from instance is ignored: it was reported
// dead while serving this request (its late replies must not count).
func (s *RecvSession) Ignores(instance string) bool {
	return instance != "" && slices.Contains(s.dead, instance)
}

func (s *RecvSession) send(target string) []Action {
	s.retryAt = time.Time{}
	s.attempts++
	if s.p.Holder != "" {
		target = s.p.Holder
	}
	s.outstanding, s.target = true, target
	return s.acts(Action{Kind: ActSendRequest, Instance: target, Attempt: s.attempts, Exclude: slices.Clone(s.refused),
		Live: len(s.dead) > 0})
}

// acts returns as, in the session's own buffer.
func (s *RecvSession) acts(as ...Action) []Action { return append(s.out[:0], as...) }

// regrantOr retries after the instance serving this request failed it,
// where the deadline and attempt budget allow; otherwise it fails with
// peer_failed. The instance may only be partitioned and still writing, so
// the retry is fenced: the current grant is revoked first (no byte of the
// old ticket lands after Revoke), a fresh grant is opened over the same
// destination, and the instance is excluded (another one serves the retry
// where the driver knows one). When it was reported dead (gone), its
// replies are also ignored from then on and the retry goes only to a live
// instance, never to the queue group; when its write failed (failed, not
// gone), the queue group may hand the retry back to it, fenced. A commit
// already accepted from it is forgotten with its grant: without the reply
// that carries the first token it cannot be delivered, and the new attempt
// overwrites every byte it covered.
func (s *RecvSession) regrantOr(now time.Time, failed string, gone bool) []Action {
	if s.spent() >= s.p.MaxAttempts || !now.Before(s.p.Deadline) {
		return s.fail(CodePeerFailed)
	}
	s.replyBy, s.graceFor = time.Time{}, "" // a grace is the old attempt's
	acts := s.out[:0]
	if s.outstanding {
		acts = append(acts, Action{Kind: ActPublishCancel, Instance: s.target, Code: CodePeerFailed})
		s.outstanding = false
	}
	if gone && failed != "" && !slices.Contains(s.dead, failed) {
		s.dead = append(s.dead, failed)
	}
	if failed != "" && !slices.Contains(s.refused, failed) {
		s.refused = append(s.refused, failed)
	}
	s.replied, s.replyInstance, s.replyManifest = false, "", Manifest{}
	s.committed, s.commitManifest = false, Manifest{}
	s.granted, s.expected = false, nil
	s.state, s.busy = StateGranting, true
	return append(acts, Action{Kind: ActRevoke}, Action{Kind: ActOpenGrant})
}

// resend sends the outstanding request again after a control connection
// dropped, where the deadline and attempt budget allow (otherwise it keeps
// waiting: the request may not have been lost). The serving instance is
// alive, so it is neither excluded nor ignored, but the retry is fenced as
// after a death: the old attempt is cancelled, its grant revoked (no byte of
// its ticket lands after that, and its late reply answers a stale attempt),
// and a fresh grant opened over the same destination.
func (s *RecvSession) resend(now time.Time) []Action {
	if s.spent() >= s.p.MaxAttempts || !now.Before(s.p.Deadline) {
		return nil
	}
	s.replyBy, s.graceFor = time.Time{}, "" // a grace is the old attempt's
	acts := append(s.out[:0], Action{Kind: ActPublishCancel, Instance: s.target, Code: CodeCancelled})
	s.outstanding = false
	s.replied, s.replyInstance, s.replyManifest = false, "", Manifest{}
	s.committed, s.commitManifest = false, Manifest{}
	s.granted, s.expected = false, nil
	s.state, s.busy = StateGranting, true
	return append(acts, Action{Kind: ActRevoke}, Action{Kind: ActOpenGrant})
}

// retryOr retries where that is safe (nothing was written: no commit seen, the
// refusal came before admission) and the deadline and attempt budget allow.
func (s *RecvSession) retryOr(now time.Time, code Code) []Action {
	if !s.committed && s.spent() < s.p.MaxAttempts && now.Before(s.p.Deadline) {
		return s.send("")
	}
	return s.fail(code)
}

func (s *RecvSession) maybeAccept() []Action {
	if !s.replied || !s.committed {
		return nil
	}
	if !manifestsAgree(s.replyManifest, s.commitManifest, s.expected) {
		return s.fail(CodeIntegrity)
	}
	s.state = StateDone
	return s.acts(Action{Kind: ActRevoke}, Action{Kind: ActDeliver})
}

func manifestsAgree(reply, commit Manifest, expected []uint64) bool {
	return slices.Equal(reply.Bytes, commit.Bytes) && slices.Equal(reply.CRC, commit.CRC) &&
		slices.Equal(commit.Bytes, expected) && len(commit.CRC) == len(expected)
}

// fail moves to StateFailed with code, or, while a local step is in flight,
// remembers code until the step's outcome arrives (a grant being opened
// must be known before it can be revoked).
func (s *RecvSession) fail(code Code) []Action {
	if s.busy {
		if s.pending == CodeOK {
			s.pending = code
		}
		return nil
	}
	acts := s.out[:0]
	if s.outstanding {
		acts = append(acts, Action{Kind: ActPublishCancel, Instance: s.target, Code: code})
		s.outstanding = false
	}
	if s.granted {
		acts = append(acts, Action{Kind: ActRevoke})
	}
	s.state, s.code = StateFailed, code
	return append(acts, Action{Kind: ActFail, Code: code})
}
