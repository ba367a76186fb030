package api

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	mrand "math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/worker"
)

// Generator is what the API needs of a decode engine.
type Generator interface {
	Generate(ctx context.Context, g worker.GenerateRequest) (*worker.Stream, error)
	MaxContext() int
}

// Config tunes the API.
type Config struct {
	// Model is the served model's name (as given to model.Lookup; options
	// after '?' are accepted in requests with or without them).
	Model string
	// DefaultMaxTokens applies when a request omits max_tokens; 0 means 16.
	DefaultMaxTokens int
	// MaxBodyBytes bounds a request body; 0 means 1 MiB.
	MaxBodyBytes int64
	// Logger receives one line per request; nil discards.
	Logger *slog.Logger
	// Metrics counts refused requests (result "invalid"); may be nil.
	Metrics *worker.Metrics
	// Now is the clock for "created"; nil means time.Now.
	Now func() time.Time
}

type server struct {
	cfg  Config
	gen  Generator
	log  *slog.Logger
	base string // model name without options
}

// New returns the API's handler.
func New(cfg Config, gen Generator) http.Handler {
	if cfg.DefaultMaxTokens <= 0 {
		cfg.DefaultMaxTokens = 16
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = 1 << 20
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	base, _, _ := strings.Cut(cfg.Model, "?")
	s := &server{cfg: cfg, gen: gen, log: cfg.Logger, base: base}
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/completions", s.completions)
	mux.HandleFunc("/v1/models", s.models)
	mux.HandleFunc("/v1/models/{id...}", s.model)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, &apiError{
			Message: fmt.Sprintf("no route %s %s", r.Method, r.URL.Path), Type: typeInvalid, Code: "not_found"})
	})
	return mux
}

// apiError is the OpenAI error object.
type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    any     `json:"code"`
}

const (
	typeInvalid   = "invalid_request_error"
	typeRateLimit = "rate_limit_error"
	typeServer    = "server_error"
)

func param(p string) *string { return &p }

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, status int, e *apiError) {
	writeJSON(w, status, map[string]*apiError{"error": e})
}

func (s *server) models(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		methodNotAllowed(w, r, http.MethodGet)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []any{s.modelObject()}})
}

func (s *server) model(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		methodNotAllowed(w, r, http.MethodGet)
		return
	}
	if !s.serves(r.PathValue("id")) {
		writeError(w, http.StatusNotFound, unknownModel(r.PathValue("id")))
		return
	}
	writeJSON(w, http.StatusOK, s.modelObject())
}

func (s *server) modelObject() map[string]any {
	return map[string]any{"id": s.base, "object": "model", "created": 0, "owned_by": "handoff",
		"max_model_len": s.gen.MaxContext()}
}

func (s *server) serves(name string) bool {
	return name != "" && (name == s.cfg.Model || name == s.base)
}

func unknownModel(name string) *apiError {
	return &apiError{Message: fmt.Sprintf("The model `%s` does not exist.", name),
		Type: typeInvalid, Param: param("model"), Code: "model_not_found"}
}

func methodNotAllowed(w http.ResponseWriter, r *http.Request, allow string) {
	w.Header().Set("Allow", allow)
	writeError(w, http.StatusMethodNotAllowed, &apiError{
		Message: fmt.Sprintf("method %s not allowed on %s", r.Method, r.URL.Path), Type: typeInvalid,
		Code: "method_not_allowed"})
}

// completionRequest is the subset of OpenAI's completion request served.
type completionRequest struct {
	Model       string          `json:"model"`
	Prompt      json.RawMessage `json:"prompt"`
	MaxTokens   *int64          `json:"max_tokens"`
	Temperature *float64        `json:"temperature"`
	Seed        *json.Number    `json:"seed"`
	Stream      bool            `json:"stream"`
	N           *int            `json:"n"`
}

// parsed is a validated request.
type parsed struct {
	prompt    []int32
	maxTokens int
	temp      float64
	seed      uint64
	stream    bool
}

