package model

import "fmt"

// Drafter proposes draft tokens for speculative decoding: the tokens it
// guesses follow context (a request's prompt and the tokens generated so
// far). Draft appends at most k tokens to dst and returns it; it may
// propose fewer, or none. Drafters are pure and deterministic, and safe
// for concurrent use: what they keep between calls lives in the context.
//
// A draft is only a guess: the decode worker verifies every draft token
// against the model (Verify), so a drafter changes how many steps a
// request takes, never its output.
type Drafter interface {
	Draft(dst, context []int32, k int) []int32
}

// NgramDrafter is a model-free drafter, prompt lookup (vLLM's "ngram"
// method, with its prompt_lookup_min/max): it takes the context's last n
// tokens, for n from MaxN down to MinN, finds their most recent earlier
// occurrence in the context, and proposes the tokens that followed it.
// It needs no weights and no state: it fits text that repeats itself,
// such as code edits, summaries quoting their input, and tiny-hybrid's
// looping output.
type NgramDrafter struct {
	MinN, MaxN int
}

// DefaultNgram is the n-gram drafter the workers use: n from 4 down to 1.
var DefaultNgram = NgramDrafter{MinN: 1, MaxN: 4}

// Validate reports whether 1 <= MinN <= MaxN <= 64.
func (d NgramDrafter) Validate() error {
	if d.MinN < 1 || d.MaxN < d.MinN || d.MaxN > 64 {
		return fmt.Errorf("%w: ngram drafter n %d..%d, want 1 <= min <= max <= 64", ErrInvalidOption, d.MinN, d.MaxN)
	}
	return nil
}

// Draft implements Drafter. It costs O(len(context)·MaxN) and allocates
// nothing beyond dst's growth.
func (d NgramDrafter) Draft(dst, context []int32, k int) []int32 {
	if k <= 0 {
		return dst
	}
	n := len(context)
	for size := min(d.MaxN, n-1); size >= max(d.MinN, 1); size-- {
		suffix := context[n-size:]
		// The latest start i < n-size whose size tokens equal the suffix:
		// the occurrence that ends at the context's end is the suffix
		// itself, not a match.
		for i := n - size - 1; i >= 0; i-- {
			if !equalTokens(context[i:i+size], suffix) {
				continue
			}
			from := i + size
			return append(dst, context[from:min(from+k, n)]...)
		}
	}
	return dst
}

func equalTokens(a, b []int32) bool {
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// Accepted returns how many leading drafts the target model confirmed:
// targets[i] is the token the model picked (greedy, or sampled with the
// request's seed at that step) after the context and drafts[:i], and draft
// i is accepted while targets[i] == drafts[i]. A verification of k drafts
// then yields Accepted+1 tokens: the accepted drafts and
// targets[Accepted], the model's own token where the first draft failed
// (or after the last one).
//
// For a deterministic drafter (a point mass on each draft) accepting when
// the sampled target equals the draft is exactly the rejection-sampling
// rule: draft d is kept with probability p(d), and on rejection the token
// is distributed as p restricted to the other tokens, normalised, which
// is (p - q)+ renormalised for q a point mass on d. So the output's
// distribution, and with the same seed its tokens, are those of decoding
// without speculation.
func Accepted(drafts, targets []int32) int {
	a := 0
	for a < len(drafts) && a < len(targets) && drafts[a] == targets[a] {
		a++
	}
	return a
}
