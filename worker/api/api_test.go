package api

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/worker"
)

func newScheduler(t *testing.T, blocks, queue int) *worker.Scheduler {
	return newModelScheduler(t, model.TinyHybrid, blocks, queue)
}

func newModelScheduler(t *testing.T, name string, blocks, queue int) *worker.Scheduler {
	t.Helper()
	exec, err := model.Lookup(name)
	require.NoError(t, err)
	cfg, err := worker.PoolConfig(exec.Spec(), worker.PoolParams{MaxBatchSize: 2, KVBlocks: blocks})
	require.NoError(t, err)
	m, err := hybrid.New(cfg)
	require.NoError(t, err)
	r, err := worker.NewRank(0, m, exec, make([]byte, cfg.KV.ArenaBytes()), make([]byte, cfg.Mamba.ArenaBytes()))
	require.NoError(t, err)
	sched, err := worker.NewScheduler(worker.Config{Role: worker.RoleDecode, QueueSize: queue}, []*worker.Rank{r})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sched.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	return sched
}

func newServer(t *testing.T, gen Generator) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(New(Config{Model: model.TinyHybrid}, gen))
	t.Cleanup(srv.Close)
	return srv
}

type errorBody struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    any     `json:"code"`
	} `json:"error"`
}

func post(t *testing.T, url, body string) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, b
}