// parse validates a request body; the error is what the client gets.
func (s *server) parse(body []byte) (parsed, int, *apiError) {
	var req completionRequest
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&req); err != nil {
		return parsed{}, http.StatusBadRequest, &apiError{
			Message: "We could not parse the JSON body of your request: " + err.Error(),
			Type:    typeInvalid, Code: "invalid_json"}
	}
	if dec.More() {
		return parsed{}, http.StatusBadRequest, &apiError{
			Message: "The JSON body must be a single object.", Type: typeInvalid, Code: "invalid_json"}
	}
	if req.Model == "" {
		return parsed{}, http.StatusBadRequest, &apiError{
			Message: "You must provide a model parameter.", Type: typeInvalid, Param: param("model"), Code: "missing_required_parameter"}
	}
	if !s.serves(req.Model) {
		return parsed{}, http.StatusNotFound, unknownModel(req.Model)
	}
	text, perr := promptText(req.Prompt)
	if perr != nil {
		return parsed{}, http.StatusBadRequest, perr
	}
	p := parsed{prompt: model.Encode(text), maxTokens: s.cfg.DefaultMaxTokens, temp: 1, stream: req.Stream}
	if req.N != nil && *req.N != 1 {
		return parsed{}, http.StatusBadRequest, &apiError{
			Message: "Only n=1 is supported.", Type: typeInvalid, Param: param("n"), Code: "unsupported_value"}
	}
	maxCtx := s.gen.MaxContext()
	if req.MaxTokens != nil {
		if *req.MaxTokens < 1 {
			return parsed{}, http.StatusBadRequest, &apiError{
				Message: fmt.Sprintf("max_tokens must be at least 1, got %d.", *req.MaxTokens),
				Type:    typeInvalid, Param: param("max_tokens"), Code: "invalid_value"}
		}
		if *req.MaxTokens > int64(maxCtx) {
			return parsed{}, http.StatusBadRequest, contextExceeded(maxCtx, len(p.prompt), *req.MaxTokens, "max_tokens")
		}
		p.maxTokens = int(*req.MaxTokens)
	}
	if len(p.prompt) >= maxCtx {
		return parsed{}, http.StatusBadRequest, contextExceeded(maxCtx, len(p.prompt), int64(p.maxTokens), "prompt")
	}
	if len(p.prompt)+p.maxTokens > maxCtx {
		return parsed{}, http.StatusBadRequest, contextExceeded(maxCtx, len(p.prompt), int64(p.maxTokens), "max_tokens")
	}
	if req.Temperature != nil {
		t := *req.Temperature
		if !(t >= 0 && t <= 2) {
			return parsed{}, http.StatusBadRequest, &apiError{
				Message: fmt.Sprintf("temperature must be between 0 and 2, got %v.", t),
				Type:    typeInvalid, Param: param("temperature"), Code: "invalid_value"}
		}
		p.temp = t
	}
	if req.Seed != nil {
		seed, ok := parseSeed(*req.Seed)
		if !ok {
			return parsed{}, http.StatusBadRequest, &apiError{
				Message: fmt.Sprintf("seed must be an integer in [-2^63, 2^64), got %s.", req.Seed.String()),
				Type:    typeInvalid, Param: param("seed"), Code: "invalid_value"}
		}
		p.seed = seed
	} else {
		p.seed = mrand.Uint64()
	}
	return p, 0, nil
}

// parseSeed accepts any 64-bit integer, signed or not.
func parseSeed(n json.Number) (uint64, bool) {
	if v, err := strconv.ParseInt(n.String(), 10, 64); err == nil {
		return uint64(v), true
	}
	v, err := strconv.ParseUint(n.String(), 10, 64)
	return v, err == nil
}

func contextExceeded(maxCtx, prompt int, maxTokens int64, which string) *apiError {
	return &apiError{
		Message: fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens "+
			"(%d in your prompt; %d for the completion). Please reduce your prompt or completion length.",
			maxCtx, int64(prompt)+maxTokens, prompt, maxTokens),
		Type: typeInvalid, Param: param(which), Code: "context_length_exceeded"}
}

