package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net/http"
	"strconv"
	"unicode/utf8"

	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/worker"
)

// Limits of the parameters served.
const (
	maxStops       = 4   // stop sequences per request (OpenAI's bound)
	maxStopBytes   = 256 // bytes per stop sequence
	maxLogprobs    = 5   // completions: logprobs (alternatives per token)
	maxTopLogprobs = 20  // chat: top_logprobs
)

// params is a decoded request body: every key an endpoint knows, typed, and
// which were present. One decoder serves every endpoint; each endpoint's
// table says which keys it takes.
type params struct {
	model         string
	prompt        json.RawMessage // completions
	messages      json.RawMessage // chat (parsed by the chat endpoint)
	maxTokens     *int64
	maxTokensName string // the key max_tokens came under
	temperature   *float64
	topP          *float64
	seed          *json.Number
	stream        bool
	includeUsage  *bool // stream_options.include_usage; nil: no stream_options
	stop          []string
	echo          bool
	logprobs      *int64 // completions: alternatives per token; chat: 0 or 1 (bool)
	topLogprobs   *int64 // chat
	user          string
	cacheKey      string // prompt_cache_key
}

// fieldOf decodes the value of key name into v.
type fieldOf[T any] func(name string, raw json.RawMessage, v *T) *apiError

// field decodes a request parameter.
type field = fieldOf[params]

// commonFields are the parameters completions and chat completions share.
var commonFields = map[string]field{
	"model":             strField(func(p *params) *string { return &p.model }),
	"max_tokens":        maxTokensField,
	"temperature":       floatField(func(p *params) **float64 { return &p.temperature }),
	"top_p":             floatField(func(p *params) **float64 { return &p.topP }),
	"seed":              seedField,
	"stream":            boolField(func(p *params) *bool { return &p.stream }),
	"stream_options":    streamOptionsField,
	"stop":              stopField,
	"n":                 mustEqual(1, "Only n=1 is supported."),
	"user":              strField(func(p *params) *string { return &p.user }),
	"prompt_cache_key":  promptCacheKeyField,
	"presence_penalty":  mustEqual(0, "presence_penalty is not supported; only 0 is accepted."),
	"frequency_penalty": mustEqual(0, "frequency_penalty is not supported; only 0 is accepted."),
	"logit_bias":        logitBiasField,
}

// withFields returns the common fields plus extra.
func withFields(extra map[string]field) map[string]field {
	out := make(map[string]field, len(commonFields)+len(extra))
	for k, f := range commonFields {
		out[k] = f
	}
	for k, f := range extra {
		out[k] = f
	}
	return out
}

// completionFields are the keys of POST /v1/completions: every parameter of
// OpenAI's completions API, implemented or refused by name.
var completionFields = withFields(map[string]field{
	"prompt":   func(_ string, raw json.RawMessage, p *params) *apiError { p.prompt = raw; return nil },
	"echo":     boolField(func(p *params) *bool { return &p.echo }),
	"logprobs": intField(func(p *params) **int64 { return &p.logprobs }),
	"best_of":  mustEqual(1, "Only best_of=1 is supported: one completion is generated."),
	"suffix":   suffixField,
})

func invalidJSON(msg string) *apiError {
	return &apiError{Message: "We could not parse the JSON body of your request: " + msg,
		Type: typeInvalid, Code: "invalid_json"}
}

func invalidType(name, want string, raw json.RawMessage) *apiError {
	return &apiError{Message: fmt.Sprintf("Invalid type for '%s': expected %s, but got %s instead.", name, want, jsonKind(raw)),
		Type: typeInvalid, Param: param(name), Code: "invalid_type"}
}

func invalidValue(name, format string, a ...any) *apiError {
	return &apiError{Message: fmt.Sprintf(format, a...), Type: typeInvalid, Param: param(name), Code: "invalid_value"}
}

func unsupported(name, msg string) *apiError {
	return &apiError{Message: msg, Type: typeInvalid, Param: param(name), Code: "unsupported_value"}
}

