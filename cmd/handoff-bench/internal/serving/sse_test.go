package serving

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/stretchr/testify/require"
)

// events reads every event's data until EOF or an error.
func events(r io.Reader) ([]string, error) {
	s := NewSSEReader(r)
	var out []string
	for {
		d, err := s.Next()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(out, string(d))
	}
}

func TestSSEReader(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     []string
	}{
		{"openai stream", "data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n", []string{`{"a":1}`, `{"b":2}`, "[DONE]"}},
		{"crlf", "data: x\r\n\r\ndata: y\r\n\r\n", []string{"x", "y"}},
		{"no space after colon", "data:x\n\n", []string{"x"}},
		{"only one space stripped", "data:  x\n\n", []string{" x"}},
		{"multi-line data", "data: a\ndata: b\n\n", []string{"a\nb"}},
		{"comments are pings", ": ping\n\ndata: x\n: another\n\n", []string{"x"}},
		{"other fields ignored", "event: message\nid: 7\nretry: 10\ndata: x\n\n", []string{"x"}},
		{"event without data is not dispatched", "event: x\n\n\n\ndata: y\n\n", []string{"y"}},
		{"empty data is an event", "data\n\ndata:\n\n", []string{"", ""}},
		{"trailing data without blank line", "data: a\n\ndata: [DONE]", []string{"a", "[DONE]"}},
		{"trailing data with one newline", "data: a\n", []string{"a"}},
		{"empty stream", "", nil},
		{"data with colons", "data: {\"t\":\"a:b\"}\n\n", []string{`{"t":"a:b"}`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := events(strings.NewReader(tc.in))
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
			got, err = events(iotest.OneByteReader(strings.NewReader(tc.in)))
			require.NoError(t, err)
			require.Equal(t, tc.want, got, "one byte at a time")
		})
	}
}

func TestSSEReaderLimits(t *testing.T) {
	long := "data: " + strings.Repeat("x", MaxEventBytes+1) + "\n\n"
	_, err := events(strings.NewReader(long))
	require.ErrorIs(t, err, ErrEventTooLarge)
	many := strings.Repeat("data: "+strings.Repeat("y", 1<<20)+"\n", 5) + "\n"
	_, err = events(strings.NewReader(many))
	require.ErrorIs(t, err, ErrEventTooLarge)
	big := "data: " + strings.Repeat("z", 100<<10) + "\n\n" // longer than the reader's buffer
	got, err := events(strings.NewReader(big))
	require.NoError(t, err)
	require.Len(t, got, 1)
	require.Len(t, got[0], 100<<10)

	broken := errors.New("connection reset")
	_, err = events(io.MultiReader(strings.NewReader("data: a\n\ndata: b"), iotest.ErrReader(broken)))
	require.ErrorIs(t, err, broken)
}

func TestParseChunk(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     Chunk
		token    bool
		err      bool
	}{
		{"token", `{"choices":[{"text":"hi","index":0,"finish_reason":null}]}`, Chunk{HasChoices: true, Text: "hi"}, true, false},
		{"empty text token", `{"choices":[{"text":""}]}`, Chunk{HasChoices: true}, true, false},
		{"last token with finish", `{"choices":[{"text":"!","finish_reason":"length"}]}`,
			Chunk{HasChoices: true, Text: "!", FinishReason: "length"}, true, false},
		{"handoff end marker with usage", `{"choices":[{"text":"","finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}`,
			Chunk{HasChoices: true, FinishReason: "length", Usage: &Usage{PromptTokens: 5, CompletionTokens: 3}}, false, false},
		{"vLLM usage chunk", `{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}`, Chunk{Usage: &Usage{PromptTokens: 5, CompletionTokens: 3}}, false, false},
		{"cached tokens", `{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4,"audio_tokens":0}}}`,
			Chunk{Usage: &Usage{PromptTokens: 5, CompletionTokens: 3, PromptTokensDetails: &PromptTokensDetails{CachedTokens: 4}}}, false, false},
		{"chat role chunk", `{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`,
			Chunk{HasChoices: true, Chat: true}, false, false},
		{"chat content", `{"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}`,
			Chunk{HasChoices: true, Chat: true, Text: "hi"}, true, false},
		{"chat finish", `{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`,
			Chunk{HasChoices: true, Chat: true, FinishReason: "stop"}, false, false},
		{"error object", `{"error":{"message":"boom","code":"internal_error"}}`, Chunk{Err: "boom (internal_error)"}, false, false},
		{"error string", `{"error":"bad"}`, Chunk{Err: "bad"}, false, false},
		{"null error", `{"error":null,"choices":[{"text":"a"}]}`, Chunk{HasChoices: true, Text: "a"}, true, false},
		{"not json", `{"choices":`, Chunk{}, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := ParseChunk([]byte(tc.in))
			if tc.err {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, c)
			require.Equal(t, tc.token, c.Token())
		})
	}
}

// FuzzSSEReader: no input makes the reader panic or loop; how the bytes are
// split across reads never changes the events; and payloads without line
// breaks, framed as "data: p\n\n" (with LF or CRLF), come back as they were.
func FuzzSSEReader(f *testing.F) {
	f.Add([]byte("data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n"), false)
	f.Add([]byte(": ping\r\n\r\ndata:x\r\ndata: y\r\n\r\n"), true)
	f.Add([]byte("event: e\nid: 1\n\n\ndata"), false)
	f.Add([]byte("data: a\rdata: b\n\n"), true)
	f.Add([]byte{0, '\n', ':', '\n', '\n'}, false)
	f.Fuzz(func(t *testing.T, in []byte, crlf bool) {
		whole, errWhole := events(bytes.NewReader(in))
		bytewise, errByte := events(iotest.OneByteReader(bytes.NewReader(in)))
		require.Equal(t, errWhole == nil, errByte == nil)
		require.Equal(t, whole, bytewise)

		var payloads []string
		for p := range bytes.SplitSeq(in, []byte{0}) {
			payloads = append(payloads, strings.NewReplacer("\n", "", "\r", "").Replace(string(p)))
		}
		nl := "\n"
		if crlf {
			nl = "\r\n"
		}
		var framed strings.Builder
		for _, p := range payloads {
			framed.WriteString("data: " + p + nl + nl)
		}
		got, err := events(strings.NewReader(framed.String()))
		require.NoError(t, err)
		require.Equal(t, payloads, got)
	})
}