func TestBadInput(t *testing.T) {
	sched := newScheduler(t, 8, 4) // 8 blocks of 16 tokens: 128 tokens at most
	srv := newServer(t, sched)
	long := strings.Repeat("x", 200)
	tests := []struct {
		name   string
		body   string
		status int
		param  string
		code   string
	}{
		{"invalid json", `{"model":`, 400, "", "invalid_json"},
		{"not an object", `[1,2]`, 400, "", "invalid_json"},
		{"two objects", `{"model":"tiny-hybrid","prompt":"a"}{}`, 400, "", "invalid_json"},
		{"missing model", `{"prompt":"hi"}`, 400, "model", "missing_required_parameter"},
		{"unknown model", `{"model":"gpt-9","prompt":"hi"}`, 404, "model", "model_not_found"},
		{"missing prompt", `{"model":"tiny-hybrid"}`, 400, "prompt", "missing_required_parameter"},
		{"empty prompt", `{"model":"tiny-hybrid","prompt":""}`, 400, "prompt", "missing_required_parameter"},
		{"empty prompt list", `{"model":"tiny-hybrid","prompt":[""]}`, 400, "prompt", "missing_required_parameter"},
		{"prompt of two strings", `{"model":"tiny-hybrid","prompt":["a","b"]}`, 400, "prompt", "unsupported_value"},
		{"prompt of two token lists", `{"model":"tiny-hybrid","prompt":[[1],[2]]}`, 400, "prompt", "unsupported_value"},
		{"prompt token out of range", `{"model":"tiny-hybrid","prompt":[104,300]}`, 400, "prompt", "invalid_value"},
		{"prompt a number", `{"model":"tiny-hybrid","prompt":7}`, 400, "prompt", "invalid_type"},
		{"prompt too long for the pool", `{"model":"tiny-hybrid","prompt":"` + long + `"}`, 400, "prompt", "context_length_exceeded"},
		{"max_tokens zero", `{"model":"tiny-hybrid","prompt":"hi","max_tokens":0}`, 400, "max_tokens", "invalid_value"},
		{"max_tokens negative", `{"model":"tiny-hybrid","prompt":"hi","max_tokens":-5}`, 400, "max_tokens", "invalid_value"},
		{"max_tokens huge", `{"model":"tiny-hybrid","prompt":"hi","max_tokens":1000000000000}`, 400, "max_tokens", "context_length_exceeded"},
		{"max_tokens overflow", `{"model":"tiny-hybrid","prompt":"hi","max_tokens":1e30}`, 400, "max_tokens", "invalid_type"},
		{"max_tokens over context with prompt", `{"model":"tiny-hybrid","prompt":"hello","max_tokens":125}`, 400, "max_tokens", "context_length_exceeded"},
		{"max_tokens a string", `{"model":"tiny-hybrid","prompt":"hi","max_tokens":"5"}`, 400, "max_tokens", "invalid_type"},
		{"temperature negative", `{"model":"tiny-hybrid","prompt":"hi","temperature":-0.1}`, 400, "temperature", "invalid_value"},
		{"temperature too high", `{"model":"tiny-hybrid","prompt":"hi","temperature":7}`, 400, "temperature", "invalid_value"},
		{"seed a fraction", `{"model":"tiny-hybrid","prompt":"hi","seed":1.5}`, 400, "seed", "invalid_value"},
		{"seed too big", `{"model":"tiny-hybrid","prompt":"hi","seed":18446744073709551616}`, 400, "seed", "invalid_value"},
		{"seed not a number", `{"model":"tiny-hybrid","prompt":"hi","seed":"seven"}`, 400, "seed", "invalid_type"},
		{"n of two", `{"model":"tiny-hybrid","prompt":"hi","n":2}`, 400, "n", "unsupported_value"},
		// Strict JSON (issue 19): exact key case, one object, nothing after it.
		{"key in another case", `{"model":"tiny-hybrid","prompt":"hi","Max_Tokens":5}`, 400, "Max_Tokens", "unknown_parameter"},
		{"model key in another case", `{"Model":"tiny-hybrid","prompt":"hi"}`, 400, "Model", "unknown_parameter"},
		{"unknown key", `{"model":"tiny-hybrid","prompt":"hi","frobnicate":1}`, 400, "frobnicate", "unknown_parameter"},
		{"duplicate key", `{"model":"tiny-hybrid","prompt":"hi","prompt":"ho"}`, 400, "", "invalid_json"},
		{"trailing bytes", `{"model":"tiny-hybrid","prompt":"hi"} x`, 400, "", "invalid_json"},
		{"trailing bracket", `{"model":"tiny-hybrid","prompt":"hi"}]`, 400, "", "invalid_json"},
		{"trailing object", `{"model":"tiny-hybrid","prompt":"hi"}{"n":1}`, 400, "", "invalid_json"},
		// OpenAI parameters not served are refused by name (issue 19).
		{"best_of", `{"model":"tiny-hybrid","prompt":"hi","best_of":3}`, 400, "best_of", "unsupported_value"},
		{"suffix", `{"model":"tiny-hybrid","prompt":"hi","suffix":"end"}`, 400, "suffix", "unsupported_value"},
		{"presence_penalty", `{"model":"tiny-hybrid","prompt":"hi","presence_penalty":0.5}`, 400, "presence_penalty", "unsupported_value"},
		{"frequency_penalty", `{"model":"tiny-hybrid","prompt":"hi","frequency_penalty":-1}`, 400, "frequency_penalty", "unsupported_value"},
		{"logit_bias", `{"model":"tiny-hybrid","prompt":"hi","logit_bias":{"50256":-100}}`, 400, "logit_bias", "unsupported_value"},
		{"logprobs with echo", `{"model":"tiny-hybrid","prompt":"hi","logprobs":1,"echo":true}`, 400, "logprobs", "unsupported_value"},
		{"logprobs too many", `{"model":"tiny-hybrid","prompt":"hi","logprobs":6}`, 400, "logprobs", "invalid_value"},
		{"top_p above 1", `{"model":"tiny-hybrid","prompt":"hi","top_p":1.5}`, 400, "top_p", "invalid_value"},
		{"five stops", `{"model":"tiny-hybrid","prompt":"hi","stop":["a","b","c","d","e"]}`, 400, "stop", "invalid_value"},
		{"empty stop", `{"model":"tiny-hybrid","prompt":"hi","stop":""}`, 400, "stop", "invalid_value"},
		{"stop a number", `{"model":"tiny-hybrid","prompt":"hi","stop":7}`, 400, "stop", "invalid_type"},
		{"stream_options without stream", `{"model":"tiny-hybrid","prompt":"hi","stream_options":{"include_usage":true}}`, 400, "stream_options", "invalid_value"},
		{"stream_options key case", `{"model":"tiny-hybrid","prompt":"hi","stream":true,"stream_options":{"Include_Usage":true}}`, 400, "stream_options.Include_Usage", "unknown_parameter"},
		{"echo a string", `{"model":"tiny-hybrid","prompt":"hi","echo":"yes"}`, 400, "echo", "invalid_type"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, b := post(t, srv.URL, tt.body)
			require.Equal(t, tt.status, resp.StatusCode, string(b))
			require.Equal(t, "application/json", resp.Header.Get("Content-Type"))
			var eb errorBody
			require.NoError(t, json.Unmarshal(b, &eb), string(b))
			require.NotEmpty(t, eb.Error.Message)
			require.Equal(t, "invalid_request_error", eb.Error.Type)
			require.Equal(t, tt.code, eb.Error.Code)
			if tt.param == "" {
				require.Nil(t, eb.Error.Param)
			} else {
				require.NotNil(t, eb.Error.Param)
				require.Equal(t, tt.param, *eb.Error.Param)
			}
		})
	}
	t.Run("body too large", func(t *testing.T) {
		resp, b := post(t, srv.URL, `{"model":"tiny-hybrid","prompt":"`+strings.Repeat("y", 2<<20)+`"}`)
		require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode, string(b))
	})
	t.Run("wrong method", func(t *testing.T) {
		resp, err := http.Get(srv.URL + "/v1/completions")
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)
		require.Equal(t, "POST", resp.Header.Get("Allow"))
	})
	t.Run("unknown route", func(t *testing.T) {
		resp, err := http.Get(srv.URL + "/v2/nothing")
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusNotFound, resp.StatusCode)
	})
	// The server still serves after all of that.
	resp, b := post(t, srv.URL, `{"model":"tiny-hybrid","prompt":"still alive","max_tokens":3,"temperature":0}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
}

// TestOmittedMaxTokensFitsTheRoomLeft: a prompt that leaves less room than
// the default completion length is answered up to the room left when the
// request names no limit, and refused by name when it names one.
func TestOmittedMaxTokensFitsTheRoomLeft(t *testing.T) {
	sched := newScheduler(t, 8, 4)
	srv := newServer(t, sched)
	room := 3
	toks := strings.TrimSuffix(strings.Repeat("65,", sched.MaxContext()-room), ",")
	resp, b := post(t, srv.URL, `{"model":"tiny-hybrid","prompt":[`+toks+`],"temperature":0}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	var c completion
	require.NoError(t, json.Unmarshal(b, &c))
	require.Equal(t, room, c.Usage.CompletionTokens)
	require.Equal(t, "length", *c.Choices[0].FinishReason)

	resp, b = post(t, srv.URL, `{"model":"tiny-hybrid","prompt":[`+toks+`],"max_tokens":16}`)
	require.Equal(t, http.StatusBadRequest, resp.StatusCode, string(b))
	var e errorBody
	require.NoError(t, json.Unmarshal(b, &e))
	require.Equal(t, "context_length_exceeded", e.Error.Code)
	require.Equal(t, "max_tokens", *e.Error.Param)
}