func jsonKind(raw json.RawMessage) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return "nothing"
	}
	switch raw[0] {
	case '"':
		return "a string"
	case '{':
		return "an object"
	case '[':
		return "an array"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	}
	return "a number"
}

func isNull(raw json.RawMessage) bool { return string(bytes.TrimSpace(raw)) == "null" }

// decodeObject decodes body as one JSON object, strictly: keys match
// exactly (no case folding), each at most once, and nothing but white space
// follows the object. Each key is decoded by its entry in fields; a key not
// there is refused by name.
func decodeObject[T any](body []byte, fields map[string]fieldOf[T], v *T) *apiError {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	tok, err := dec.Token()
	if err != nil {
		return invalidJSON(err.Error())
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return invalidJSON("the body must be a JSON object")
	}
	seen := make(map[string]bool, len(fields))
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return invalidJSON(err.Error())
		}
		key, _ := tok.(string)
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return invalidJSON(err.Error())
		}
		if seen[key] {
			return invalidJSON(fmt.Sprintf("duplicate key %q", key))
		}
		seen[key] = true
		f, ok := fields[key]
		if !ok {
			return &apiError{Message: fmt.Sprintf("Unrecognized request argument supplied: %s", key),
				Type: typeInvalid, Param: param(key), Code: "unknown_parameter"}
		}
		if e := f(key, raw, v); e != nil {
			return e
		}
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return invalidJSON(err.Error())
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return invalidJSON("the body must be a single JSON object with nothing after it")
	}
	return nil
}

func strField(dst func(*params) *string) field {
	return func(name string, raw json.RawMessage, p *params) *apiError {
		if isNull(raw) {
			return nil
		}
		return unmarshal(name, raw, dst(p), "a string")
	}
}

func boolField(dst func(*params) *bool) field {
	return func(name string, raw json.RawMessage, p *params) *apiError {
		if isNull(raw) {
			return nil
		}
		return unmarshal(name, raw, dst(p), "a boolean")
	}
}

func floatField(dst func(*params) **float64) field {
	return func(name string, raw json.RawMessage, p *params) *apiError {
		if isNull(raw) {
			return nil
		}
		var v float64
		if e := unmarshal(name, raw, &v, "a number"); e != nil {
			return e
		}
		*dst(p) = &v
		return nil
	}
}

func intField(dst func(*params) **int64) field {
	return func(name string, raw json.RawMessage, p *params) *apiError {
		if isNull(raw) {
			return nil
		}
		v, e := integer(name, raw)
		if e != nil {
			return e
		}
		*dst(p) = &v
		return nil
	}
}

// maxTokensField takes max_tokens (and chat's max_completion_tokens, which
// must agree with it when both are given).
func maxTokensField(name string, raw json.RawMessage, p *params) *apiError {
	if isNull(raw) {
		return nil
	}
	v, e := integer(name, raw)
	if e != nil {
		return e
	}
	if p.maxTokens != nil && *p.maxTokens != v {
		return invalidValue(name, "max_tokens and max_completion_tokens disagree.")
	}
	p.maxTokens, p.maxTokensName = &v, name
	return nil
}

// integer decodes a JSON integer that fits an int64.
func integer(name string, raw json.RawMessage) (int64, *apiError) {
	var n json.Number
	if e := number(name, raw, &n, "an integer"); e != nil {
		return 0, e
	}
	v, err := strconv.ParseInt(n.String(), 10, 64)
	if err != nil {
		return 0, invalidType(name, "an integer in the int64 range", raw)
	}
	return v, nil
}

// unmarshal decodes raw into v; a mismatch is a type error naming name.
func unmarshal(name string, raw json.RawMessage, v any, want string) *apiError {
	if err := json.Unmarshal(raw, v); err != nil {
		return invalidType(name, want, raw)
	}
	return nil
}

