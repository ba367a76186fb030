package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/cmd/handoff-bench/internal/serving"
)

// perfectCacheServer is an OpenAI server with a perfect prefix cache over
// bytes: a prompt's cached tokens are its longest prefix shared with the
// prompt and reply of any request finished before it (at most the prompt
// less one token). Chat messages are rendered as handoff's template. Each
// reply is maxTokens bytes naming the request.
type perfectCacheServer struct {
	mu     sync.Mutex
	seqs   []string
	bodies []map[string]any
	n      int
}

func (p *perfectCacheServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var body map[string]any
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	chat := strings.HasSuffix(r.URL.Path, "/chat/completions")
	var prompt string
	if chat {
		var msgs []serving.Message
		b, _ := json.Marshal(body["messages"])
		_ = json.Unmarshal(b, &msgs)
		prompt = serving.RenderChat(msgs)
	} else {
		prompt = body["prompt"].(string)
	}
	maxTokens := int(body["max_tokens"].(float64))
	p.mu.Lock()
	p.bodies = append(p.bodies, body)
	p.n++
	reply := fmt.Sprintf("%0*d", maxTokens, p.n)[:maxTokens]
	cached := 0
	for _, s := range p.seqs {
		n := 0
		for n < len(s) && n < len(prompt) && s[n] == prompt[n] {
			n++
		}
		cached = max(cached, min(n, len(prompt)-1))
	}
	p.mu.Unlock()
	w.Header().Set("Content-Type", "text/event-stream")
	send := func(v any) {
		b, _ := json.Marshal(v)
		fmt.Fprintf(w, "data: %s\n\n", b)
	}
	usage := map[string]any{"prompt_tokens": len(prompt), "completion_tokens": len(reply),
		"total_tokens": len(prompt) + len(reply), "prompt_tokens_details": map[string]any{"cached_tokens": cached}}
	if chat {
		send(map[string]any{"choices": []any{map[string]any{"delta": map[string]any{"role": "assistant", "content": ""}}}})
		send(map[string]any{"choices": []any{map[string]any{"delta": map[string]any{"content": reply}}}})
		send(map[string]any{"choices": []any{map[string]any{"delta": map[string]any{}, "finish_reason": "length"}}})
	} else {
		send(map[string]any{"choices": []any{map[string]any{"text": reply}}})
		send(map[string]any{"choices": []any{map[string]any{"text": "", "finish_reason": "length"}}})
	}
	p.mu.Lock()
	p.seqs = append(p.seqs, prompt+reply)
	p.mu.Unlock()
	send(map[string]any{"choices": []any{}, "usage": usage})
	fmt.Fprint(w, "data: [DONE]\n\n")
}

func runMultiTurnFake(t *testing.T, srv *httptest.Server, args ...string) (multiTurnReport, string) {
	t.Helper()
	o, err := parseServeFlags(append([]string{"--base-url", srv.URL, "--dataset-name", "multi-turn",
		"--model", "m", "--token-unit", "bytes", "--progress", "none", "--output", "json", "--plot", ""}, args...), io.Discard)
	require.NoError(t, err)
	var out, stderr bytes.Buffer
	require.NoError(t, serveMultiTurn(t.Context(), o, &out, &stderr, false))
	var rep multiTurnReport
	require.NoError(t, json.Unmarshal(out.Bytes(), &rep), out.String())
	return rep, stderr.String()
}

// Against a perfect cache the hits are the ideal ones, turn by turn, through
// either API; each turn's prompt is the conversation so far plus the new
// user message, replies included as the server sent them.
func TestServeMultiTurnPerfectCache(t *testing.T) {
	for _, endpoint := range []string{"/v1/completions", "/v1/chat/completions"} {
		t.Run(endpoint, func(t *testing.T) {
			f := &perfectCacheServer{}
			srv := httptest.NewServer(f)
			defer srv.Close()
			// Conversations 150 ms apart, turns without think time: each
			// conversation is over before the next starts.
			rep, _ := runMultiTurnFake(t, srv, "--endpoint", endpoint, "--conversations", "3", "--turns", "4",
				"--system-prompt-tokens", "300", "--turn-tokens", "20", "--random-output-len", "10",
				"--think-time", "0", "--request-rate", "6.667", "--burstiness", "inf")
			require.Len(t, rep.Runs, 1)
			run := rep.Runs[0]
			require.Equal(t, 12, run.All.Turns)
			require.Zero(t, run.All.Failed)
			require.Zero(t, run.NotSent)
			require.Equal(t, run.All.PromptTokens, run.All.PromptUnits, "bytes: the client's count is the server's")
			require.Equal(t, run.All.IdealHit, run.All.CachedTokens, "a perfect cache hits the ideal")
			require.InDelta(t, 1, run.Later.HitRateVsIdeal, 1e-12)
			require.InDelta(t, 1, run.Turn1.HitRateVsIdeal, 1e-12, "later conversations hit the system prompt")
			require.Greater(t, run.Later.SeenShare, 0.9)
			require.Equal(t, run.All.PromptTokens-run.All.CachedTokens, run.All.ComputedTokens)
			require.Len(t, run.PerTurn, 4)
			for _, s := range run.PerTurn {
				require.Equal(t, 3, s.Turns)
				require.Equal(t, s.IdealHit, s.CachedTokens)
			}

			// The requests: a test turn, then the conversations; each
			// turn extends the one before by its reply and a user message.
			require.Len(t, f.bodies, 13)
			prompts := map[string]bool{}
			for _, b := range f.bodies[1:] {
				require.Equal(t, true, b["stream"])
				require.Equal(t, map[string]any{"include_usage": true}, b["stream_options"])
				require.NotNil(t, b["seed"])
				if endpoint == "/v1/completions" {
					prompts[b["prompt"].(string)] = true
				} else {
					msgs := b["messages"].([]any)
					require.Zero(t, len(msgs)%2, "system, then user/assistant pairs, then user")
					require.Equal(t, "system", msgs[0].(map[string]any)["role"])
				}
			}
			if endpoint == "/v1/completions" {
				for p := range prompts {
					if strings.Count(p, "<|user|>") > 1 {
						i := strings.LastIndex(p, "\n<|user|>\n")
						require.True(t, prompts[p[:strings.LastIndex(p[:i], "<|assistant|>\n")+len("<|assistant|>\n")]],
							"the turn before is a prefix of %q", p[:40])
					}
				}
			}
		})
	}
}