// promptText accepts a string or an array of exactly one string.
func promptText(raw json.RawMessage) (string, *apiError) {
	missing := &apiError{Message: "You must provide a non-empty prompt.", Type: typeInvalid,
		Param: param("prompt"), Code: "missing_required_parameter"}
	if len(raw) == 0 || string(raw) == "null" {
		return "", missing
	}
	var text string
	if err := json.Unmarshal(raw, &text); err != nil {
		var list []string
		if err := json.Unmarshal(raw, &list); err != nil || len(list) != 1 {
			return "", &apiError{Message: "prompt must be a string or an array of one string.",
				Type: typeInvalid, Param: param("prompt"), Code: "invalid_type"}
		}
		text = list[0]
	}
	if text == "" {
		return "", missing
	}
	return text, nil
}

// requestID returns the client's X-Request-Id when it is short and plain,
// else a fresh one.
func requestID(r *http.Request) string {
	if id := r.Header.Get("X-Request-Id"); id != "" && len(id) <= 64 && strings.Trim(id,
		"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:") == "" {
		return id
	}
	var b [12]byte
	_, _ = rand.Read(b[:])
	return "cmpl-" + hex.EncodeToString(b[:])
}

func (s *server) completions(w http.ResponseWriter, r *http.Request) {
	id := requestID(r)
	w.Header().Set("X-Request-Id", id)
	log := s.log.With("request_id", id)
	if r.Method != http.MethodPost {
		methodNotAllowed(w, r, http.MethodPost)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			s.refuse(w, log, http.StatusRequestEntityTooLarge, &apiError{
				Message: fmt.Sprintf("request body larger than %d bytes", s.cfg.MaxBodyBytes), Type: typeInvalid,
				Code: "request_too_large"})
			return
		}
		s.refuse(w, log, http.StatusBadRequest, &apiError{Message: "reading body: " + err.Error(), Type: typeInvalid})
		return
	}
	p, status, perr := s.parse(body)
	if perr != nil {
		s.refuse(w, log, status, perr)
		return
	}
	stream, err := s.gen.Generate(r.Context(), worker.GenerateRequest{
		Prompt: p.prompt, MaxTokens: p.maxTokens, Temperature: p.temp, Seed: p.seed, LogID: id,
	})
	if err != nil {
		status, e := engineError(err)
		log.Info("request refused", "status", status, "err", err)
		writeError(w, status, e)
		return
	}
	created := s.cfg.Now().Unix()
	if p.stream {
		s.streamOut(w, r, log, id, created, len(p.prompt), stream)
		return
	}
	var toks []int32
	for ev := range stream.Events() {
		if !ev.Done {
			toks = append(toks, ev.Token)
			continue
		}
		if ev.Err != nil {
			if r.Context().Err() != nil {
				return // the client left; nothing to answer
			}
			status, e := engineError(ev.Err)
			writeError(w, status, e)
			return
		}
		setTiming(w.Header(), ev.Timing)
		writeJSON(w, http.StatusOK, map[string]any{
			"id": id, "object": "text_completion", "created": created, "model": s.cfg.Model,
			"choices": []any{map[string]any{
				"text": model.Decode(toks), "index": 0, "logprobs": nil, "finish_reason": ev.Finish,
			}},
			"usage": usage(len(p.prompt), len(toks)),
		})
		return
	}
}

func usage(prompt, completion int) map[string]int {
	return map[string]int{"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
}

func setTiming(h http.Header, t worker.Timing) {
	set := func(k string, d time.Duration) {
		h.Set(k, strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 3, 64))
	}
	set("X-Handoff-Queue-Ms", t.Queued)
	set("X-Handoff-Prefill-Ms", t.Prefill)
	set("X-Handoff-Transfer-Ms", t.Transfer)
	set("X-Handoff-Handoff-Ms", t.Handoff)
	set("X-Handoff-Ttft-Ms", t.FirstToken)
	set("X-Handoff-Total-Ms", t.Total)
}

