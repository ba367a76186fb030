package serving

import (
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestConversations(t *testing.T) {
	spec := ConversationSpec{Conversations: 5, Turns: 4, SystemTokens: 300, TurnTokens: 40, OutputTokens: 20,
		RangeRatio: 0.5, ThinkTime: time.Second, Unit: UnitBytes}
	sys, convs := Conversations(spec, rand.New(rand.NewPCG(1, 2)))
	sys2, convs2 := Conversations(spec, rand.New(rand.NewPCG(1, 2)))
	require.Equal(t, sys, sys2, "the same seed, the same workload")
	require.Equal(t, convs, convs2)
	require.Len(t, sys, 300, "bytes: exactly the units asked for")
	require.Len(t, convs, 5)
	inLo, inHi := LengthRange(40, 0.5)
	outLo, outHi := LengthRange(20, 0.5)
	var thinks int
	for i, c := range convs {
		require.Equal(t, i, c.ID)
		require.Len(t, c.Users, 4)
		require.Len(t, c.MaxTokens, 4)
		require.Len(t, c.Seeds, 4)
		require.Len(t, c.Think, 4)
		require.Zero(t, c.Think[0], "the first turn starts at the conversation's arrival")
		for tt := range 4 {
			require.GreaterOrEqual(t, len(c.Users[tt]), inLo)
			require.LessOrEqual(t, len(c.Users[tt]), inHi)
			require.GreaterOrEqual(t, c.MaxTokens[tt], outLo)
			require.LessOrEqual(t, c.MaxTokens[tt], outHi)
			if tt > 0 && c.Think[tt] > 0 {
				thinks++
			}
		}
	}
	require.Equal(t, 5*3, thinks, "every later turn waits")
	_, convs = Conversations(ConversationSpec{Conversations: 2, Turns: 3, SystemTokens: 10, TurnTokens: 5,
		OutputTokens: 5, Unit: UnitWords}, rand.New(rand.NewPCG(1, 2)))
	for _, c := range convs {
		require.Equal(t, []time.Duration{0, 0, 0}, c.Think, "no think time asked")
		for _, u := range c.Users {
			require.Len(t, strings.Fields(u), 5, "words: the units asked for")
		}
	}
}

func TestRenderChatIsHandoffTemplateAndGrowsByAppending(t *testing.T) {
	users := []string{"hello", "and then?", "thanks"}
	replies := []string{"hi there", "nothing"}
	require.Equal(t, "<|system|>\nbe brief\n<|user|>\nhello\n<|assistant|>\n",
		RenderChat(Turn("be brief", users, replies, 0)))
	require.Equal(t, []Message{{"system", "be brief"}, {"user", "hello"}, {"assistant", "hi there"}, {"user", "and then?"}},
		Turn("be brief", users, replies, 1))
	for tt := range 2 {
		before := RenderChat(Turn("be brief", users, replies, tt)) + replies[tt]
		after := RenderChat(Turn("be brief", users, replies, tt+1))
		require.True(t, strings.HasPrefix(after, before), "turn %d: %q is not a prefix of %q", tt, before, after)
	}
}

func TestTokens(t *testing.T) {
	tests := []struct {
		unit Unit
		text string
		want []string
	}{
		{UnitBytes, "", []string{}},
		{UnitBytes, "ab c", []string{"a", "b", " ", "c"}},
		{UnitWords, "", nil},
		{UnitWords, "the cat", []string{"the", " cat"}},
		{UnitWords, "the  cat\nsat ", []string{"the", "  cat", "\nsat", " "}},
		{UnitWords, "<|user|>\nhello\n", []string{"<|user|>", "\nhello", "\n"}},
	}
	for _, tt := range tests {
		got := Tokens(tt.unit, tt.text)
		require.Equal(t, tt.want, got, "%s %q", tt.unit, tt.text)
		require.Equal(t, tt.text, strings.Join(got, ""), "the units cover the text")
	}
}

func TestIdealHits(t *testing.T) {
	b := func(s string) []string { return Tokens(UnitBytes, s) }
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	tests := []struct {
		name string
		reqs []Seen
		want []int
	}{
		{"one request sees nothing", []Seen{{Sent: 0, Done: ms(5), Prompt: b("sys u1"), Seq: b("sys u1" + " r1")}}, []int{0}},
		{"the next turn sees the prompt and the reply", []Seen{
			{Sent: 0, Done: ms(5), Prompt: b("sys u1"), Seq: b("sys u1" + " r1")},
			{Sent: ms(9), Done: ms(15), Prompt: b("sys u1 r1 u2"), Seq: b("sys u1 r1 u2" + " r2")},
			{Sent: ms(20), Done: ms(25), Prompt: b("sys u1 r1 u2 r2 u3"), Seq: b("sys u1 r1 u2 r2 u3" + "x")},
		}, []int{0, len("sys u1 r1"), len("sys u1 r1 u2 r2")}},
		{"a reply the client changed is seen up to the change", []Seen{
			{Sent: 0, Done: ms(5), Prompt: b("sys u1"), Seq: b("sys u1" + " r1!")},
			{Sent: ms(9), Done: ms(15), Prompt: b("sys u1 r1? u2"), Seq: b("sys u1 r1? u2" + "")},
		}, []int{0, len("sys u1 r1")}},
		{"in flight together: nothing seen", []Seen{
			{Sent: 0, Done: ms(10), Prompt: b("system a"), Seq: b("system a" + "x")},
			{Sent: ms(1), Done: ms(11), Prompt: b("system b"), Seq: b("system b" + "y")},
		}, []int{0, 0}},
		{"conversations share the system prompt", []Seen{
			{Sent: 0, Done: ms(10), Prompt: b("system a"), Seq: b("system a" + "x")},
			{Sent: ms(10), Done: ms(20), Prompt: b("system b"), Seq: b("system b" + "y")},
			{Sent: ms(30), Done: ms(40), Prompt: b("system ax more"), Seq: b("system ax more" + "z")},
		}, []int{0, len("system "), len("system ax")}},
		{"the longest of several matches", []Seen{
			{Sent: 0, Done: ms(1), Prompt: b("abc"), Seq: b("abc" + "d")},
			{Sent: ms(2), Done: ms(3), Prompt: b("abx"), Seq: b("abx" + "yz")},
			{Sent: ms(4), Done: ms(5), Prompt: b("abxyq"), Seq: b("abxyq" + "")},
		}, []int{0, 2, 4}},
		{"a prompt seen whole computes its last token", []Seen{
			{Sent: 0, Done: ms(1), Prompt: b("abcdef"), Seq: b("abcdef" + "gh")},
			{Sent: ms(2), Done: ms(3), Prompt: b("abcdef"), Seq: b("abcdef" + "gh")},
			{Sent: ms(4), Done: ms(5), Prompt: b("abcdefgh"), Seq: b("abcdefgh" + "")},
			{Sent: ms(6), Done: ms(7), Prompt: b("abc"), Seq: b("abc" + "")},
		}, []int{0, 5, 7, 2}},
		{"a failed request adds nothing", []Seen{
			{Sent: 0, Done: ms(1), Prompt: b("abcdef"), Seq: b("abcdef" + ""), Failed: true},
			{Sent: ms(2), Done: ms(3), Prompt: b("abcdef"), Seq: b("abcdef" + "")},
		}, []int{0, 0}},
		{"done at the instant of the next send counts", []Seen{
			{Sent: 0, Done: ms(5), Prompt: b("abcd"), Seq: b("abcd" + "e")},
			{Sent: ms(5), Done: ms(9), Prompt: b("abcdef"), Seq: b("abcdef" + "")},
		}, []int{0, 5}},
		{"order of the slice does not matter, times do", []Seen{
			{Sent: ms(5), Done: ms(9), Prompt: b("abcdef"), Seq: b("abcdef" + "")},
			{Sent: 0, Done: ms(5), Prompt: b("abcd"), Seq: b("abcd" + "e")},
		}, []int{5, 0}},
		{"token boundaries count, not bytes", []Seen{
			{Sent: 0, Done: ms(1), Prompt: []string{"ab", "c"}, Seq: []string{"ab", "c"}},
			{Sent: ms(2), Done: ms(3), Prompt: []string{"a", "bc", "d"}, Seq: []string{"a", "bc", "d"}},
			{Sent: ms(4), Done: ms(5), Prompt: []string{"ab", "c", "d"}, Seq: []string{"ab", "c", "d"}},
		}, []int{0, 0, 2}},
		{"words: a word running from the prompt into the reply", []Seen{
			{Sent: 0, Done: ms(1), Prompt: Tokens(UnitWords, "sys\n"), Seq: Tokens(UnitWords, "sys\nhi there")},
			{Sent: ms(2), Done: ms(3), Prompt: Tokens(UnitWords, "sys\nhi there\nmore"), Seq: nil},
		}, []int{0, 3}},
		{"an empty prompt", []Seen{{Sent: 0, Done: ms(1)}, {Sent: ms(2), Done: ms(3)}}, []int{0, 0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			require.Equal(t, tt.want, IdealHits(tt.reqs))
		})
	}
}

// A whole workload through IdealHits, turns in sequence: every turn after
// the first sees the conversation so far, and every first turn after the
// first conversation sees the shared system prompt and the user header.
func TestIdealHitsOfAWorkload(t *testing.T) {
	spec := ConversationSpec{Conversations: 3, Turns: 4, SystemTokens: 500, TurnTokens: 30, OutputTokens: 20,
		Unit: UnitBytes}
	sys, convs := Conversations(spec, rand.New(rand.NewPCG(3, 4)))
	var reqs []Seen
	var prompts []string
	now := time.Duration(0)
	for _, c := range convs {
		var replies []string
		for tt := range spec.Turns {
			p := RenderChat(Turn(sys, c.Users, replies, tt))
			reply := strings.Repeat("r", c.MaxTokens[tt])
			reqs = append(reqs, Seen{Sent: now, Done: now + 1, Prompt: Tokens(UnitBytes, p), Seq: Tokens(UnitBytes, p+reply)})
			prompts = append(prompts, p)
			replies = append(replies, reply)
			now += 2
		}
	}
	hits := IdealHits(reqs)
	for i, h := range hits {
		conv, turn := i/spec.Turns, i%spec.Turns
		switch {
		case turn > 0:
			prev := reqs[i-1]
			require.Equal(t, len(prev.Seq), h, "conversation %d turn %d", conv, turn)
		case conv > 0:
			require.Equal(t, len("<|system|>\n"+sys+"\n<|user|>\n"), h, "conversation %d: the shared header", conv)
		default:
			require.Zero(t, h)
		}
		require.Less(t, h, len(prompts[i]))
	}
}

func TestSummarize(t *testing.T) {
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	recs := []TurnRecord{
		{Turn: 0, Success: true, TTFT: ms(100), PromptTokens: 100, CachedTokens: 0, PromptUnits: 100, IdealHit: 0},
		{Turn: 1, Success: true, TTFT: ms(10), PromptTokens: 200, CachedTokens: 150, PromptUnits: 200, IdealHit: 180},
		{Turn: 1, Success: true, TTFT: ms(30), PromptTokens: 220, CachedTokens: 180, PromptUnits: 220, IdealHit: 200},
		{Turn: 2, Success: true, TTFT: ms(20), PromptTokens: 300, CachedTokens: 270, PromptUnits: 300, IdealHit: 290},
		{Turn: 2, Success: false, Error: "boom"},
	}
	later := Summarize(recs, func(r TurnRecord) bool { return r.Turn >= 1 })
	require.Equal(t, 3, later.Turns)
	require.Equal(t, 1, later.Failed)
	require.InDelta(t, 20, later.TTFTp50, 1e-9)
	require.InDelta(t, 28, later.TTFTp90, 1e-9) // numpy: 20 + 0.8·(30 − 20)... of [10 20 30] at rank 1.8
	require.InDelta(t, 20, later.TTFTMean, 1e-9)
	require.Equal(t, 720, later.PromptTokens)
	require.Equal(t, 600, later.CachedTokens)
	require.Equal(t, 120, later.ComputedTokens)
	require.Equal(t, 670, later.IdealHit)
	require.InDelta(t, 670.0/720, later.SeenShare, 1e-12)
	require.InDelta(t, 600.0/670, later.HitRateVsIdeal, 1e-12)
	first := Summarize(recs, func(r TurnRecord) bool { return r.Turn == 0 })
	require.Equal(t, 1, first.Turns)
	require.InDelta(t, 100, first.TTFTp50, 1e-9)
	require.Zero(t, first.HitRateVsIdeal, "no ideal hit: no rate")
	none := Summarize(recs, func(r TurnRecord) bool { return r.Turn > 5 })
	require.Equal(t, TurnSummary{}, none)
}
