package session

import "time"

// WriteParams configure a WriteSession from the request as received.
type WriteParams struct {
	RequestID      uint64
	MaxDraftTokens int
	Deadline       time.Time
	Fingerprint    string // the request's
	Local          string // the writer's own layout fingerprint
	KVBytes        uint64 // the destination's KV bytes
	MambaBytes     uint64 // the destination's Mamba bytes
}

// WriteSession is the writer's per-request state machine. Not safe for
// concurrent use; one driver owns it.
type WriteSession struct {
	p       WriteParams
	state   State
	code    Code
	busy    bool // ActAdmit, ActPrefill or ActWrite outstanding
	pending Code
	leased  bool

	out [2]Action // what Step returns, reused by the next Step
}

// NewWriteSession returns a session in StateNew.
func NewWriteSession(p WriteParams) *WriteSession { return &WriteSession{p: p} }

// Reset sets s up as NewWriteSession does, in place.
func (s *WriteSession) Reset(p WriteParams) { *s = WriteSession{p: p} }

// State returns the current phase.
func (s *WriteSession) State() State { return s.state }

// Code returns the code of the reply sent (CodeOK on success or while running).
func (s *WriteSession) Code() Code { return s.code }

// Step applies ev and returns the actions to execute, in order. The slice is
// the session's own: it is valid until the next Step.
func (s *WriteSession) Step(ev Event) []Action {
	if s.state.Terminal() {
		return nil
	}
	switch ev.Kind {
	case EvRequest:
		if s.state != StateNew {
			return nil
		}
		switch {
		case IsDummyID(s.p.RequestID, s.p.MaxDraftTokens):
			return s.fail(CodeDummyRequest)
		case s.p.Fingerprint != s.p.Local:
			return s.fail(CodeLayoutMismatch)
		case !ev.Now.Before(s.p.Deadline):
			return s.fail(CodeTimeout)
		}
		s.state, s.busy = StateAdmitting, true
		return s.acts(Action{Kind: ActAdmit})
	case EvAdmitted:
		if s.state != StateAdmitting || !s.busy {
			return nil
		}
		s.busy = false
		if ev.Code == CodeOK {
			s.leased = true
		}
		if s.pending != CodeOK {
			return s.fail(s.pending)
		}
		if ev.Code != CodeOK {
			return s.fail(ev.Code)
		}
		s.state, s.busy = StatePrefilling, true
		return s.acts(Action{Kind: ActPrefill})
	case EvPrefilled:
		if s.state != StatePrefilling || !s.busy {
			return nil
		}
		s.busy = false
		if s.pending != CodeOK {
			return s.fail(s.pending)
		}
		if ev.Code != CodeOK {
			return s.fail(ev.Code)
		}
		if ev.KVBytes != s.p.KVBytes || ev.MambaBytes != s.p.MambaBytes {
			return s.fail(CodeLayoutMismatch) // before any byte moves
		}
		s.state, s.busy = StateWriting, true
		return s.acts(Action{Kind: ActWrite})
	case EvWritten:
		if s.state != StateWriting || !s.busy {
			return nil
		}
		s.busy = false
		if ev.Code != CodeOK {
			if s.pending != CodeOK {
				return s.fail(s.pending)
			}
			return s.fail(ev.Code)
		}
		// The commit was accepted: the receiver holds the bytes, so a cancel that
		// raced with the write changes nothing here; the receiver decides.
		s.state = StateDone
		return s.finish(CodeOK)
	case EvTick:
		if s.state == StateNew || ev.Now.Before(s.p.Deadline) {
			return nil
		}
		return s.fail(CodeTimeout)
	case EvCancel, EvPeerDied:
		code := ev.Code
		if ev.Kind == EvPeerDied || code == CodeOK {
			code = CodeCancelled
			if ev.Kind == EvPeerDied {
				code = CodePeerFailed
			}
		}
		return s.fail(code)
	}
	return nil
}

// fail ends the session with code. While a step is in flight it aborts the
// step and waits for its outcome, so nothing is released under a running
// prefill or write.
func (s *WriteSession) fail(code Code) []Action {
	if s.busy {
		if s.pending != CodeOK {
			return nil
		}
		s.pending = code
		return s.acts(Action{Kind: ActAbort})
	}
	s.state = StateFailed
	return s.finish(code)
}

// finish releases the lease, then replies: a decoder that heard the
// reply may send its next request to this worker at once, and finds the
// resources of this one free, not refused for capacity they still held.
func (s *WriteSession) finish(code Code) []Action {
	s.code = code
	acts := s.acts()
	if s.leased {
		acts = append(acts, Action{Kind: ActRelease})
		s.leased = false
	}
	return append(acts, Action{Kind: ActReply, Code: code})
}

// acts returns as, in the session's own buffer.
func (s *WriteSession) acts(as ...Action) []Action { return append(s.out[:0], as...) }
