package api

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/worker"
)

// TestPromptCacheKeyAndUser: prompt_cache_key and user are taken on both
// endpoints (a string, null; the key at most 64 characters, counted as
// characters, not bytes) and refused by name with another type or a longer
// key.
func TestPromptCacheKeyAndUser(t *testing.T) {
	srv := newServer(t, newScheduler(t, 0, 8))
	endpoints := []struct{ path, base string }{
		{"/v1/completions", `"model":"tiny-hybrid","prompt":"hi","max_tokens":1`},
		{"/v1/chat/completions", `"model":"tiny-hybrid","messages":[{"role":"user","content":"hi"}],"max_tokens":1`},
	}
	tests := []struct {
		name   string
		extra  string
		status int
		param  string
		code   string
	}{
		{"key", `"prompt_cache_key":"conversation-17"`, 200, "", ""},
		{"key empty", `"prompt_cache_key":""`, 200, "", ""},
		{"key null", `"prompt_cache_key":null`, 200, "", ""},
		{"key of 64 characters", `"prompt_cache_key":"` + strings.Repeat("k", 64) + `"`, 200, "", ""},
		{"key of 64 two-byte characters", `"prompt_cache_key":"` + strings.Repeat("é", 64) + `"`, 200, "", ""},
		{"key with user", `"prompt_cache_key":"c","user":"u-1"`, 200, "", ""},
		{"user", `"user":"user-42"`, 200, "", ""},
		{"user null", `"user":null`, 200, "", ""},
		{"key of 65 characters", `"prompt_cache_key":"` + strings.Repeat("k", 65) + `"`, 400, "prompt_cache_key", "invalid_value"},
		{"key a number", `"prompt_cache_key":17`, 400, "prompt_cache_key", "invalid_type"},
		{"key an object", `"prompt_cache_key":{"id":"c"}`, 400, "prompt_cache_key", "invalid_type"},
		{"key an array", `"prompt_cache_key":["c"]`, 400, "prompt_cache_key", "invalid_type"},
		{"key a boolean", `"prompt_cache_key":true`, 400, "prompt_cache_key", "invalid_type"},
		{"key in another case", `"Prompt_Cache_Key":"c"`, 400, "Prompt_Cache_Key", "unknown_parameter"},
		{"user a number", `"user":42`, 400, "user", "invalid_type"},
		{"user an object", `"user":{}`, 400, "user", "invalid_type"},
	}
	for _, ep := range endpoints {
		for _, tt := range tests {
			t.Run(ep.path+"/"+tt.name, func(t *testing.T) {
				resp, err := http.Post(srv.URL+ep.path, "application/json", strings.NewReader("{"+ep.base+","+tt.extra+"}"))
				require.NoError(t, err)
				defer resp.Body.Close()
				b, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				require.Equal(t, tt.status, resp.StatusCode, string(b))
				if tt.status == 200 {
					return
				}
				var eb errorBody
				require.NoError(t, json.Unmarshal(b, &eb), string(b))
				require.Equal(t, tt.code, eb.Error.Code, string(b))
				require.Equal(t, "invalid_request_error", eb.Error.Type)
				require.NotNil(t, eb.Error.Param, string(b))
				require.Equal(t, tt.param, *eb.Error.Param)
				require.NotEmpty(t, eb.Error.Message)
			})
		}
	}
}

// cachedEvents reports cached prompt tokens on the final event of a real
// stream, as a worker with a prefix cache does.
type cachedEvents struct {
	st     *worker.Stream
	cached int
}

func (c cachedEvents) Next(ctx context.Context) (worker.Output, error) {
	ev, err := c.st.Next(ctx)
	if err == nil && ev.Done && ev.Err == nil {
		ev.Cached = c.cached
	}
	return ev, err
}

// newCachedServer serves a real scheduler whose final events report cached
// prompt tokens.
func newCachedServer(t *testing.T, cached int) *httptest.Server {
	t.Helper()
	s := build(Config{Model: model.TinyHybrid}, newScheduler(t, 0, 8))
	s.events = func(st *worker.Stream) events { return cachedEvents{st: st, cached: cached} }
	srv := httptest.NewServer(s.handler())
	t.Cleanup(srv.Close)
	return srv
}

// usageJSON is a usage object as a client decodes it, every detail kept.
type usageJSON struct {
	PromptTokens        int            `json:"prompt_tokens"`
	CompletionTokens    int            `json:"completion_tokens"`
	TotalTokens         int            `json:"total_tokens"`
	PromptTokensDetails map[string]int `json:"prompt_tokens_details"`
}

// responseUsages posts body to path and returns every usage object of the
// answer that is not null: the one of a plain response, or those of a
// stream's chunks in order.
func responseUsages(t *testing.T, url, path, body string) []usageJSON {
	t.Helper()
	resp, err := http.Post(url+path, "application/json", strings.NewReader(body))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var datas []string
	if resp.Header.Get("Content-Type") == "text/event-stream" {
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok && d != "[DONE]" {
				datas = append(datas, d)
			}
		}
		require.NoError(t, sc.Err())
	} else {
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		datas = append(datas, string(b))
	}
	var out []usageJSON
	for _, d := range datas {
		var m struct {
			Usage *usageJSON `json:"usage"`
		}
		require.NoError(t, json.Unmarshal([]byte(d), &m), d)
		if m.Usage != nil {
			out = append(out, *m.Usage)
		}
	}
	return out
}