// number decodes a JSON number (not a string holding one, which
// json.Number would take).
func number(name string, raw json.RawMessage, n *json.Number, want string) *apiError {
	if jsonKind(raw) != "a number" {
		return invalidType(name, want, raw)
	}
	return unmarshal(name, raw, n, want)
}

func seedField(name string, raw json.RawMessage, p *params) *apiError {
	if isNull(raw) {
		return nil
	}
	var n json.Number
	if e := number(name, raw, &n, "an integer"); e != nil {
		return e
	}
	p.seed = &n
	return nil
}

// streamOptionsField takes {"include_usage": bool}, decoded as strictly as
// the body.
func streamOptionsField(name string, raw json.RawMessage, p *params) *apiError {
	if isNull(raw) {
		return nil
	}
	if jsonKind(raw) != "an object" {
		return invalidType(name, "an object", raw)
	}
	var opts params
	e := decodeObject(raw, map[string]field{
		"include_usage": boolField(func(o *params) *bool { return &o.stream }),
		// Obfuscation pads OpenAI's chunks against network side channels;
		// nothing here is padded, whatever it says.
		"include_obfuscation": typeOnly("a boolean", func() any { return new(bool) }),
	}, &opts)
	if e != nil {
		if e.Param != nil {
			e.Param = param(name + "." + *e.Param)
		}
		return e
	}
	p.includeUsage = &opts.stream
	return nil
}

// maxCacheKeyLen is the longest prompt_cache_key taken, in characters:
// OpenAI's bound.
const maxCacheKeyLen = 64

// promptCacheKeyField takes prompt_cache_key: a string of at most
// maxCacheKeyLen characters that names the prompts sharing a prefix (a
// conversation, a user's agent). It only groups requests (for the logs now,
// and for routing to the instance holding the prefix later); the prefix
// cache itself matches tokens, whatever the key.
func promptCacheKeyField(name string, raw json.RawMessage, p *params) *apiError {
	if isNull(raw) {
		return nil
	}
	if e := unmarshal(name, raw, &p.cacheKey, "a string"); e != nil {
		return e
	}
	if n := utf8.RuneCountInString(p.cacheKey); n > maxCacheKeyLen {
		return invalidValue(name, "Invalid '%s': string too long. Expected a string with maximum length %d, "+
			"but got a string with length %d instead.", name, maxCacheKeyLen, n)
	}
	return nil
}

func stopField(_ string, raw json.RawMessage, p *params) *apiError {
	if isNull(raw) {
		return nil
	}
	var one string
	if err := json.Unmarshal(raw, &one); err == nil {
		p.stop = []string{one}
	} else if err := json.Unmarshal(raw, &p.stop); err != nil {
		return invalidType("stop", "a string or an array of strings", raw)
	}
	if len(p.stop) > maxStops {
		return invalidValue("stop", "stop takes at most %d sequences, got %d.", maxStops, len(p.stop))
	}
	for _, s := range p.stop {
		if s == "" || len(s) > maxStopBytes {
			return invalidValue("stop", "each stop sequence must be 1 to %d bytes long.", maxStopBytes)
		}
	}
	return nil
}

// mustEqual takes a numeric parameter that is served only at its neutral
// value and refuses any other by name.
func mustEqual(neutral float64, msg string) field {
	return func(name string, raw json.RawMessage, p *params) *apiError {
		if isNull(raw) {
			return nil
		}
		var v float64
		if err := json.Unmarshal(raw, &v); err != nil {
			return invalidType(name, "a number", raw)
		}
		if v != neutral {
			return unsupported(name, msg)
		}
		return nil
	}
}

func logitBiasField(_ string, raw json.RawMessage, p *params) *apiError {
	if isNull(raw) {
		return nil
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		return invalidType("logit_bias", "an object", raw)
	}
	if len(m) > 0 {
		return unsupported("logit_bias", "logit_bias is not supported; only an empty map is accepted.")
	}
	return nil
}

