package api

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/worker"
)

// Generator is what the API needs of a decode scheduler (worker.Scheduler).
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
	// WriteTimeout bounds each write of a response: a client that reads
	// nothing for that long is cut off and its request cancelled. 0 means
	// 30s; negative means no bound.
	WriteTimeout time.Duration
	// StreamGrace is how long a streamed response waits for its request's
	// first event before it opens (200): a request refused or failed before
	// then (no prefill worker took it, the prefill workers failed, the
	// worker is stopping) is answered with its status and Retry-After,
	// which clients and load balancers retry, not as an error inside an
	// open stream. One whose first token takes longer opens then, so the
	// client sees it live while a long prompt prefills. 0 means 10s;
	// negative opens at once.
	StreamGrace time.Duration
	// Now is the clock for "created"; nil means time.Now.
	Now func() time.Time
	// TracerProvider traces each request (a server span continuing the
	// client's W3C traceparent; the scheduler and the handoff add children);
	// nil traces nothing and costs nothing.
	TracerProvider trace.TracerProvider
}

type server struct {
	cfg  Config
	gen  Generator
	log  *slog.Logger
	base string // model name without options
	// events is how a generation's stream is read: the stream itself
	// (tests put a fake between the two).
	events func(*worker.Stream) events
}

// events is what an endpoint reads a generation from: a *worker.Stream.
type events interface {
	Next(ctx context.Context) (worker.Output, error)
}

// New returns the API's handler.
func New(cfg Config, gen Generator) http.Handler {
	return build(cfg, gen).handler()
}

// build returns the server of New, its config completed.
func build(cfg Config, gen Generator) *server {
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
	if cfg.StreamGrace == 0 {
		cfg.StreamGrace = 10 * time.Second
	}
	if cfg.WriteTimeout == 0 {
		cfg.WriteTimeout = 30 * time.Second
	}
	base, _, _ := strings.Cut(cfg.Model, "?")
	return &server{cfg: cfg, gen: gen, log: cfg.Logger, base: base,
		events: func(st *worker.Stream) events { return st }}
}

// handler routes the API's paths to s.
func (s *server) handler() http.Handler {
	cfg := s.cfg
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/completions", s.completions)
	mux.HandleFunc("/v1/chat/completions", s.chatCompletions)
	mux.HandleFunc("/v1/models", withRequestID(s.models))
	mux.HandleFunc("/v1/models/{id...}", withRequestID(s.model))
	mux.HandleFunc("/", withRequestID(func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, &apiError{
			Message: fmt.Sprintf("no route %s %s", r.Method, r.URL.Path), Type: typeInvalid, Code: "not_found"})
	}))
	if cfg.TracerProvider != nil {
		return traced(mux, cfg.TracerProvider)
	}
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
	retryAfter(w.Header(), status)
	writeJSON(w, status, map[string]*apiError{"error": e})
}

// Retry-After bounds, in seconds. A refused client waits at least a second
// (the header's unit) and at most a minute: past that the estimate says more
// about a stalled worker than about when room opens, and a client had better
// try elsewhere or give up.
const (
	minRetryAfter = 1
	maxRetryAfter = 60
)

// QueueWaiter is what a Generator may also report: how long a request that
// joined its admission queue now would wait (worker.Scheduler.QueueWait). A
// request refused for a full queue is told to retry after that long.
type QueueWaiter interface {
	QueueWait() time.Duration
}

var _ QueueWaiter = (*worker.Scheduler)(nil)

// retryAfterFor is the Retry-After of a queue-full refusal: the queue's
// expected wait in whole seconds, rounded up, within
// [minRetryAfter, maxRetryAfter]. A client that comes back then finds the
// queue it was refused by drained.
func retryAfterFor(wait time.Duration) int {
	s := int(math.Ceil(wait.Seconds()))
	return min(max(s, minRetryAfter), maxRetryAfter)
}

// retryAfter sets Retry-After on the statuses a client should retry when no
// better value was set: 1 s for a 503 (a draining or stopped worker, or no
// prefill worker: a retry through the load balancer reaches another
// worker, or finds prefill back).
func retryAfter(h http.Header, status int) {
	if (status == http.StatusTooManyRequests || status == http.StatusServiceUnavailable) && h.Get("Retry-After") == "" {
		h.Set("Retry-After", strconv.Itoa(minRetryAfter))
	}
}

// refuseErr answers a request the scheduler did not take.
func (s *server) refuseErr(w http.ResponseWriter, log *slog.Logger, err error) {
	status, e := schedulerError(err)
	if status == http.StatusTooManyRequests {
		var wait time.Duration
		if qw, ok := s.gen.(QueueWaiter); ok {
			wait = qw.QueueWait()
		}
		w.Header().Set("Retry-After", strconv.Itoa(retryAfterFor(wait)))
	}
	retryAfter(w.Header(), status)
	log.Info("request refused", "status", status, "err", err, "retry_after", w.Header().Get("Retry-After"))
	writeError(w, status, e)
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

func contextExceeded(maxCtx, prompt int, maxTokens int64, which string) *apiError {
	return &apiError{
		Message: fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens "+
			"(%d in your prompt; %d for the completion). Please reduce your prompt or completion length.",
			maxCtx, int64(prompt)+maxTokens, prompt, maxTokens),
		Type: typeInvalid, Param: param(which), Code: "context_length_exceeded"}
}