// TestCachedTokensInUsage: the prompt tokens a worker reports as served by
// its prefix cache are usage.prompt_tokens_details.cached_tokens, as OpenAI
// reports them: in plain responses, in a completion stream's final chunk,
// and in the usage chunk of stream_options.include_usage, on both
// endpoints. Chat adds audio_tokens 0 as OpenAI's chat completions do.
func TestCachedTokensInUsage(t *testing.T) {
	const prompt = "a shared system prompt, then the question"
	chatPrompt := "<|user|>\n" + prompt + "\n<|assistant|>\n"
	const comp = `{"model":"tiny-hybrid","prompt":"` + prompt + `","max_tokens":3,"temperature":0%s}`
	const chat = `{"model":"tiny-hybrid","messages":[{"role":"user","content":"` + prompt + `"}],"max_tokens":3,"temperature":0%s}`
	const streamed = `,"stream":true`
	const withUsage = `,"stream":true,"stream_options":{"include_usage":true}`
	tests := []struct {
		name         string
		cached, want int
	}{
		{"none", 0, 0},
		{"part", 32, 32},
		{"all but one", len(prompt) - 1, len(prompt) - 1},
		// A worker that reports more than the prompt is held to it, so that
		// the usage stays consistent.
		{"more than the prompt", 10_000, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newCachedServer(t, tt.cached)
			check := func(u usageJSON, promptLen int, chat bool) {
				t.Helper()
				want := tt.want
				if want < 0 {
					want = promptLen
				}
				require.Equal(t, promptLen, u.PromptTokens)
				require.Equal(t, u.PromptTokens+u.CompletionTokens, u.TotalTokens)
				wantDetails := map[string]int{"cached_tokens": want}
				if chat {
					wantDetails["audio_tokens"] = 0
				}
				require.Equal(t, wantDetails, u.PromptTokensDetails)
			}
			fill := func(f, extra string) string { return strings.Replace(f, "%s", extra, 1) }

			// Completions: plain, and the usage chunk of include_usage
			// alone (a stream without it carries no usage, and one with it
			// has it in its last chunk only: OpenAI's, vLLM's; a client
			// summing the chunks' usages counts each request once).
			us := responseUsages(t, srv.URL, "/v1/completions", fill(comp, ""))
			require.Len(t, us, 1)
			check(us[0], len(prompt), false)
			us = responseUsages(t, srv.URL, "/v1/completions", fill(comp, streamed))
			require.Empty(t, us)
			us = responseUsages(t, srv.URL, "/v1/completions", fill(comp, withUsage))
			require.Len(t, us, 1)
			check(us[0], len(prompt), false)

			// Chat: plain, and the usage chunk of include_usage (a chat
			// stream without it carries no usage).
			us = responseUsages(t, srv.URL, "/v1/chat/completions", fill(chat, ""))
			require.Len(t, us, 1)
			check(us[0], len(chatPrompt), true)
			require.Empty(t, responseUsages(t, srv.URL, "/v1/chat/completions", fill(chat, streamed)))
			us = responseUsages(t, srv.URL, "/v1/chat/completions", fill(chat, withUsage))
			require.Len(t, us, 1)
			check(us[0], len(chatPrompt), true)
		})
	}
}

// The real worker without a prefix cache reports 0 cached tokens, and the
// detail is there all the same (OpenAI always sends it).
func TestCachedTokensZeroFromScheduler(t *testing.T) {
	srv := newServer(t, newScheduler(t, 0, 8))
	resp, b := post(t, srv.URL, `{"model":"tiny-hybrid","prompt":"hi","max_tokens":2}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	require.Contains(t, string(b), `"prompt_tokens_details":{"cached_tokens":0}`)
	resp, b = postChat(t, srv.URL, `{"model":"tiny-hybrid","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	require.Contains(t, string(b), `"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0}`)
}

// keyGen records the cache key of each request it refuses.
type keyGen struct {
	fakeGen
	keys chan string
}

func (k keyGen) Generate(_ context.Context, g worker.GenerateRequest) (*worker.Stream, error) {
	k.keys <- g.CacheKey
	return nil, worker.ErrClosed
}

// prompt_cache_key, else user, reaches the worker as the request's
// affinity hint, on both endpoints.
func TestCacheKeyReachesWorker(t *testing.T) {
	gen := keyGen{keys: make(chan string, 1)}
	srv := newServer(t, gen)
	for _, c := range []struct{ fields, want string }{
		{`"prompt_cache_key":"conv-1","user":"u"`, "conv-1"},
		{`"user":"u-9"`, "u-9"},
		{`"temperature":0`, ""},
	} {
		for _, ep := range []struct{ path, body string }{
			{"/v1/completions", `{"model":"tiny-hybrid","prompt":"hi",` + c.fields + `}`},
			{"/v1/chat/completions", `{"model":"tiny-hybrid","messages":[{"role":"user","content":"hi"}],` + c.fields + `}`},
		} {
			resp, err := http.Post(srv.URL+ep.path, "application/json", strings.NewReader(ep.body))
			require.NoError(t, err)
			resp.Body.Close()
			require.Equal(t, c.want, <-gen.keys, "%s %s", ep.path, c.fields)
		}
	}
}