// The same workload twice sends the same requests (the on and off runs of
// --prefix-cache compare like with like): the same prompts and seeds.
func TestServeMultiTurnSameWorkload(t *testing.T) {
	var bodies [2][]map[string]any
	for i := range bodies {
		f := &perfectCacheServer{}
		srv := httptest.NewServer(f)
		runMultiTurnFake(t, srv, "--conversations", "1", "--turns", "3", "--system-prompt-tokens", "50",
			"--turn-tokens", "5", "--random-output-len", "4", "--think-time", "1ms", "--seed", "7")
		srv.Close()
		bodies[i] = f.bodies
	}
	require.Equal(t, bodies[0], bodies[1])
}

// A failing server: the conversation stops at its first failed turn, and
// the rest are not sent.
func TestServeMultiTurnFailure(t *testing.T) {
	f := &perfectCacheServer{}
	var calls int
	var mu sync.Mutex
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls++
		n := calls
		mu.Unlock()
		if n == 3 { // the test turn, turn 1, then turn 2 fails
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprint(w, `{"error":{"message":"draining","code":"unavailable"}}`)
			return
		}
		f.ServeHTTP(w, r)
	}))
	defer srv.Close()
	rep, stderr := runMultiTurnFake(t, srv, "--conversations", "1", "--turns", "4", "--system-prompt-tokens", "20",
		"--turn-tokens", "5", "--random-output-len", "4", "--think-time", "0")
	run := rep.Runs[0]
	require.Equal(t, 1, run.All.Turns)
	require.Equal(t, 1, run.All.Failed)
	require.Equal(t, 2, run.NotSent)
	require.Len(t, run.Errors, 1)
	require.Contains(t, run.Errors[0], "HTTP 503")
	require.Contains(t, stderr, "draining")
}