func suffixField(_ string, raw json.RawMessage, p *params) *apiError {
	if isNull(raw) {
		return nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return invalidType("suffix", "a string", raw)
	}
	if s != "" {
		return unsupported("suffix", "suffix (insertion) is not supported by this model.")
	}
	return nil
}

// generation is what every endpoint turns its parameters into.
type generation struct {
	prompt       []int32
	maxTokens    int
	smp          worker.Sampling
	stop         []string
	stream       bool
	includeUsage bool
	user         string // the end user's id, for the logs and as an affinity hint
	cacheKey     string // prompt_cache_key: an affinity hint (worker.GenerateRequest.CacheKey)
}

// sampling validates the parameters every endpoint shares, given the
// prompt's tokens; the status is 400 unless said otherwise.
func (s *server) sampling(p params, prompt []int32) (generation, int, *apiError) {
	g := generation{prompt: prompt, maxTokens: s.cfg.DefaultMaxTokens, stream: p.stream, stop: p.stop, user: p.user,
		cacheKey: p.cacheKey}
	g.smp.Temperature = 1
	maxCtx := s.gen.MaxContext()
	if p.maxTokens != nil {
		name := p.maxTokensName
		if *p.maxTokens < 1 {
			return g, http.StatusBadRequest, invalidValue(name, "%s must be at least 1, got %d.", name, *p.maxTokens)
		}
		if *p.maxTokens > int64(maxCtx) {
			return g, http.StatusBadRequest, contextExceeded(maxCtx, len(prompt), *p.maxTokens, name)
		}
		g.maxTokens = int(*p.maxTokens)
	}
	if len(prompt) >= maxCtx {
		return g, http.StatusBadRequest, contextExceeded(maxCtx, len(prompt), int64(g.maxTokens), "prompt")
	}
	if p.maxTokens == nil {
		// No limit asked: the default, or the room the prompt leaves (as
		// vLLM does), rather than a refusal naming a parameter the client
		// never sent, at a long conversation's last turn.
		g.maxTokens = min(g.maxTokens, maxCtx-len(prompt))
	}
	if len(prompt)+g.maxTokens > maxCtx {
		name := p.maxTokensName
		if name == "" {
			name = "max_tokens"
		}
		return g, http.StatusBadRequest, contextExceeded(maxCtx, len(prompt), int64(g.maxTokens), name)
	}
	if t := p.temperature; t != nil {
		if !(*t >= 0 && *t <= 2) {
			return g, http.StatusBadRequest, invalidValue("temperature", "temperature must be between 0 and 2, got %v.", *t)
		}
		g.smp.Temperature = *t
	}
	if tp := p.topP; tp != nil {
		switch {
		case !(*tp >= 0 && *tp <= 1):
			return g, http.StatusBadRequest, invalidValue("top_p", "top_p must be between 0 and 1, got %v.", *tp)
		case *tp == 0:
			// The nucleus of mass 0 is the most likely token alone.
			g.smp.Temperature = 0
		default:
			g.smp.TopP = *tp
		}
	}
	if p.seed != nil {
		seed, ok := parseSeed(*p.seed)
		if !ok {
			return g, http.StatusBadRequest, invalidValue("seed", "seed must be an integer in [-2^63, 2^64), got %s.", p.seed.String())
		}
		g.smp.Seed = seed
	} else {
		g.smp.Seed = mrand.Uint64()
	}
	if p.includeUsage != nil {
		if !p.stream {
			return g, http.StatusBadRequest, invalidValue("stream_options",
				"The 'stream_options' parameter is only allowed when 'stream' is enabled.")
		}
		g.includeUsage = *p.includeUsage
	}
	return g, 0, nil
}

// checkModel refuses a missing or unknown model.
func (s *server) checkModel(name string) (int, *apiError) {
	if name == "" {
		return http.StatusBadRequest, &apiError{Message: "You must provide a model parameter.", Type: typeInvalid,
			Param: param("model"), Code: "missing_required_parameter"}
	}
	if !s.serves(name) {
		return http.StatusNotFound, unknownModel(name)
	}
	return 0, nil
}

