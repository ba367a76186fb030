package api

// Streamed responses: server-sent events, opened once a request's first
// event came or StreamGrace passed.

import (
	"context"
	"log/slog"
	"net/http"
	"unicode/utf8"

	"github.com/handoff-io/handoff/worker"
)

// awaitFirst waits up to Config.StreamGrace for a streamed request's first
// event: one that ends the request with an error is answered as a plain
// response would be (false), and any other is held for the stream to
// send first. false too when the client left.
func (s *server) awaitFirst(r *http.Request, out *writer, stream events) (events, bool) {
	if s.cfg.StreamGrace < 0 {
		return stream, true
	}
	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.StreamGrace)
	defer cancel()
	ev, err := stream.Next(ctx)
	switch {
	case err != nil && r.Context().Err() != nil:
		return nil, false // the client left; the request is cancelled with it
	case err != nil:
		return stream, true // nothing yet: the stream opens
	case ev.Done && ev.Err != nil:
		status, e := schedulerError(ev.Err)
		out.json(status, map[string]*apiError{"error": e})
		return nil, false
	}
	return &heldEvents{first: &ev, events: stream}, true
}

// heldEvents is a stream whose first event was read already (awaitFirst).
type heldEvents struct {
	first *worker.Output
	events
}

func (h *heldEvents) Next(ctx context.Context) (worker.Output, error) {
	if ev := h.first; ev != nil {
		h.first = nil
		return *ev, nil
	}
	return h.events.Next(ctx)
}

// openStream opens a streamed response once awaitFirst let it (false: the
// request was answered, or the client left): the event-stream headers,
// flushed, so that the client sees a live stream while a request past
// StreamGrace waits for its first token.
func (s *server) openStream(r *http.Request, out *writer, stream events) (events, bool) {
	stream, ok := s.awaitFirst(r, out, stream)
	if !ok {
		return nil, false
	}
	h := out.w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	out.w.WriteHeader(http.StatusOK)
	out.arm()
	out.err = out.rc.Flush()
	return stream, true
}

// streamCompletion writes the stream as server-sent events.
func (s *server) streamCompletion(r *http.Request, out *writer, log *slog.Logger, id string, created int64,
	c completionReq, stream events) {
	stream, ok := s.openStream(r, out, stream)
	if !ok {
		return
	}
	chunk := func(text string, lp *logprobs, finish any) map[string]any {
		var lpOut any
		if lp != nil {
			lpOut = lp
		}
		m := map[string]any{
			"id": id, "object": "text_completion", "created": created, "model": s.cfg.Model,
			"choices": []any{map[string]any{"text": text, "index": 0, "logprobs": lpOut, "finish_reason": finish}},
		}
		if c.includeUsage {
			m["usage"] = nil
		}
		return m
	}
	newLP := func() *logprobs {
		if c.logprobs < 0 {
			return nil
		}
		return &logprobs{TextOffset: []int{}, Tokens: []string{}, TokenLogprobs: []float32{}}
	}
	offset := 0
	if c.echo {
		if !out.send(chunk(c.promptText, nil, nil)) {
			log.Debug("stream write failed; the request is cancelled with the connection", "err", out.err)
			return
		}
		offset = len(c.promptText)
	}
	var utf utf8Holder
	lp := newLP()
	for {
		ev, err := stream.Next(r.Context())
		if err != nil {
			return // the client left; the request is cancelled with it
		}
		if !ev.Done {
			lp.add(ev, offset, c.logprobs)
			offset += len(ev.Text)
			text := utf.push(ev.Text)
			if text == "" {
				continue // held: part of a character, sent with the rest of it
			}
			if !out.send(chunk(text, lp, nil)) {
				log.Debug("stream write failed; the request is cancelled with the connection", "err", out.err)
				return
			}
			lp = newLP()
			continue
		}
		if ev.Err != nil {
			if r.Context().Err() == nil {
				_, e := schedulerError(ev.Err)
				out.send(map[string]any{"error": e})
				out.event([]byte("[DONE]"))
			}
			return
		}
		if !out.send(chunk(utf.flush(), lp, ev.Finish)) {
			return
		}
		if c.includeUsage {
			m := chunk("", nil, nil)
			m["choices"], m["usage"] = []any{}, usage(len(c.prompt), ev, false)
			out.send(m)
		}
		out.event([]byte("[DONE]"))
		return
	}
}

// utf8Holder turns token texts into text chunks, holding back the bytes of
// a character split across tokens.
type utf8Holder struct{ pending []byte }

func (u *utf8Holder) push(b string) string {
	if b == "" {
		return ""
	}
	u.pending = append(u.pending, b...)
	// Emit everything except an incomplete final character.
	cut := len(u.pending)
	for i := len(u.pending) - 1; i >= 0 && i >= len(u.pending)-utf8.UTFMax; i-- {
		if utf8.RuneStart(u.pending[i]) {
			if !utf8.FullRune(u.pending[i:]) {
				cut = i
			}
			break
		}
	}
	out := string(u.pending[:cut])
	u.pending = append(u.pending[:0], u.pending[cut:]...)
	return out
}

func (u *utf8Holder) flush() string {
	out := string(u.pending)
	u.pending = u.pending[:0]
	return out
}