type completion struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Model   string `json:"model"`
	Choices []struct {
		Text         string  `json:"text"`
		Index        int     `json:"index"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
		TotalTokens      int `json:"total_tokens"`
	} `json:"usage"`
}

func TestCompletionDeterministicAndStreamEqual(t *testing.T) {
	srv := newServer(t, newScheduler(t, 0, 8))
	body := `{"model":"tiny-hybrid","prompt":"Hello, handoff","max_tokens":8,"temperature":0.9,"seed":42}`
	var texts []string
	for range 2 {
		resp, b := post(t, srv.URL, body)
		require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
		require.NotEmpty(t, resp.Header.Get("X-Request-Id"))
		require.NotEmpty(t, resp.Header.Get("X-Handoff-Ttft-Ms"))
		var c completion
		require.NoError(t, json.Unmarshal(b, &c))
		require.Equal(t, "text_completion", c.Object)
		require.Equal(t, model.TinyHybrid, c.Model)
		require.Len(t, c.Choices, 1)
		require.NotNil(t, c.Choices[0].FinishReason)
		require.Equal(t, 14, c.Usage.PromptTokens)
		require.Equal(t, c.Usage.PromptTokens+c.Usage.CompletionTokens, c.Usage.TotalTokens)
		require.LessOrEqual(t, c.Usage.CompletionTokens, 8)
		texts = append(texts, c.Choices[0].Text)
	}
	require.Equal(t, texts[0], texts[1])

	// The same request streamed gives the same text.
	resp, err := http.Post(srv.URL+"/v1/completions", "application/json",
		strings.NewReader(strings.Replace(body, "{", `{"stream":true,`, 1)))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
	sc := bufio.NewScanner(resp.Body)
	var streamed strings.Builder
	var done, finished bool
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		require.True(t, strings.HasPrefix(line, "data: "), line)
		data := strings.TrimPrefix(line, "data: ")
		if data == "[DONE]" {
			done = true
			break
		}
		var c completion
		require.NoError(t, json.Unmarshal([]byte(data), &c))
		require.Len(t, c.Choices, 1)
		streamed.WriteString(c.Choices[0].Text)
		if c.Choices[0].FinishReason != nil {
			finished = true
		}
	}
	require.True(t, done)
	require.True(t, finished)
	// JSON-decoding both sides maps invalid bytes the same way.
	require.Equal(t, texts[0], streamed.String())
}

func TestModels(t *testing.T) {
	srv := newServer(t, newScheduler(t, 0, 8))
	resp, err := http.Get(srv.URL + "/v1/models")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID     string `json:"id"`
			Object string `json:"object"`
		} `json:"data"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&list))
	require.Equal(t, "list", list.Object)
	require.Len(t, list.Data, 1)
	require.Equal(t, model.TinyHybrid, list.Data[0].ID)

	resp2, err := http.Get(srv.URL + "/v1/models/nope")
	require.NoError(t, err)
	resp2.Body.Close()
	require.Equal(t, http.StatusNotFound, resp2.StatusCode)
}

