package worker

import "strings"

// stopper ends a generation at the first of its stop sequences. It holds
// back the events whose text may begin a stop sequence, releasing them once
// they cannot, so the matched text is never emitted, in a stream either.
// Matching is on the generated text, whatever the token boundaries: an
// event the match begins inside is released with its text cut short. Pure:
// no IO, no clock.
type stopper struct {
	stops []string
	held  []Output
	text  strings.Builder // the text of held, concatenated
}

// push adds a token event and appends the events to emit now to out. match
// reports a stop sequence completed: out then ends right before it and the
// stopper is empty.
func (s *stopper) push(ev Output, out []Output) (_ []Output, match bool) {
	if len(s.stops) == 0 {
		return append(out, ev), false
	}
	s.held = append(s.held, ev)
	s.text.WriteString(ev.Text)
	text := s.text.String()
	at := -1
	for _, st := range s.stops {
		if i := strings.Index(text, st); i >= 0 && (at < 0 || i < at) {
			at = i
		}
	}
	if at >= 0 {
		off := 0
		for _, h := range s.held {
			if off >= at {
				break
			}
			n := len(h.Text)
			if off+n > at {
				h.Text = h.Text[:at-off]
			}
			out = append(out, h)
			off += n
		}
		s.held = s.held[:0]
		s.reset("")
		return out, true
	}
	// Hold back the longest tail that is a proper prefix of a stop
	// sequence: every match still possible starts inside it.
	keep := 0
	for _, st := range s.stops {
		for k := min(len(st)-1, len(text)); k > keep; k-- {
			if strings.HasSuffix(text, st[:k]) {
				keep = k
				break
			}
		}
	}
	cut := len(text) - keep
	off, n := 0, 0
	for n < len(s.held) && off+len(s.held[n].Text) <= cut {
		off += len(s.held[n].Text)
		n++
	}
	if n == 0 {
		return out, false
	}
	out = append(out, s.held[:n]...)
	s.held = append(s.held[:0], s.held[n:]...)
	s.reset(text[off:])
	return out, false
}

// flush appends every held event to out: the generation ended without a
// match.
func (s *stopper) flush(out []Output) []Output {
	out = append(out, s.held...)
	s.held = s.held[:0]
	s.reset("")
	return out
}

func (s *stopper) reset(text string) {
	s.text.Reset()
	s.text.WriteString(text)
}