// withRequestID names the requests h answers as start names the
// generation requests: every response carries X-Request-Id.
func withRequestID(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Request-Id", requestID(r, "req-"))
		h(w, r)
	}
}

// requestID returns the client's X-Request-Id when it is short and plain,
// else a fresh one.
func requestID(r *http.Request, prefix string) string {
	if id := r.Header.Get("X-Request-Id"); id != "" && len(id) <= 64 && strings.Trim(id,
		"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:") == "" {
		return id
	}
	var b [12]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// admitted is a generation request that start parsed and the scheduler
// took.
type admitted struct {
	id      string
	log     *slog.Logger
	stream  events
	out     *writer
	created int64
}

// start does what every generation endpoint does before it answers: it
// names the request (prefix), checks the method, reads the body, parses it
// with parse (which fills the endpoint's own request and returns its
// generation) and hands the generation to the scheduler. With ok false
// the client has its answer already; else the caller answers and calls
// a.out.done.
func (s *server) start(w http.ResponseWriter, r *http.Request, prefix string,
	parse func([]byte) (*generation, int, *apiError)) (a admitted, ok bool) {
	a.id = requestID(r, prefix)
	w.Header().Set("X-Request-Id", a.id)
	a.log = s.log.With("request_id", a.id)
	if r.Method != http.MethodPost {
		methodNotAllowed(w, r, http.MethodPost)
		return a, false
	}
	body, ok := s.readBody(w, r, a.log)
	if !ok {
		return a, false
	}
	g, status, perr := parse(body)
	if perr != nil {
		s.refuse(w, a.log, status, perr)
		return a, false
	}
	if g.user != "" {
		a.log = a.log.With("user", g.user)
	}
	if g.cacheKey != "" {
		a.log = a.log.With("prompt_cache_key", g.cacheKey)
	}
	// The affinity hint: prompt_cache_key, else the end user's id (OpenAI
	// documents the key as the user field's successor for caching).
	hint := g.cacheKey
	if hint == "" {
		hint = g.user
	}
	stream, err := s.gen.Generate(r.Context(), worker.GenerateRequest{
		Prompt: g.prompt, MaxTokens: g.maxTokens, Sampling: g.smp, Stop: g.stop, LogID: a.id, CacheKey: hint,
	})
	if err != nil {
		s.refuseErr(w, a.log, err)
		return a, false
	}
	a.stream = s.events(stream)
	a.out = &writer{w: w, rc: http.NewResponseController(w), idle: s.cfg.WriteTimeout}
	a.created = s.cfg.Now().Unix()
	return a, true
}

func (s *server) completions(w http.ResponseWriter, r *http.Request) {
	var c completionReq
	a, ok := s.start(w, r, "cmpl-", func(body []byte) (*generation, int, *apiError) {
		var status int
		var e *apiError
		c, status, e = s.parseCompletion(body)
		return &c.generation, status, e
	})
	if !ok {
		return
	}
	defer a.out.done()
	id, log, stream, out, created := a.id, a.log, a.stream, a.out, a.created
	if c.stream {
		s.streamCompletion(r, out, log, id, created, c, stream)
		return
	}
	var text strings.Builder
	var lp *logprobs
	if c.echo {
		text.WriteString(c.promptText)
	}
	if c.logprobs >= 0 {
		lp = &logprobs{TextOffset: []int{}, Tokens: []string{}, TokenLogprobs: []float32{}}
	}
	for {
		ev, err := stream.Next(r.Context())
		if err != nil {
			return // the client left; nothing to answer
		}
		if !ev.Done {
			lp.add(ev, text.Len(), c.logprobs)
			text.WriteString(ev.Text)
			continue
		}
		if ev.Err != nil {
			status, e := schedulerError(ev.Err)
			out.json(status, map[string]*apiError{"error": e})
			return
		}
		setTiming(w.Header(), ev.Timing)
		var lpOut any
		if lp != nil {
			lpOut = lp
		}
		out.json(http.StatusOK, map[string]any{
			"id": id, "object": "text_completion", "created": created, "model": s.cfg.Model,
			"choices": []any{map[string]any{
				"text": text.String(), "index": 0, "logprobs": lpOut, "finish_reason": ev.Finish,
			}},
			"usage": usage(len(c.prompt), ev, false),
		})
		return
	}
}

// readBody reads a bounded body; it answers the client itself when it fails.
func (s *server) readBody(w http.ResponseWriter, r *http.Request, log *slog.Logger) ([]byte, bool) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			s.refuse(w, log, http.StatusRequestEntityTooLarge, &apiError{
				Message: fmt.Sprintf("request body larger than %d bytes", s.cfg.MaxBodyBytes), Type: typeInvalid,
				Code: "request_too_large"})
			return nil, false
		}
		s.refuse(w, log, http.StatusBadRequest, &apiError{Message: "reading body: " + err.Error(), Type: typeInvalid})
		return nil, false
	}
	return body, true
}