// The neutral values of refused parameters are accepted (clients send them).
func TestNeutralParametersAccepted(t *testing.T) {
	srv := newServer(t, newScheduler(t, 0, 8))
	resp, b := post(t, srv.URL, `{"model":"tiny-hybrid","prompt":"hi","max_tokens":2,"best_of":1,"n":1,"suffix":null,`+
		`"presence_penalty":0,"frequency_penalty":0,"logit_bias":{},"user":"u-1","logprobs":null,"stop":null,"top_p":1}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
}

// firstEvents is a stream whose first event is ev, after delay.
type firstEvents struct {
	ev    worker.Output
	delay time.Duration
}

func (f firstEvents) Next(ctx context.Context) (worker.Output, error) {
	select {
	case <-time.After(f.delay):
		return f.ev, nil
	case <-ctx.Done():
		return worker.Output{}, ctx.Err()
	}
}

// A streamed request that fails before its first event (no prefill worker
// took it, the prefill workers failed it, the worker stopped) within
// StreamGrace is answered with its status and Retry-After, as a plain one
// is, which the OpenAI clients retry; past StreamGrace the stream is open
// and the failure comes inside it.
func TestStreamRefusedBeforeItOpens(t *testing.T) {
	for _, tt := range []struct {
		err    error
		status int
		code   string
	}{
		{worker.ErrTransferRefused, http.StatusServiceUnavailable, "prefill_unavailable"},
		{worker.ErrTransferFailed, http.StatusServiceUnavailable, "prefill_failed"},
		{worker.ErrClosed, http.StatusServiceUnavailable, "unavailable"},
		{worker.ErrTransferTimeout, http.StatusGatewayTimeout, "timeout"},
	} {
		for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
			for _, late := range []bool{false, true} {
				t.Run(fmt.Sprintf("%v%s/late=%v", tt.err, path, late), func(t *testing.T) {
					delay := 10 * time.Millisecond
					if late {
						delay = 300 * time.Millisecond
					}
					s := build(Config{Model: model.TinyHybrid, StreamGrace: 150 * time.Millisecond}, newScheduler(t, 0, 8))
					s.events = func(*worker.Stream) events {
						return firstEvents{ev: worker.Output{Done: true, Err: fmt.Errorf("boom: %w", tt.err)}, delay: delay}
					}
					srv := httptest.NewServer(s.handler())
					t.Cleanup(srv.Close)
					body := `{"model":"tiny-hybrid","prompt":"hi","max_tokens":2,"stream":true}`
					if strings.Contains(path, "chat") {
						body = `{"model":"tiny-hybrid","messages":[{"role":"user","content":"hi"}],"max_tokens":2,"stream":true}`
					}
					resp, err := http.Post(srv.URL+path, "application/json", strings.NewReader(body))
					require.NoError(t, err)
					defer resp.Body.Close()
					b, err := io.ReadAll(resp.Body)
					require.NoError(t, err)
					if late {
						require.Equal(t, http.StatusOK, resp.StatusCode)
						require.Contains(t, string(b), `"error"`)
						require.Contains(t, string(b), "data: [DONE]")
						return
					}
					require.Equal(t, tt.status, resp.StatusCode, "%s", b)
					require.Equal(t, "application/json", resp.Header.Get("Content-Type"))
					if tt.status == http.StatusServiceUnavailable {
						require.Equal(t, "1", resp.Header.Get("Retry-After"))
					}
					var e errorBody
					require.NoError(t, json.Unmarshal(b, &e), "%s", b)
					require.Equal(t, tt.code, e.Error.Code)
				})
			}
		}
	}
}

// fakeGen refuses with a fixed error.
type fakeGen struct{ err error }

func (f fakeGen) Generate(context.Context, worker.GenerateRequest) (*worker.Stream, error) {
	return nil, f.err
}
func (fakeGen) MaxContext() int { return 100 }

// waitGen refuses with a fixed error and reports a fixed queue wait.
type waitGen struct {
	fakeGen
	wait time.Duration
}

func (w waitGen) QueueWait() time.Duration { return w.wait }

func TestSchedulerRefusals(t *testing.T) {
	tests := []struct {
		name       string
		gen        Generator
		status     int
		typ        string
		retryAfter string
	}{
		// A full queue says when it will have drained: its expected wait,
		// rounded up to whole seconds, within 1..60.
		{"queue full", waitGen{fakeGen{worker.ErrQueueFull}, 2300 * time.Millisecond}, http.StatusTooManyRequests, "rate_limit_error", "3"},
		{"queue full, exact", waitGen{fakeGen{worker.ErrQueueFull}, 7 * time.Second}, http.StatusTooManyRequests, "rate_limit_error", "7"},
		{"queue full, no estimate", waitGen{fakeGen{worker.ErrQueueFull}, 0}, http.StatusTooManyRequests, "rate_limit_error", "1"},
		{"queue full, stalled", waitGen{fakeGen{worker.ErrQueueFull}, time.Hour}, http.StatusTooManyRequests, "rate_limit_error", "60"},
		{"queue full, no waiter", fakeGen{worker.ErrQueueFull}, http.StatusTooManyRequests, "rate_limit_error", "1"},
		// 503s go elsewhere at once: another worker, or prefill back.
		{"draining", waitGen{fakeGen{worker.ErrDraining}, 30 * time.Second}, http.StatusServiceUnavailable, "server_error", "1"},
		{"closed", fakeGen{worker.ErrClosed}, http.StatusServiceUnavailable, "server_error", "1"},
		{"no prefill", fakeGen{worker.ErrTransferRefused}, http.StatusServiceUnavailable, "server_error", "1"},
		// The prefill workers failed it, retries spent: not this server's
		// fault (it was a 500 internal_error).
		{"prefill failed", fakeGen{worker.ErrTransferFailed}, http.StatusServiceUnavailable, "server_error", "1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, tt.gen)
			for _, ep := range []struct{ path, body string }{
				{"/v1/completions", `{"model":"tiny-hybrid","prompt":"hi"}`},
				{"/v1/chat/completions", `{"model":"tiny-hybrid","messages":[{"role":"user","content":"hi"}]}`},
			} {
				resp, err := http.Post(srv.URL+ep.path, "application/json", strings.NewReader(ep.body))
				require.NoError(t, err)
				b, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				require.NoError(t, err)
				require.Equal(t, tt.status, resp.StatusCode, ep.path)
				require.Equal(t, tt.retryAfter, resp.Header.Get("Retry-After"), "%s: a refusal worth retrying says when", ep.path)
				var eb errorBody
				require.NoError(t, json.Unmarshal(b, &eb))
				require.Equal(t, tt.typ, eb.Error.Type)
			}
		})
	}
}

func TestClientDisconnectCancels(t *testing.T) {
	// A decode delay keeps the request running until the client hangs up.
	sched := newModelScheduler(t, model.TinyHybrid+"?decode_delay=5ms", 0, 4)
	srv := httptest.NewServer(New(Config{Model: model.TinyHybrid}, sched))
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/completions",
		strings.NewReader(`{"model":"tiny-hybrid","prompt":"long one","max_tokens":2000,"temperature":0,"stream":true}`))
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	// Read the first chunk, then hang up.
	_, err = bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, 1, sched.Live())
	cancel()
	resp.Body.Close()
	require.Eventually(t, func() bool { return sched.Live() == 0 }, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, sched.Ranks()[0].Manager().Stats().RowsUsed, 0)
}

func TestUTF8Holder(t *testing.T) {
	var u utf8Holder
	var out strings.Builder
	for _, tok := range model.Encode("héllo, 世界!") {
		out.WriteString(u.push(model.TokenText(tok)))
	}
	out.WriteString(u.flush())
	require.Equal(t, "héllo, 世界!", out.String())
	// A split character is held back until complete.
	u = utf8Holder{}
	b := model.Encode("世")
	require.Equal(t, "", u.push(model.TokenText(b[0])))
	require.Equal(t, "", u.push(model.TokenText(b[1])))
	require.Equal(t, "世", u.push(model.TokenText(b[2])))
	require.Equal(t, "", u.push(model.TokenText(model.EOS)))
}

// A streamed completion answers its headers at StreamGrace, before the
// first token: a request waiting for admission (or for its cache) still
// shows the client a live event stream.
func TestStreamHeadersBeforeFirstToken(t *testing.T) {
	exec, err := model.Lookup(model.TinyHybrid)
	require.NoError(t, err)
	cfg, err := worker.PoolConfig(exec.Spec(), worker.PoolParams{MaxBatchSize: 2, KVBlocks: 64})
	require.NoError(t, err)
	m, err := hybrid.New(cfg)
	require.NoError(t, err)
	r, err := worker.NewRank(0, m, exec, make([]byte, cfg.KV.ArenaBytes()), make([]byte, cfg.Mamba.ArenaBytes()))
	require.NoError(t, err)
	sched, err := worker.NewScheduler(worker.Config{Role: worker.RoleDecode}, []*worker.Rank{r})
	require.NoError(t, err)
	// The loop is not running yet: the request stays queued.
	srv := httptest.NewServer(New(Config{Model: model.TinyHybrid, StreamGrace: 100 * time.Millisecond}, sched))
	t.Cleanup(srv.Close)

	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/completions",
		strings.NewReader(`{"model":"tiny-hybrid","prompt":"hi","max_tokens":4,"stream":true}`))
	require.NoError(t, err)
	got := make(chan *http.Response, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			got <- resp
		}
	}()
	select {
	case resp := <-got:
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
		resp.Body.Close()
	case <-time.After(5 * time.Second):
		t.Error("no response headers while the request waits for its first token")
	}
	cancel()
	lctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sched.Run(lctx) }() // ends the cancelled request, so the handler returns
	t.Cleanup(func() { stop(); require.NoError(t, <-done) })
}

// Every response carries X-Request-Id, the client's when it sent a plain
// one: the models endpoints and an unknown route too.
func TestEveryResponseNamesItsRequest(t *testing.T) {
	srv := newServer(t, fakeGen{})
	for _, c := range []struct{ method, path string }{
		{http.MethodGet, "/v1/models"}, {http.MethodGet, "/v1/models/tiny-hybrid"},
		{http.MethodGet, "/v1/models/nope"}, {http.MethodPost, "/v1/nope"}, {http.MethodGet, "/v1/completions"},
	} {
		req, err := http.NewRequest(c.method, srv.URL+c.path, nil)
		require.NoError(t, err)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.NotEmpty(t, resp.Header.Get("X-Request-Id"), "%s %s", c.method, c.path)

		req.Header.Set("X-Request-Id", "mine-42")
		resp, err = http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, "mine-42", resp.Header.Get("X-Request-Id"), "%s %s", c.method, c.path)
	}
}
