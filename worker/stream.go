package worker

import (
	"context"
	"fmt"
	"sync"

	"github.com/handoff-io/handoff/model"
)

// Output is one item of a Stream: a token, or the final event (Done).
type Output struct {
	Token int32
	// Text is the token's text, cut short when a stop sequence begins inside
	// it (the rest is never sent).
	Text string
	// Logprobs is set when the request asked for them.
	Logprobs *model.Logprobs
	Done     bool
	Err      error  // set on a failed final event
	Finish   string // on a successful final event: "stop" (EOS or a stop sequence) or "length"
	Tokens   int    // on the final event: tokens generated (EOS not counted)
	// Cached is, on the final event, how many prompt tokens were served
	// from a prefix cache (here or on the prefill worker) instead of
	// being computed: OpenAI's usage.prompt_tokens_details.cached_tokens.
	Cached int
	Timing Timing // set on the final event
}

// Stream delivers a request's tokens, then exactly one final event. The
// scheduler never waits for a reader: events queue in the stream, which grows
// with the tokens actually generated (nothing is sized by MaxTokens before
// the request runs). A reader that leaves must cancel the request's context;
// the queued events are then garbage.
type Stream struct {
	ID uint64

	ready chan struct{} // capacity 1: a pending signal is enough

	mu     sync.Mutex
	queue  []Output
	head   int
	ended  bool // the final event was pushed
	closed bool // the final event was read
}

func newStream() *Stream { return &Stream{ready: make(chan struct{}, 1)} }

// push appends ev; called by the scheduler, never blocks.
func (s *Stream) push(ev Output) {
	s.mu.Lock()
	s.queue = append(s.queue, ev)
	s.ended = s.ended || ev.Done
	s.mu.Unlock()
	select {
	case s.ready <- struct{}{}:
	default:
	}
}

// Next returns the next event, waiting for one until ctx ends. After the
// final event it returns ErrStreamEnded.
func (s *Stream) Next(ctx context.Context) (Output, error) {
	for {
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return Output{}, ErrStreamEnded
		}
		if s.head < len(s.queue) {
			ev := s.queue[s.head]
			s.queue[s.head] = Output{}
			s.head++
			if s.head == len(s.queue) {
				s.queue, s.head = s.queue[:0], 0
			}
			s.closed = ev.Done
			s.mu.Unlock()
			return ev, nil
		}
		s.mu.Unlock()
		select {
		case <-s.ready:
		case <-ctx.Done():
			return Output{}, fmt.Errorf("worker: stream: %w", context.Cause(ctx))
		}
	}
}
