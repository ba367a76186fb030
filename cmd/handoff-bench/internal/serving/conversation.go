package serving

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"
)

// ConversationSpec shapes a multi-turn workload: conversations of Turns
// turns that all open with one shared system prompt. Each turn adds a short
// user message to the whole conversation so far (the system prompt, every
// earlier user message and every reply the server gave), as a chat client
// does, after the user's think time.
type ConversationSpec struct {
	Conversations int
	Turns         int
	SystemTokens  int     // the shared system prompt, in units
	TurnTokens    int     // each user message, in units (drawn with RangeRatio)
	OutputTokens  int     // max_tokens of each turn (drawn with RangeRatio)
	RangeRatio    float64 // as vLLM's --random-range-ratio
	// ThinkTime is the mean of the pause between a reply and the next
	// turn: exponential draws (a user's reading and typing time), or none
	// when 0.
	ThinkTime time.Duration
	Unit      Unit
}

// Conversation is one conversation of a workload: its user messages and,
// per turn, max_tokens, the sampling seed and the think time before it.
type Conversation struct {
	ID        int
	Users     []string        // the user message of each turn
	MaxTokens []int           // max_tokens of each turn
	Seeds     []int64         // each turn's sampling seed: the same workload samples the same replies
	Think     []time.Duration // the pause before each turn; Think[0] is 0
}

// Conversations makes spec's workload: the shared system prompt and the
// conversations. The same rng state gives the same workload.
func Conversations(spec ConversationSpec, rng *rand.Rand) (system string, convs []Conversation) {
	system = Prompt(spec.Unit, spec.SystemTokens, rng)
	inLo, inHi := LengthRange(spec.TurnTokens, spec.RangeRatio)
	outLo, outHi := LengthRange(spec.OutputTokens, spec.RangeRatio)
	convs = make([]Conversation, spec.Conversations)
	for i := range convs {
		c := Conversation{ID: i}
		for t := range spec.Turns {
			c.Users = append(c.Users, Prompt(spec.Unit, inLo+rng.IntN(inHi-inLo+1), rng))
			c.MaxTokens = append(c.MaxTokens, outLo+rng.IntN(outHi-outLo+1))
			c.Seeds = append(c.Seeds, rng.Int64())
			var think time.Duration
			if t > 0 && spec.ThinkTime > 0 {
				think = time.Duration(rng.ExpFloat64() * float64(spec.ThinkTime))
			}
			c.Think = append(c.Think, think)
		}
		convs[i] = c
	}
	return system, convs
}

// Message is one chat message.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// Turn returns the messages of turn t (from 0) of a conversation whose
// earlier turns got replies: the system prompt, then each earlier user
// message and its reply, then turn t's user message. It panics unless
// len(replies) >= t.
func Turn(system string, users, replies []string, t int) []Message {
	msgs := make([]Message, 0, 2*t+2)
	msgs = append(msgs, Message{"system", system})
	for i := range t {
		msgs = append(msgs, Message{"user", users[i]}, Message{"assistant", replies[i]})
	}
	return append(msgs, Message{"user", users[t]})
}

// RenderChat renders messages as handoff's chat template does (worker/api's
// chatPrompt): "<|role|>\n{content}\n" per message, then the generation
// prompt "<|assistant|>\n". Sent to /v1/completions it is the prompt a
// /v1/chat/completions request of the same messages has on handoff, token
// for token; for another server it is plain text that grows as a chat
// does. Rendering messages plus a reply gives a prefix of the rendering of
// the next turn: RenderChat(m) + reply is a prefix of RenderChat(m, reply,
// next user message).
func RenderChat(msgs []Message) string {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString("<|" + m.Role + "|>\n" + m.Content + "\n")
	}
	b.WriteString("<|assistant|>\n")
	return b.String()
}

// Tokens splits text into the units a workload counts tokens in: bytes
// (exact for a byte-level tokenizer), or words, each with the white space
// before it (about a token each in a BPE vocabulary: an estimate).
func Tokens(unit Unit, text string) []string {
	if unit == UnitBytes {
		out := make([]string, len(text))
		for i := range len(text) {
			out[i] = text[i : i+1]
		}
		return out
	}
	var out []string
	start := 0
	for i := 1; i <= len(text); i++ {
		if i == len(text) || (isSpace(text[i]) && !isSpace(text[i-1])) {
			out = append(out, text[start:i])
			start = i
		}
	}
	return out
}

func isSpace(c byte) bool { return c == ' ' || c == '\n' || c == '\t' || c == '\r' }

// Seen is one request of a run for the ideal-hit count, sent at Sent and
// finished at Done (offsets from one origin): its prompt, and its prompt
// followed by its reply (Seq), in units (Tokens; the two are split apart,
// since a word may run from the prompt into the reply). A request that
// failed (Failed) adds nothing: the server may never have computed it.
type Seen struct {
	Sent, Done time.Duration
	Prompt     []string
	Seq        []string
	Failed     bool
}

