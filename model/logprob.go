package model

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"unicode/utf8"
)

// ErrInvalidLogprobs is returned by Logprobs.UnmarshalBinary for bytes that
// are not a whole number of (token, logprob) pairs.
var ErrInvalidLogprobs = errors.New("model: invalid logprobs encoding")

// MaxTopLogprobs is the most alternatives ComputeLogprobs reports.
const MaxTopLogprobs = 20

// TokenLogprob is a token and its log probability.
type TokenLogprob struct {
	Token   int32
	Logprob float32
}

// Logprobs describes one sampled position: the chosen token's log
// probability and the most likely tokens, most likely first.
type Logprobs struct {
	Chosen TokenLogprob
	Top    []TokenLogprob
}

// ComputeLogprobs returns the log probabilities of logits under
// log-softmax at temperature 1 (the model's distribution, whatever the
// sampling temperature): the chosen token's and the top ones, most likely
// first, lower index first on ties. NaN logits count as -Inf. top is clamped
// to [0, MaxTopLogprobs].
func ComputeLogprobs(logits []float32, chosen int32, top int) Logprobs {
	top = max(0, min(top, MaxTopLogprobs, len(logits)))
	m := math.Inf(-1)
	for _, l := range logits {
		if l == l && float64(l) > m {
			m = float64(l)
		}
	}
	var sum float64
	for _, l := range logits {
		if l == l {
			sum += math.Exp(float64(l) - m)
		}
	}
	lse := m + math.Log(sum)
	lp := func(i int32) float32 {
		if i < 0 || int(i) >= len(logits) || logits[i] != logits[i] {
			return float32(math.Inf(-1))
		}
		return float32(float64(logits[i]) - lse)
	}
	out := Logprobs{Chosen: TokenLogprob{Token: chosen, Logprob: lp(chosen)}}
	if top == 0 {
		return out
	}
	idx := make([]int32, len(logits))
	for i := range idx {
		idx[i] = int32(i)
	}
	slices.SortStableFunc(idx, func(a, b int32) int {
		la, lb := lp(a), lp(b)
		switch {
		case la > lb:
			return -1
		case la < lb:
			return 1
		}
		return 0
	})
	out.Top = make([]TokenLogprob, top)
	for i := range out.Top {
		out.Top[i] = TokenLogprob{Token: idx[i], Logprob: lp(idx[i])}
	}
	return out
}

// MarshalBinary encodes l as little-endian (token int32, logprob float32)
// pairs, the chosen token first: how a prefill worker sends the first
// token's logprobs to decode.
func (l Logprobs) MarshalBinary() ([]byte, error) {
	b := make([]byte, 0, 8*(1+len(l.Top)))
	for _, t := range append([]TokenLogprob{l.Chosen}, l.Top...) {
		b = binary.LittleEndian.AppendUint32(b, uint32(t.Token))
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(t.Logprob))
	}
	return b, nil
}

// UnmarshalBinary decodes MarshalBinary's encoding.
func (l *Logprobs) UnmarshalBinary(b []byte) error {
	if len(b) == 0 || len(b)%8 != 0 || len(b)/8-1 > MaxTopLogprobs {
		return fmt.Errorf("%w: %d bytes", ErrInvalidLogprobs, len(b))
	}
	pair := func(p []byte) TokenLogprob {
		return TokenLogprob{Token: int32(binary.LittleEndian.Uint32(p)),
			Logprob: math.Float32frombits(binary.LittleEndian.Uint32(p[4:]))}
	}
	*l = Logprobs{Chosen: pair(b)}
	for p := b[8:]; len(p) > 0; p = p[8:] {
		l.Top = append(l.Top, pair(p))
	}
	return nil
}

// TokenText is the text of one token: its byte for a byte token, nothing
// for a special one.
func TokenText(tok int32) string {
	if tok >= 0 && tok < 256 {
		return string([]byte{byte(tok)})
	}
	return ""
}

// TokenLabel names a token for display (logprobs): its text when it is valid
// UTF-8 on its own, "bytes:\xNN" for a lone byte of a multi-byte character,
// and "<|endoftext|>", "<|bos|>", "<|pad|>" for the specials.
func TokenLabel(tok int32) string {
	switch tok {
	case EOS:
		return "<|endoftext|>"
	case BOS:
		return "<|bos|>"
	case PAD:
		return "<|pad|>"
	}
	s := TokenText(tok)
	if s != "" && !utf8.ValidString(s) {
		return fmt.Sprintf("bytes:\\x%02x", s[0])
	}
	return s
}