func (s *server) refuse(w http.ResponseWriter, log *slog.Logger, status int, e *apiError) {
	if s.cfg.Metrics != nil {
		s.cfg.Metrics.Requests.WithLabelValues(string(worker.RoleDecode), worker.ResultInvalid).Inc()
	}
	log.Info("request invalid", "status", status, "code", e.Code, "msg", e.Message)
	writeError(w, status, e)
}

// engineError maps an engine error to a status and error body.
func engineError(err error) (int, *apiError) {
	switch {
	case errors.Is(err, worker.ErrQueueFull):
		return http.StatusTooManyRequests, &apiError{Message: "The server is at capacity; retry later.",
			Type: typeRateLimit, Code: "queue_full"}
	case errors.Is(err, worker.ErrDraining), errors.Is(err, worker.ErrClosed):
		return http.StatusServiceUnavailable, &apiError{Message: "The server is shutting down.",
			Type: typeServer, Code: "unavailable"}
	case errors.Is(err, worker.ErrTooLong):
		return http.StatusBadRequest, &apiError{Message: err.Error(), Type: typeInvalid,
			Param: param("max_tokens"), Code: "context_length_exceeded"}
	case errors.Is(err, worker.ErrInvalidRequest):
		return http.StatusBadRequest, &apiError{Message: err.Error(), Type: typeInvalid, Code: "invalid_value"}
	case errors.Is(err, worker.ErrTransferRefused):
		return http.StatusServiceUnavailable, &apiError{Message: "No prefill worker could take the request: " + err.Error(),
			Type: typeServer, Code: "prefill_unavailable"}
	case errors.Is(err, worker.ErrTransferTimeout), errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout, &apiError{Message: "The request timed out: " + err.Error(),
			Type: typeServer, Code: "timeout"}
	default:
		return http.StatusInternalServerError, &apiError{Message: "The server failed the request: " + err.Error(),
			Type: typeServer, Code: "internal_error"}
	}
}

// streamOut writes the stream as server-sent events.
func (s *server) streamOut(w http.ResponseWriter, r *http.Request, log *slog.Logger, id string, created int64,
	promptTokens int, stream *worker.Stream) {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	_ = rc.Flush() // the client sees a live stream while the request waits for its first token
	chunk := func(text string, finish any) map[string]any {
		return map[string]any{
			"id": id, "object": "text_completion", "created": created, "model": s.cfg.Model,
			"choices": []any{map[string]any{"text": text, "index": 0, "logprobs": nil, "finish_reason": finish}},
		}
	}
	send := func(v any) bool {
		b, _ := json.Marshal(v)
		if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	var utf utf8Holder
	n := 0
	for ev := range stream.Events() {
		if !ev.Done {
			n++
			if text := utf.push(ev.Token); text != "" && !send(chunk(text, nil)) {
				log.Debug("stream write failed; the request is cancelled with the connection")
			}
			continue
		}
		if ev.Err != nil {
			if r.Context().Err() == nil {
				_, e := engineError(ev.Err)
				send(map[string]any{"error": e})
				_, _ = io.WriteString(w, "data: [DONE]\n\n")
				_ = rc.Flush()
			}
			return
		}
		final := chunk(utf.flush(), ev.Finish)
		final["usage"] = usage(promptTokens, n)
		send(final)
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
		_ = rc.Flush()
		return
	}
}

// utf8Holder turns byte tokens into text chunks, holding back the bytes of a
// character split across tokens.
type utf8Holder struct{ pending []byte }

func (u *utf8Holder) push(tok int32) string {
	b := model.Decode([]int32{tok})
	if b == "" {
		return ""
	}
	u.pending = append(u.pending, b...)
	// Emit everything except an incomplete final character.
	cut := len(u.pending)
	for i := len(u.pending) - 1; i >= 0 && i >= len(u.pending)-utf8.UTFMax; i-- {
		if utf8.RuneStart(u.pending[i]) {
			if !utf8.FullRune(u.pending[i:]) {
				cut = i
			}
			break
		}
	}
	out := string(u.pending[:cut])
	u.pending = append(u.pending[:0], u.pending[cut:]...)
	return out
}

func (u *utf8Holder) flush() string {
	out := string(u.pending)
	u.pending = u.pending[:0]
	return out
}
