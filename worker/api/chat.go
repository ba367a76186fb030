package api

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strings"

	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/worker"
)

// chatFields are the keys of POST /v1/chat/completions: every parameter of
// OpenAI's chat completions API, implemented or refused by name.
var chatFields = withFields(map[string]field{
	"messages":              func(_ string, raw json.RawMessage, p *params) *apiError { p.messages = raw; return nil },
	"max_completion_tokens": maxTokensField,
	"logprobs": func(name string, raw json.RawMessage, p *params) *apiError {
		if isNull(raw) {
			return nil
		}
		var on bool
		if e := unmarshal(name, raw, &on, "a boolean"); e != nil {
			return e
		}
		if on {
			one := int64(1)
			p.logprobs = &one
		}
		return nil
	},
	"top_logprobs":        intField(func(p *params) **int64 { return &p.topLogprobs }),
	"tools":               mustBeEmpty("Tools (function calling) are not supported by this model."),
	"functions":           mustBeEmpty("Functions (function calling) are not supported by this model."),
	"tool_choice":         oneOf(`"none"`, `"auto"`),
	"function_call":       oneOf(`"none"`, `"auto"`),
	"parallel_tool_calls": typeOnly("a boolean", func() any { return new(bool) }), // meaningless without tools
	"response_format":     oneOf(`{"type":"text"}`),
	"modalities":          oneOf(`["text"]`),
	"audio":               mustBeEmpty("Audio output is not supported by this model."),
	"prediction":          mustBeEmpty("Predicted outputs are not supported by this model."),
	"reasoning_effort":    mustBeEmpty("reasoning_effort is not supported: the model does not reason."),
	"verbosity":           mustBeEmpty("verbosity is not supported by this model."),
	"web_search_options":  mustBeEmpty("Web search is not supported."),
	"service_tier":        oneOf(`"auto"`, `"default"`),
	"store":               oneOf(`false`),
	"metadata":            mustBeEmpty("metadata is only stored with store=true, which is not supported."),
	"safety_identifier":   strField(func(p *params) *string { return &p.user }),
})

// typeOnly takes a parameter that changes nothing here, checking its type
// against a fresh value of newV's.
func typeOnly(want string, newV func() any) field {
	return func(name string, raw json.RawMessage, _ *params) *apiError {
		if isNull(raw) {
			return nil
		}
		return unmarshal(name, raw, newV(), want)
	}
}

// mustBeEmpty takes null, an empty array, object or string, and refuses
// anything else by name.
func mustBeEmpty(msg string) field {
	return func(name string, raw json.RawMessage, _ *params) *apiError {
		switch string(compact(raw)) {
		case "null", "[]", "{}", `""`:
			return nil
		}
		return unsupported(name, msg)
	}
}

// oneOf takes null or one of the given values (compact JSON) and refuses
// anything else by name.
func oneOf(allowed ...string) field {
	return func(name string, raw json.RawMessage, _ *params) *apiError {
		c := string(compact(raw))
		if c == "null" {
			return nil
		}
		for _, a := range allowed {
			if c == a {
				return nil
			}
		}
		return unsupported(name, fmt.Sprintf("%s: only %s is supported.", name, strings.Join(allowed, " or ")))
	}
}

func compact(raw json.RawMessage) []byte {
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		return raw
	}
	return b.Bytes()
}

// message is one chat message.
type message struct {
	role    string
	name    string
	content string
	set     map[string]bool
}