// parseSeed accepts any 64-bit integer, signed or not.
func parseSeed(n json.Number) (uint64, bool) {
	if v, err := strconv.ParseInt(n.String(), 10, 64); err == nil {
		return uint64(v), true
	}
	v, err := strconv.ParseUint(n.String(), 10, 64)
	return v, err == nil
}

// completionReq is a validated completions request.
type completionReq struct {
	generation
	promptText string
	echo       bool
	logprobs   int // alternatives per token; -1: no logprobs
}

// parseCompletion validates a completions body; the error is what the
// client gets.
func (s *server) parseCompletion(body []byte) (completionReq, int, *apiError) {
	var p params
	if e := decodeObject(body, completionFields, &p); e != nil {
		return completionReq{}, http.StatusBadRequest, e
	}
	if status, e := s.checkModel(p.model); e != nil {
		return completionReq{}, status, e
	}
	text, toks, e := promptTokens(p.prompt)
	if e != nil {
		return completionReq{}, http.StatusBadRequest, e
	}
	g, status, e := s.sampling(p, toks)
	if e != nil {
		return completionReq{}, status, e
	}
	c := completionReq{generation: g, promptText: text, echo: p.echo, logprobs: -1}
	if p.logprobs != nil {
		n := *p.logprobs
		if n < 0 || n > maxLogprobs {
			return completionReq{}, http.StatusBadRequest, invalidValue("logprobs", "logprobs must be between 0 and %d, got %d.", maxLogprobs, n)
		}
		if c.echo {
			return completionReq{}, http.StatusBadRequest, unsupported("logprobs",
				"logprobs with echo (the prompt's logprobs) is not supported: the prompt is prefilled on another worker.")
		}
		c.logprobs = int(n)
		c.smp.Logprobs, c.smp.TopLogprobs = true, int(n)
	}
	return c, 0, nil
}

// promptTokens accepts a string, an array of one string, or an array of
// token ids (one prompt); several prompts are refused.
func promptTokens(raw json.RawMessage) (string, []int32, *apiError) {
	missing := &apiError{Message: "You must provide a non-empty prompt.", Type: typeInvalid,
		Param: param("prompt"), Code: "missing_required_parameter"}
	if len(raw) == 0 || isNull(raw) {
		return "", nil, missing
	}
	var text string
	if err := json.Unmarshal(raw, &text); err == nil {
		if text == "" {
			return "", nil, missing
		}
		return text, model.Encode(text), nil
	}
	var list []json.RawMessage
	if err := json.Unmarshal(raw, &list); err != nil {
		return "", nil, invalidType("prompt", "a string, an array of strings or an array of token ids", raw)
	}
	if len(list) == 0 {
		return "", nil, missing
	}
	switch jsonKind(list[0]) {
	case "a string":
		var strs []string
		if err := json.Unmarshal(raw, &strs); err != nil {
			return "", nil, invalidType("prompt", "an array of strings", raw)
		}
		if len(strs) != 1 {
			return "", nil, unsupported("prompt", "Only one prompt per request is supported.")
		}
		if strs[0] == "" {
			return "", nil, missing
		}
		return strs[0], model.Encode(strs[0]), nil
	case "a number":
		var ids []int64
		if err := json.Unmarshal(raw, &ids); err != nil {
			return "", nil, invalidType("prompt", "an array of token ids", raw)
		}
		toks := make([]int32, len(ids))
		for i, id := range ids {
			if id < 0 || id >= 256 {
				return "", nil, invalidValue("prompt", "token id %d is not a text token (0..255).", id)
			}
			toks[i] = int32(id)
		}
		return model.Decode(toks), toks, nil
	case "an array":
		return "", nil, unsupported("prompt", "Only one prompt per request is supported.")
	}
	return "", nil, invalidType("prompt", "a string, an array of strings or an array of token ids", raw)
}