// logprobs is a completion choice's logprobs object (OpenAI's legacy
// format): per token its label, log probability, the top alternatives and
// its byte offset in the choice's text.
type logprobs struct {
	TextOffset    []int                `json:"text_offset"`
	TokenLogprobs []float32            `json:"token_logprobs"`
	Tokens        []string             `json:"tokens"`
	TopLogprobs   []map[string]float32 `json:"top_logprobs"`
}

// add appends ev's token at byte offset off; nil-safe.
func (l *logprobs) add(ev worker.Output, off, top int) {
	if l == nil || ev.Logprobs == nil {
		return
	}
	l.TextOffset = append(l.TextOffset, off)
	l.Tokens = append(l.Tokens, model.TokenLabel(ev.Token))
	l.TokenLogprobs = append(l.TokenLogprobs, finite(ev.Logprobs.Chosen.Logprob))
	if top > 0 {
		m := make(map[string]float32, len(ev.Logprobs.Top))
		for _, t := range ev.Logprobs.Top {
			m[model.TokenLabel(t.Token)] = finite(t.Logprob)
		}
		l.TopLogprobs = append(l.TopLogprobs, m)
	}
}

// finite maps -Inf (a token of probability 0) to the most negative float32:
// JSON has no infinities.
func finite(v float32) float32 {
	if math.IsInf(float64(v), -1) {
		return -math.MaxFloat32
	}
	return v
}

// writer writes a response under an idle write deadline: each write must
// complete within idle, so a client that stops reading is cut off (the
// request is then cancelled with its connection) instead of holding the
// handler, its stream and its goroutine forever.
type writer struct {
	w    http.ResponseWriter
	rc   *http.ResponseController
	idle time.Duration
	err  error
}

func (o *writer) arm() {
	if o.idle > 0 {
		_ = o.rc.SetWriteDeadline(time.Now().Add(o.idle))
	}
}

// done clears the deadline for the connection's next request.
func (o *writer) done() {
	if o.idle > 0 && o.err == nil {
		_ = o.rc.SetWriteDeadline(time.Time{})
	}
}

func (o *writer) json(status int, v any) {
	retryAfter(o.w.Header(), status)
	o.arm()
	writeJSON(o.w, status, v)
	o.err = o.rc.Flush()
}

// event writes one server-sent event and flushes it; false once a write failed.
func (o *writer) event(data []byte) bool {
	if o.err != nil {
		return false
	}
	o.arm()
	if _, o.err = fmt.Fprintf(o.w, "data: %s\n\n", data); o.err == nil {
		o.err = o.rc.Flush()
	}
	return o.err == nil
}

func (o *writer) send(v any) bool {
	b, err := json.Marshal(v)
	if err != nil {
		o.err = err
		return false
	}
	return o.event(b)
}

// usageObject is OpenAI's usage object (CompletionUsage). The details of
// the completion tokens (reasoning, audio, predictions) are left out: none
// exist here, and clients take the object without them.
type usageObject struct {
	PromptTokens        int           `json:"prompt_tokens"`
	CompletionTokens    int           `json:"completion_tokens"`
	TotalTokens         int           `json:"total_tokens"`
	PromptTokensDetails promptDetails `json:"prompt_tokens_details"`
}

// promptDetails splits the prompt tokens: CachedTokens were served by a
// prefix cache instead of computed. Chat completions report AudioTokens 0
// beside it, as OpenAI's do; completions only the cached tokens.
type promptDetails struct {
	CachedTokens int  `json:"cached_tokens"`
	AudioTokens  *int `json:"audio_tokens,omitempty"`
}

// usage is the usage of a generation of prompt tokens that ended with the
// final event ev. The cached tokens are the worker's (ev.Cached), kept
// within [0, prompt] so that the object stays consistent whatever a worker
// reports.
func usage(prompt int, ev worker.Output, chat bool) usageObject {
	u := usageObject{PromptTokens: prompt, CompletionTokens: ev.Tokens, TotalTokens: prompt + ev.Tokens,
		PromptTokensDetails: promptDetails{CachedTokens: min(max(ev.Cached, 0), prompt)}}
	if chat {
		u.PromptTokensDetails.AudioTokens = new(int)
	}
	return u
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

// schedulerError maps a scheduler error to a status and error body.
func schedulerError(err error) (int, *apiError) {
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
	case errors.Is(err, worker.ErrTransferFailed):
		// The prefill workers that took it failed mid-way, with the
		// retries spent: the fleet's state, which a retry may find
		// mended, not a fault of this server.
		return http.StatusServiceUnavailable, &apiError{Message: "The prefill workers failed the request: " + err.Error(),
			Type: typeServer, Code: "prefill_failed"}
	default:
		return http.StatusInternalServerError, &apiError{Message: "The server failed the request: " + err.Error(),
			Type: typeServer, Code: "internal_error"}
	}
}