var messageFields = map[string]fieldOf[message]{
	"role": func(name string, raw json.RawMessage, m *message) *apiError {
		m.set[name] = true
		return unmarshal(name, raw, &m.role, "a string")
	},
	"name": func(name string, raw json.RawMessage, m *message) *apiError {
		if isNull(raw) {
			return nil
		}
		if e := unmarshal(name, raw, &m.name, "a string"); e != nil {
			return e
		}
		return checkName(name, m.name)
	},
	"content": func(name string, raw json.RawMessage, m *message) *apiError {
		m.set[name] = true
		if isNull(raw) {
			return nil
		}
		if jsonKind(raw) == "a string" {
			return unmarshal(name, raw, &m.content, "a string")
		}
		var parts []json.RawMessage
		if err := json.Unmarshal(raw, &parts); err != nil {
			return invalidType(name, "a string or an array of content parts", raw)
		}
		var text strings.Builder
		for i, part := range parts {
			var pt contentPart
			e := decodeObject(part, partFields, &pt)
			if e != nil {
				if e.Param != nil {
					e.Param = param(fmt.Sprintf("%s[%d].%s", name, i, *e.Param))
				}
				return e
			}
			if pt.typ != "text" {
				return unsupported(fmt.Sprintf("%s[%d].type", name, i), fmt.Sprintf("Content parts of type %q are not supported; only text.", pt.typ))
			}
			text.WriteString(pt.text)
		}
		m.content = text.String()
		return nil
	},
	"tool_calls": func(name string, raw json.RawMessage, _ *message) *apiError {
		return emptyOr(name, raw, "Tool calls are not supported.")
	},
	"function_call": func(name string, raw json.RawMessage, _ *message) *apiError {
		return emptyOr(name, raw, "Function calls are not supported.")
	},
	"tool_call_id": func(name string, raw json.RawMessage, _ *message) *apiError {
		return emptyOr(name, raw, "Tool messages are not supported.")
	},
	"refusal": func(name string, raw json.RawMessage, _ *message) *apiError {
		return emptyOr(name, raw, "Refusal messages are not supported.")
	},
	"audio": func(name string, raw json.RawMessage, _ *message) *apiError {
		return emptyOr(name, raw, "Audio is not supported.")
	},
}

// maxNameLen is the longest messages[].name taken, as OpenAI's limit.
const maxNameLen = 64

// checkName refuses a participant name outside OpenAI's pattern
// ^[a-zA-Z0-9_-]+$ (at most maxNameLen bytes), as OpenAI does: 400
// invalid_value. The name is spliced into the template's header line
// (<|user:name|>), so a name carrying "|>" or a newline would forge a header
// of another role; the pattern is what makes the splice safe.
func checkName(param, name string) *apiError {
	ok := name != "" && len(name) <= maxNameLen
	for i := 0; ok && i < len(name); i++ {
		c := name[i]
		ok = c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-'
	}
	if !ok {
		return invalidValue(param, "Invalid value: %q. A message name must match the pattern '^[a-zA-Z0-9_-]+$' "+
			"and have at most %d characters.", name, maxNameLen)
	}
	return nil
}

// contentPart is one part of a message's content.
type contentPart struct{ typ, text string }

// partFields take a text part; the payloads of other part types are taken
// so that the part is refused by its type, not by its payload's key.
var partFields = map[string]fieldOf[contentPart]{
	"type": func(n string, raw json.RawMessage, v *contentPart) *apiError {
		return unmarshal(n, raw, &v.typ, "a string")
	},
	"text": func(n string, raw json.RawMessage, v *contentPart) *apiError {
		return unmarshal(n, raw, &v.text, "a string")
	},
	"image_url":   func(string, json.RawMessage, *contentPart) *apiError { return nil },
	"input_audio": func(string, json.RawMessage, *contentPart) *apiError { return nil },
	"file":        func(string, json.RawMessage, *contentPart) *apiError { return nil },
	"refusal":     func(string, json.RawMessage, *contentPart) *apiError { return nil },
}

func emptyOr(name string, raw json.RawMessage, msg string) *apiError {
	return mustBeEmpty(msg)(name, raw, nil)
}

