package serving

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
)

// Unit is what one prompt token is taken to be when prompts are made up
// without the server's tokenizer.
type Unit string

const (
	// UnitWords makes a prompt of n common English words. Each of them,
	// with its leading space, is one token in the BPE vocabularies of the
	// usual served models (Llama 3, Qwen, GPT-style), so the prompt has about
	// n tokens there.
	UnitWords Unit = "words"
	// UnitBytes makes a prompt of n ASCII bytes: exactly n tokens for a
	// byte-level tokenizer such as handoff's.
	UnitBytes Unit = "bytes"
)

// ParseUnit accepts "words" or "bytes".
func ParseUnit(s string) (Unit, error) {
	switch u := Unit(s); u {
	case UnitWords, UnitBytes:
		return u, nil
	}
	return "", fmt.Errorf("serving: unknown token unit %q (want words or bytes)", s)
}

// Request is one prompt of the dataset and the output length asked for.
type Request struct {
	Prompt    string
	PromptLen int // the intended prompt length in tokens; the server's count replaces it in the report
	OutputLen int // max_tokens
}

// LengthRange returns the inclusive range vLLM's random dataset draws a
// length from, for a length l and a range ratio r in [0, 1):
// [floor(l·(1−r)), ceil(l·(1+r))], the lower end raised to 1. This is vLLM's
// convention; SGLang's bench_serving uses [r·l, l] instead.
func LengthRange(l int, r float64) (lo, hi int) {
	lo = int(math.Floor(float64(l) * (1 - r)))
	hi = int(math.Ceil(float64(l) * (1 + r)))
	return max(lo, 1), max(hi, 1)
}

// RandomRequests makes n requests whose prompt and output lengths are drawn
// uniformly from LengthRange(inLen, ratio) and LengthRange(outLen, ratio),
// with prompts of random words or bytes (see Unit). The same rng state gives
// the same requests.
func RandomRequests(n, inLen, outLen int, ratio float64, unit Unit, rng *rand.Rand) []Request {
	inLo, inHi := LengthRange(inLen, ratio)
	outLo, outHi := LengthRange(outLen, ratio)
	reqs := make([]Request, n)
	for i := range reqs {
		in := inLo + rng.IntN(inHi-inLo+1)
		out := outLo + rng.IntN(outHi-outLo+1)
		reqs[i] = Request{Prompt: Prompt(unit, in, rng), PromptLen: in, OutputLen: out}
	}
	return reqs
}

// Prompt returns a random prompt of n units (see Unit).
func Prompt(unit Unit, n int, rng *rand.Rand) string {
	var b strings.Builder
	switch unit {
	case UnitBytes:
		b.Grow(n + 16)
		for b.Len() < n {
			if b.Len() > 0 {
				b.WriteByte(' ')
			}
			b.WriteString(words[rng.IntN(len(words))])
		}
		return b.String()[:n]
	default:
		for i := range n {
			if i > 0 {
				b.WriteByte(' ')
			}
			b.WriteString(words[rng.IntN(len(words))])
		}
		return b.String()
	}
}

// words are common English words, each a single token (with its leading
// space) in the GPT-2, cl100k, Llama 3 and Qwen vocabularies.
var words = strings.Fields(`
the of and to in is that for it as with was on be at by this from or have an
they which one you were all we her she there would their will when who him
been has more if no out do so can what up said about other into than its time
only could new them man some these then two first may any like now my such
make over our even most me state after also made many did must before back see
through way where get much go well your know should down work year because
come people just say each those take day good how long own too little use us
very great still men here life both between old under last never place same
another think house while high right might came off find since used give
against three himself look few general hand school part small home during
number again world going without point however water city next light study
group power money story music sound river table paper garden window market
night word morning answer road letter order animal plant field country north
south east west summer winter spring voice color family friend question
`)
