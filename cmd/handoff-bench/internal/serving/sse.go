package serving

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// MaxEventBytes bounds one line and one event's data. A completion chunk is
// a few hundred bytes; a peer that sends megabytes without a line break is
// broken, and the bound keeps the reader's memory finite.
const MaxEventBytes = 4 << 20

// ErrEventTooLarge is returned by SSEReader.Next for a line or an event
// longer than MaxEventBytes.
var ErrEventTooLarge = errors.New("serving: server-sent event too large")

// SSEReader reads the data of server-sent events (the WHATWG event-stream
// format): "data:" lines (one optional space after the colon) accumulate,
// joined by "\n", until an empty line dispatches them; lines that begin with
// ":" are comments (pings); other fields (event, id, retry) are read and
// ignored; an event with no data line is not dispatched. Lines end in "\n" or
// "\r\n". Unlike the specification, and like vLLM's client, data still
// pending when the stream ends is dispatched, so a last "data: [DONE]" with
// no blank line after it is seen.
type SSEReader struct {
	r    *bufio.Reader
	data []byte
	line []byte
}

// NewSSEReader reads events from r.
func NewSSEReader(r io.Reader) *SSEReader {
	return &SSEReader{r: bufio.NewReaderSize(r, 64<<10)}
}

// Next returns the data of the next event. It returns io.EOF after the last
// one, and the reader's error (wrapped) if the stream broke. The slice is
// valid until the next call.
func (s *SSEReader) Next() ([]byte, error) {
	s.data = s.data[:0]
	have := false
	for {
		line, err := s.readLine()
		if err != nil {
			if errors.Is(err, io.EOF) && have {
				return s.data, nil
			}
			return nil, err
		}
		if len(line) == 0 {
			if have {
				return s.data, nil
			}
			continue
		}
		if line[0] == ':' {
			continue
		}
		field, value, _ := bytes.Cut(line, []byte{':'})
		if !bytes.Equal(field, []byte("data")) {
			continue
		}
		value = bytes.TrimPrefix(value, []byte{' '})
		if have {
			s.data = append(s.data, '\n')
		}
		if len(s.data)+len(value) > MaxEventBytes {
			return nil, ErrEventTooLarge
		}
		s.data = append(s.data, value...)
		have = true
	}
}

// readLine returns the next line without its end; a last line without an
// end is returned as a line, and io.EOF comes after it.
func (s *SSEReader) readLine() ([]byte, error) {
	s.line = s.line[:0]
	for {
		frag, err := s.r.ReadSlice('\n')
		if len(s.line)+len(frag) > MaxEventBytes+2 {
			return nil, ErrEventTooLarge
		}
		s.line = append(s.line, frag...)
		switch {
		case err == nil:
			line := s.line[:len(s.line)-1]
			return bytes.TrimSuffix(line, []byte{'\r'}), nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		case errors.Is(err, io.EOF):
			if len(s.line) > 0 {
				return bytes.TrimSuffix(s.line, []byte{'\r'}), nil
			}
			return nil, io.EOF
		default:
			return nil, fmt.Errorf("serving: reading event stream: %w", err)
		}
	}
}

// Done is the data of the event that ends an OpenAI stream.
const Done = "[DONE]"

// Usage is an OpenAI usage object.
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	// PromptTokensDetails holds cached_tokens: the prompt tokens a prefix
	// cache served. nil when the server does not say.
	PromptTokensDetails *PromptTokensDetails `json:"prompt_tokens_details"`
}

// PromptTokensDetails is OpenAI's usage.prompt_tokens_details.
type PromptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

// Cached returns the cached prompt tokens, 0 when the server does not say.
func (u *Usage) Cached() int {
	if u == nil || u.PromptTokensDetails == nil {
		return 0
	}
	return u.PromptTokensDetails.CachedTokens
}

// Chunk is what the benchmark reads from one streamed completion chunk.
type Chunk struct {
	HasChoices   bool   // the chunk has a non-empty choices array
	Chat         bool   // choices[0] has a delta: a chat completion chunk
	Text         string // choices[0].text, or a chat chunk's delta.content
	FinishReason string // choices[0].finish_reason, "" when null
	Usage        *Usage // present in the last chunk with stream_options.include_usage
	Err          string // the message of an "error" member, if any
}

// Token reports whether the chunk counts as the arrival of output tokens
// for TTFT, ITL and E2EL. vLLM counts every chunk with choices; a chunk with
// empty text that carries a finish_reason is, in handoff and some other
// servers, the end marker sent after the last token, so it is not counted.
// A chat chunk counts only with content, as in vLLM's chat benchmark: the
// first one carries the role alone.
func (c Chunk) Token() bool {
	return c.HasChoices && !(c.Text == "" && (c.FinishReason != "" || c.Chat))
}

// ParseChunk decodes the JSON data of one event.
func ParseChunk(data []byte) (Chunk, error) {
	var raw struct {
		Choices []struct {
			Text  string `json:"text"`
			Delta *struct {
				Content *string `json:"content"`
			} `json:"delta"`
			FinishReason *string `json:"finish_reason"`
		} `json:"choices"`
		Usage *Usage          `json:"usage"`
		Error json.RawMessage `json:"error"`
	}
	if err := json.Unmarshal(data, &raw); err != nil {
		return Chunk{}, fmt.Errorf("serving: decoding chunk: %w", err)
	}
	c := Chunk{Usage: raw.Usage}
	if len(raw.Choices) > 0 {
		c.HasChoices = true
		c.Text = raw.Choices[0].Text
		if d := raw.Choices[0].Delta; d != nil {
			c.Chat = true
			if d.Content != nil {
				c.Text = *d.Content
			}
		}
		if f := raw.Choices[0].FinishReason; f != nil {
			c.FinishReason = *f
		}
	}
	if len(raw.Error) > 0 && !bytes.Equal(raw.Error, []byte("null")) {
		c.Err = ErrorMessage(raw.Error)
	}
	return c, nil
}

// ErrorMessage returns the message of an OpenAI error value: a string, or
// an object with a "message"; anything else is returned as it is.
func ErrorMessage(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var o struct {
		Message string `json:"message"`
		Code    any    `json:"code"`
	}
	if json.Unmarshal(raw, &o) == nil && o.Message != "" {
		if o.Code != nil {
			return fmt.Sprintf("%s (%v)", o.Message, o.Code)
		}
		return o.Message
	}
	return string(raw)
}