// chatPrompt renders messages with tiny-hybrid's chat template, one line
// per header:
//
//	<|system|>\n{content}\n<|user|>\n{content}\n ... <|assistant|>\n
//
// (developer counts as system; a name rides in the header as <|user:name|>).
// The generation continues after the final assistant header.
func chatPrompt(raw json.RawMessage) (string, *apiError) {
	missing := &apiError{Message: "You must provide at least one message.", Type: typeInvalid,
		Param: param("messages"), Code: "missing_required_parameter"}
	if len(raw) == 0 || isNull(raw) {
		return "", missing
	}
	var list []json.RawMessage
	if err := json.Unmarshal(raw, &list); err != nil {
		return "", invalidType("messages", "an array of messages", raw)
	}
	if len(list) == 0 {
		return "", missing
	}
	var b strings.Builder
	for i, mraw := range list {
		at := fmt.Sprintf("messages[%d]", i)
		if jsonKind(mraw) != "an object" {
			return "", invalidType(at, "an object", mraw)
		}
		m := message{set: map[string]bool{}}
		if e := decodeObject(mraw, messageFields, &m); e != nil {
			if e.Param != nil {
				e.Param = param(at + "." + *e.Param)
			}
			return "", e
		}
		if !m.set["role"] {
			return "", &apiError{Message: fmt.Sprintf("Missing required parameter: '%s.role'.", at), Type: typeInvalid,
				Param: param(at + ".role"), Code: "missing_required_parameter"}
		}
		role := m.role
		switch role {
		case "system", "developer":
			role = "system"
		case "user", "assistant":
		case "tool", "function":
			return "", unsupported(at+".role", fmt.Sprintf("Messages of role %q are not supported (no tool calling).", m.role))
		default:
			return "", invalidValue(at+".role", "Invalid value: '%s'. Supported values are: 'system', 'developer', 'user' and 'assistant'.", m.role)
		}
		if !m.set["content"] {
			return "", &apiError{Message: fmt.Sprintf("Missing required parameter: '%s.content'.", at), Type: typeInvalid,
				Param: param(at + ".content"), Code: "missing_required_parameter"}
		}
		b.WriteString("<|" + role)
		if m.name != "" {
			b.WriteString(":" + m.name)
		}
		b.WriteString("|>\n" + m.content + "\n")
	}
	b.WriteString("<|assistant|>\n")
	return b.String(), nil
}

// chatReq is a validated chat completions request.
type chatReq struct {
	generation
	logprobs int // top alternatives; -1: no logprobs
}

func (s *server) parseChat(body []byte) (chatReq, int, *apiError) {
	var p params
	if e := decodeObject(body, chatFields, &p); e != nil {
		return chatReq{}, http.StatusBadRequest, e
	}
	if status, e := s.checkModel(p.model); e != nil {
		return chatReq{}, status, e
	}
	text, e := chatPrompt(p.messages)
	if e != nil {
		return chatReq{}, http.StatusBadRequest, e
	}
	g, status, e := s.sampling(p, model.Encode(text))
	if e != nil {
		return chatReq{}, status, e
	}
	c := chatReq{generation: g, logprobs: -1}
	if p.topLogprobs != nil {
		n := *p.topLogprobs
		if n < 0 || n > maxTopLogprobs {
			return chatReq{}, http.StatusBadRequest, invalidValue("top_logprobs", "top_logprobs must be between 0 and %d, got %d.", maxTopLogprobs, n)
		}
		if p.logprobs == nil {
			return chatReq{}, http.StatusBadRequest, invalidValue("top_logprobs", "top_logprobs requires logprobs to be true.")
		}
		c.logprobs = int(n)
	}
	if p.logprobs != nil {
		c.logprobs = max(c.logprobs, 0)
		c.smp.Logprobs, c.smp.TopLogprobs = true, c.logprobs
	}
	return c, 0, nil
}

// chatLogprob is one entry of a chat choice's logprobs.content.
type chatLogprob struct {
	Token       string        `json:"token"`
	Logprob     float32       `json:"logprob"`
	Bytes       []int         `json:"bytes"`
	TopLogprobs []chatLogprob `json:"top_logprobs"`
}

func tokenBytes(tok int32) []int {
	t := model.TokenText(tok)
	out := make([]int, len(t))
	for i := range len(t) {
		out[i] = int(t[i])
	}
	return out
}

func chatLogprobOf(ev worker.Output) chatLogprob {
	lp := chatLogprob{Token: model.TokenLabel(ev.Token), Logprob: finite(ev.Logprobs.Chosen.Logprob),
		Bytes: tokenBytes(ev.Token), TopLogprobs: []chatLogprob{}}
	for _, t := range ev.Logprobs.Top {
		lp.TopLogprobs = append(lp.TopLogprobs, chatLogprob{Token: model.TokenLabel(t.Token), Logprob: finite(t.Logprob),
			Bytes: tokenBytes(t.Token), TopLogprobs: []chatLogprob{}})
	}
	return lp
}