// IdealHits returns, for each request, the tokens of its prompt that a
// perfect prefix cache would have served: the longest prefix of the prompt
// that is also a prefix of the prompt and reply (Seq) of a request that
// finished before it was sent (a conversation's earlier turns, another
// conversation sharing the system prompt), capped at one token less than
// the prompt (the last prompt token is always computed: its logits give the
// first output token).
//
// Prefixes are compared by a chained 64-bit FNV-1a hash of their tokens:
// every prefix of every finished sequence is one set entry, so memory is
// the distinct prefixes (the size of their trie), and a collision, which
// could only add hits, has probability around n²/2⁶⁴ for n prefixes.
func IdealHits(reqs []Seen) []int {
	type event struct {
		at   time.Duration
		done bool
		i    int
	}
	evs := make([]event, 0, 2*len(reqs))
	for i, r := range reqs {
		evs = append(evs, event{r.Sent, false, i}, event{r.Done, true, i})
	}
	// By time; at a tie a request that finished counts as seen by one sent
	// at that instant (a client sends the next turn after reading the
	// reply).
	slices.SortStableFunc(evs, func(a, b event) int {
		if c := cmp.Compare(a.at, b.at); c != 0 {
			return c
		}
		if a.done != b.done {
			if a.done {
				return -1
			}
			return 1
		}
		return cmp.Compare(a.i, b.i)
	})
	seen := map[uint64]struct{}{}
	out := make([]int, len(reqs))
	for _, e := range evs {
		r := reqs[e.i]
		if e.done {
			if r.Failed {
				continue
			}
			h := hashSeed
			for _, tok := range r.Seq {
				h = hashToken(h, tok)
				seen[h] = struct{}{}
			}
			continue
		}
		n, h := 0, hashSeed
		for _, tok := range r.Prompt {
			h = hashToken(h, tok)
			if _, ok := seen[h]; !ok {
				break
			}
			n++
		}
		out[e.i] = max(0, min(n, len(r.Prompt)-1))
	}
	return out
}

const hashSeed uint64 = 14695981039346656037 // FNV-1a's offset basis

// hashToken chains tok onto the hash of the tokens before it (FNV-1a over
// the token's bytes and a separator, so that tokens "ab","c" and "a","bc"
// differ).
func hashToken(h uint64, tok string) uint64 {
	const prime = 1099511628211
	for i := range len(tok) {
		h ^= uint64(tok[i])
		h *= prime
	}
	h ^= 0xff
	h *= prime
	return h
}

// TurnRecord is one turn of a multi-turn run as measured.
type TurnRecord struct {
	Conversation int
	Turn         int // from 0
	Success      bool
	Error        string
	TTFT         time.Duration
	Latency      time.Duration // E2EL: the POST to the last chunk
	PromptTokens int           // the server's usage.prompt_tokens
	CachedTokens int           // the server's usage.prompt_tokens_details.cached_tokens
	OutputTokens int
	PromptUnits  int // the prompt in the workload's units (Tokens)
	IdealHit     int // IdealHits, in units
}

// TurnSummary sums up a set of turns (turn 1, turns >= 2, or one turn
// index).
type TurnSummary struct {
	Turns        int     `json:"turns"`
	Failed       int     `json:"failed"`
	TTFTp50      float64 `json:"ttft_p50_ms"`
	TTFTp90      float64 `json:"ttft_p90_ms"`
	TTFTMean     float64 `json:"ttft_mean_ms"`
	PromptTokens int     `json:"prompt_tokens"`
	CachedTokens int     `json:"cached_tokens"`
	// ComputedTokens are prompt_tokens − cached_tokens: what the server
	// computed.
	ComputedTokens int `json:"computed_prompt_tokens"`
	PromptUnits    int `json:"prompt_units"`
	IdealHit       int `json:"ideal_hit_tokens"`
	// SeenShare is IdealHit / PromptUnits: how much of the prompts a
	// perfect cache would serve.
	SeenShare float64 `json:"seen_before_share"`
	// HitRateVsIdeal is CachedTokens / IdealHit (0 when IdealHit is 0).
	HitRateVsIdeal float64 `json:"hit_rate_vs_ideal"`
}

// Summarize sums up the successful turns of recs that keep says to keep,
// counting the failed ones apart. Percentiles are numpy's linear ones.
func Summarize(recs []TurnRecord, keep func(TurnRecord) bool) TurnSummary {
	var s TurnSummary
	var ttfts []float64
	for _, r := range recs {
		if !keep(r) {
			continue
		}
		if !r.Success {
			s.Failed++
			continue
		}
		s.Turns++
		ttfts = append(ttfts, ms(r.TTFT))
		s.PromptTokens += r.PromptTokens
		s.CachedTokens += r.CachedTokens
		s.PromptUnits += r.PromptUnits
		s.IdealHit += r.IdealHit
	}
	slices.Sort(ttfts)
	if len(ttfts) > 0 {
		s.TTFTp50, s.TTFTp90 = PercentileSorted(ttfts, 50), PercentileSorted(ttfts, 90)
		var sum float64
		for _, v := range ttfts {
			sum += v
		}
		s.TTFTMean = sum / float64(len(ttfts))
	}
	s.ComputedTokens = s.PromptTokens - s.CachedTokens
	if s.PromptUnits > 0 {
		s.SeenShare = float64(s.IdealHit) / float64(s.PromptUnits)
	}
	if s.IdealHit > 0 {
		s.HitRateVsIdeal = float64(s.CachedTokens) / float64(s.IdealHit)
	}
	return s
}

// String is a one-line summary, for logs.
func (s TurnSummary) String() string {
	return fmt.Sprintf("%d turns (%d failed), TTFT p50 %.1f ms p90 %.1f ms, prompt %d = computed %d + cached %d, ideal %d (%.1f %% seen), hit/ideal %.1f %%",
		s.Turns, s.Failed, s.TTFTp50, s.TTFTp90, s.PromptTokens, s.ComputedTokens, s.CachedTokens, s.IdealHit,
		100*s.SeenShare, 100*s.HitRateVsIdeal)
}