func TestParseServeMultiTurnFlags(t *testing.T) {
	o, err := parseServeFlags([]string{"--dataset-name", "multi-turn", "--spawn-model", "tiny-hybrid",
		"--prefix-cache", "on,off", "--worker-args", "--kv-blocks 64  --max-batch-size 4", "--think-time", "1.5s"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, []string{"on", "off"}, o.mt.prefixCache)
	require.Equal(t, []string{"--kv-blocks", "64", "--max-batch-size", "4"}, o.mt.workerArgs)
	require.Equal(t, 1500*time.Millisecond, o.mt.thinkTime)
	require.Equal(t, "local", o.mt.spawnPrefill)
	require.Equal(t, "serve-multiturn.png", o.plot, "its own plot by default")
	require.Equal(t, 32, o.mt.conversations)
	require.Equal(t, 6, o.mt.turns)

	o, err = parseServeFlags([]string{"--dataset-name", "multi-turn", "--plot", "x.png"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, "x.png", o.plot)
	require.Empty(t, o.mt.prefixCache, "not passed unless asked")

	for _, bad := range [][]string{
		{"--dataset-name", "sharegpt"},
		{"--conversations", "3"}, // random dataset
		{"--prefix-cache", "on"},
		{"--dataset-name", "multi-turn", "--prefix-cache", "on"}, // no --spawn-model
		{"--dataset-name", "multi-turn", "--spawn-model", "m", "--prefix-cache", "maybe"},
		{"--dataset-name", "multi-turn", "--spawn-model", "m", "--prefix-cache", "on,on"},
		{"--dataset-name", "multi-turn", "--spawn-model", "m", "--spawn-prefill", "both"},
		{"--dataset-name", "multi-turn", "--spawn-prefill", "remote"},
		{"--dataset-name", "multi-turn", "--worker-args", "--tp-size 2"},
		{"--dataset-name", "multi-turn", "--spawn-model", "m", "--base-url", "http://x:1"},
		{"--dataset-name", "multi-turn", "--conversations", "0"},
		{"--dataset-name", "multi-turn", "--turns", "0"},
		{"--dataset-name", "multi-turn", "--turn-tokens", "0"},
		{"--dataset-name", "multi-turn", "--think-time", "-1s"},
		{"--dataset-name", "multi-turn", "--max-concurrency", "4"},
		{"--dataset-name", "multi-turn", "--sweep-rates", "1,2", "--goodput", "ttft:1 tpot:1"},
	} {
		_, err := parseServeFlags(bad, io.Discard)
		require.Error(t, err, "%q", bad)
	}
}

// The table and the plot of two runs, cache on and off, with the ratios.
func TestMultiTurnReportOnOff(t *testing.T) {
	mk := func(mode string, p50, p90 float64, computed int) multiTurnRun {
		s := serving.TurnSummary{Turns: 3, TTFTp50: p50, TTFTp90: p90, PromptTokens: 1000, CachedTokens: 1000 - computed,
			ComputedTokens: computed, PromptUnits: 1000, IdealHit: 900}
		return multiTurnRun{PrefixCache: mode, Turn1: s, Later: s, All: s, PerTurn: []serving.TurnSummary{s, s}}
	}
	rep := multiTurnReport{Conversations: 3, Turns: 2, Runs: []multiTurnRun{mk("on", 20, 30, 150), mk("off", 100, 120, 1000)}}
	rep.RatioTTFTp50 = onOff(rep.Runs[0].Later.TTFTp50, rep.Runs[1].Later.TTFTp50)
	rep.RatioTTFTp90 = onOff(rep.Runs[0].Later.TTFTp90, rep.Runs[1].Later.TTFTp90)
	rep.RatioCompute = onOff(150, 1000)
	var b bytes.Buffer
	require.NoError(t, writeMultiTurnTable(&b, rep))
	require.Contains(t, b.String(), "prefix cache on")
	require.Contains(t, b.String(), "prefix cache off")
	require.Contains(t, b.String(), "cache on/off, turns >= 2 TTFT p50: 0.200, p90: 0.250; computed prompt tokens: 0.150")
	require.Nil(t, onOff(1, 0))

	path := filepath.Join(t.TempDir(), "mt.png")
	require.NoError(t, writeMultiTurnPlot(path, rep.Runs, false))
	png, err := os.ReadFile(path)
	require.NoError(t, err)
	require.True(t, bytes.HasPrefix(png, []byte("\x89PNG")))
}

// Ctrl-C: the turns in flight are cancelled and the report of what finished
// is written, marked partial; the cancelled turns count as not sent.
func TestServeMultiTurnInterrupted(t *testing.T) {
	f := &perfectCacheServer{}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 3 { // the test turn, turn 1, then turn 2 hangs until Ctrl-C
			_, _ = io.Copy(io.Discard, r.Body) // the server sees the client leave once the body is read
			cancel()
			<-r.Context().Done()
			return
		}
		f.ServeHTTP(w, r)
	}))
	defer srv.Close()
	o, err := parseServeFlags([]string{"--base-url", srv.URL, "--dataset-name", "multi-turn", "--model", "m",
		"--token-unit", "bytes", "--progress", "none", "--output", "json", "--plot", "", "--conversations", "1",
		"--turns", "4", "--system-prompt-tokens", "20", "--turn-tokens", "5", "--random-output-len", "4",
		"--think-time", "0"}, io.Discard)
	require.NoError(t, err)
	var out bytes.Buffer
	require.NoError(t, serveMultiTurn(ctx, o, &out, io.Discard, false))
	var rep multiTurnReport
	require.NoError(t, json.Unmarshal(out.Bytes(), &rep), out.String())
	run := rep.Runs[0]
	require.True(t, run.Partial)
	require.Equal(t, 1, run.All.Turns)
	require.Zero(t, run.All.Failed, "cut short, not failed")
	require.Equal(t, 3, run.NotSent)
}

// With --goodput, each run counts the turns that met every objective: all
// of them under objectives no turn misses, none under a TTFT of 0 ms.
func TestServeMultiTurnGoodput(t *testing.T) {
	srv := httptest.NewServer(&perfectCacheServer{})
	defer srv.Close()
	args := []string{"--conversations", "2", "--turns", "3", "--system-prompt-tokens", "100", "--turn-tokens", "10",
		"--random-output-len", "5", "--think-time", "0", "--request-rate", "inf"}
	rep, _ := runMultiTurnFake(t, srv, append(args, "--goodput", "ttft:100000 tpot:100000 e2el:100000")...)
	run := rep.Runs[0]
	require.Equal(t, serving.SLO{"ttft": 100000, "tpot": 100000, "e2el": 100000}, rep.SLO)
	require.InDelta(t, 1, run.Attainment, 1e-12)
	require.InDelta(t, 6/run.Duration, run.Goodput, 1e-9)

	rep, _ = runMultiTurnFake(t, srv, append(args, "--goodput", "ttft:0")...)
	require.Zero(t, rep.Runs[0].Attainment)
	require.Zero(t, rep.Runs[0].Goodput)
}