func (s *server) chatCompletions(w http.ResponseWriter, r *http.Request) {
	var c chatReq
	a, ok := s.start(w, r, "chatcmpl-", func(body []byte) (*generation, int, *apiError) {
		var status int
		var e *apiError
		c, status, e = s.parseChat(body)
		return &c.generation, status, e
	})
	if !ok {
		return
	}
	defer a.out.done()
	id, log, stream, out, created := a.id, a.log, a.stream, a.out, a.created
	if c.stream {
		s.streamChat(r, out, log, id, created, c, stream)
		return
	}
	var text strings.Builder
	var lps []chatLogprob
	for {
		ev, err := stream.Next(r.Context())
		if err != nil {
			return // the client left
		}
		if !ev.Done {
			text.WriteString(ev.Text)
			if ev.Logprobs != nil {
				lps = append(lps, chatLogprobOf(ev))
			}
			continue
		}
		if ev.Err != nil {
			status, e := schedulerError(ev.Err)
			out.json(status, map[string]*apiError{"error": e})
			return
		}
		setTiming(w.Header(), ev.Timing)
		var lpOut any
		if c.logprobs >= 0 {
			lpOut = map[string]any{"content": nonNil(lps), "refusal": nil}
		}
		out.json(http.StatusOK, map[string]any{
			"id": id, "object": "chat.completion", "created": created, "model": s.cfg.Model,
			"choices": []any{map[string]any{
				"index":         0,
				"message":       map[string]any{"role": "assistant", "content": text.String(), "refusal": nil},
				"logprobs":      lpOut,
				"finish_reason": ev.Finish,
			}},
			"usage": usage(len(c.prompt), ev, true),
		})
		return
	}
}

func nonNil(l []chatLogprob) []chatLogprob {
	if l == nil {
		return []chatLogprob{}
	}
	return l
}

// streamChat writes chat completion chunks: the role first, then content
// deltas (never splitting a character), then the finish reason, then (with
// include_usage) a last chunk with the usage and no choice.
func (s *server) streamChat(r *http.Request, out *writer, log *slog.Logger, id string, created int64,
	c chatReq, stream events) {
	stream, ok := s.openStream(r, out, stream)
	if !ok {
		return
	}
	chunk := func(delta map[string]any, lps []chatLogprob, finish any) map[string]any {
		var lpOut any
		if c.logprobs >= 0 && lps != nil {
			lpOut = map[string]any{"content": lps, "refusal": nil}
		}
		m := map[string]any{
			"id": id, "object": "chat.completion.chunk", "created": created, "model": s.cfg.Model,
			"choices": []any{map[string]any{"index": 0, "delta": delta, "logprobs": lpOut, "finish_reason": finish}},
		}
		if c.includeUsage {
			m["usage"] = nil
		}
		return m
	}
	// The role goes out at once: the client sees a live stream while a
	// request past StreamGrace waits for its first token.
	if !out.send(chunk(map[string]any{"role": "assistant", "content": ""}, nil, nil)) {
		log.Debug("stream write failed; the request is cancelled with the connection", "err", out.err)
		return
	}
	var utf utf8Holder
	var lps []chatLogprob
	for {
		ev, err := stream.Next(r.Context())
		if err != nil {
			return
		}
		if !ev.Done {
			if ev.Logprobs != nil {
				lps = append(lps, chatLogprobOf(ev))
			}
			text := utf.push(ev.Text)
			if text == "" {
				continue
			}
			if !out.send(chunk(map[string]any{"content": text}, lps, nil)) {
				log.Debug("stream write failed; the request is cancelled with the connection", "err", out.err)
				return
			}
			lps = nil
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
		if rest := utf.flush(); rest != "" || lps != nil {
			if !out.send(chunk(map[string]any{"content": rest}, lps, nil)) {
				return
			}
		}
		if !out.send(chunk(map[string]any{}, nil, ev.Finish)) {
			return
		}
		if c.includeUsage {
			m := chunk(nil, nil, nil)
			m["choices"], m["usage"] = []any{}, usage(len(c.prompt), ev, true)
			out.send(m)
		}
		out.event([]byte("[DONE]"))
		return
	}
}
