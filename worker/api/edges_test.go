package api

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/worker"
)

type choiceOut struct {
	Text         string    `json:"text"`
	FinishReason *string   `json:"finish_reason"`
	Logprobs     *logprobs `json:"logprobs"`
}

type completionOut struct {
	Choices []choiceOut `json:"choices"`
	Usage   *struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
}

// completeBoth runs body plain and streamed and returns both outcomes: the
// text, the finish reason, the logprobs (joined across chunks) and the
// completion tokens counted.
func completeBoth(t *testing.T, url, body string) (plain, streamed choiceOut, plainTokens, streamTokens int, chunks []completionOut) {
	t.Helper()
	resp, b := post(t, url, body)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	var c completionOut
	require.NoError(t, json.Unmarshal(b, &c))
	require.Len(t, c.Choices, 1)
	plain, plainTokens = c.Choices[0], c.Usage.CompletionTokens

	resp2, err := http.Post(url+"/v1/completions", "application/json",
		strings.NewReader(strings.Replace(body, "{", `{"stream":true,"stream_options":{"include_usage":true},`, 1)))
	require.NoError(t, err)
	defer resp2.Body.Close()
	sc := bufio.NewScanner(resp2.Body)
	var text strings.Builder
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			break
		}
		var ch completionOut
		require.NoError(t, json.Unmarshal([]byte(data), &ch), data)
		chunks = append(chunks, ch)
		if len(ch.Choices) == 0 { // the usage chunk, last
			streamTokens = ch.Usage.CompletionTokens
			continue
		}
		require.Nil(t, ch.Usage, "usage before the last chunk")
		text.WriteString(ch.Choices[0].Text)
		if lp := ch.Choices[0].Logprobs; lp != nil {
			if streamed.Logprobs == nil {
				streamed.Logprobs = &logprobs{}
			}
			streamed.Logprobs.Tokens = append(streamed.Logprobs.Tokens, lp.Tokens...)
			streamed.Logprobs.TokenLogprobs = append(streamed.Logprobs.TokenLogprobs, lp.TokenLogprobs...)
			streamed.Logprobs.TopLogprobs = append(streamed.Logprobs.TopLogprobs, lp.TopLogprobs...)
			streamed.Logprobs.TextOffset = append(streamed.Logprobs.TextOffset, lp.TextOffset...)
		}
		if ch.Choices[0].FinishReason != nil {
			streamed.FinishReason = ch.Choices[0].FinishReason
		}
	}
	streamed.Text = text.String()
	return plain, streamed, plainTokens, streamTokens, chunks
}

// stop, echo, logprobs and top_p are served, plain and streamed alike
// (issue 19: they were accepted and ignored).
// viaJSON is what a client reads of s (invalid UTF-8 becomes U+FFFD).
func viaJSON(t *testing.T, s string) string {
	b, err := json.Marshal(s)
	require.NoError(t, err)
	var out string
	require.NoError(t, json.Unmarshal(b, &out))
	return out
}

func TestParametersServed(t *testing.T) {
	sched := newScheduler(t, 0, 8)
	srv := newServer(t, sched)
	base := `{"model":"tiny-hybrid","prompt":"Hello, handoff","max_tokens":40,"temperature":0`
	full, _, _, _, _ := completeBoth(t, srv.URL, base+`}`)
	require.Equal(t, "length", *full.FinishReason)
	require.Nil(t, full.Logprobs)
	// The raw bytes of the same greedy completion, to pick a stop sequence
	// that occurs in them.
	s, err := sched.Generate(context.Background(), worker.GenerateRequest{Prompt: model.Encode("Hello, handoff"), MaxTokens: 40})
	require.NoError(t, err)
	var raw strings.Builder
	for {
		ev, err := s.Next(context.Background())
		require.NoError(t, err)
		if ev.Done {
			break
		}
		raw.WriteString(ev.Text)
	}
	require.Equal(t, full.Text, viaJSON(t, raw.String()))

	t.Run("stop", func(t *testing.T) {
		at := -1
		for i := 8; i < raw.Len()-1; i++ { // two ASCII bytes: a stop sequence JSON can carry
			if c, d := raw.String()[i], raw.String()[i+1]; c > 0 && c < 0x80 && d > 0 && d < 0x80 {
				at = i
				break
			}
		}
		require.GreaterOrEqual(t, at, 0, "no ASCII pair in %q", raw.String())
		stop := raw.String()[at : at+2]
		at = strings.Index(raw.String(), stop)
		body, _ := json.Marshal(stop)
		plain, streamed, pt, st, _ := completeBoth(t, srv.URL, base+`,"stop":["never in it",`+string(body)+`]}`)
		require.Equal(t, viaJSON(t, raw.String()[:at]), plain.Text)
		require.Equal(t, "stop", *plain.FinishReason)
		require.Equal(t, plain.Text, streamed.Text, "a stream never shows the matched text")
		require.Equal(t, "stop", *streamed.FinishReason)
		require.Equal(t, pt, st)
		require.Less(t, pt, 40)
	})
	t.Run("echo", func(t *testing.T) {
		plain, streamed, _, _, _ := completeBoth(t, srv.URL, base+`,"echo":true}`)
		require.Equal(t, "Hello, handoff"+full.Text, plain.Text)
		require.Equal(t, plain.Text, streamed.Text)
	})
	t.Run("logprobs", func(t *testing.T) {
		plain, streamed, _, _, _ := completeBoth(t, srv.URL, base+`,"logprobs":3}`)
		require.Equal(t, full.Text, plain.Text)
		lp := plain.Logprobs
		require.NotNil(t, lp)
		require.Len(t, lp.Tokens, 40)
		require.Len(t, lp.TokenLogprobs, 40)
		require.Len(t, lp.TopLogprobs, 40)
		require.Len(t, lp.TextOffset, 40)
		for i := range lp.Tokens {
			require.LessOrEqual(t, lp.TokenLogprobs[i], float32(0))
			require.Len(t, lp.TopLogprobs[i], 3)
			// Greedy: the chosen token is the most likely one.
			best := float32(-1e30)
			for _, v := range lp.TopLogprobs[i] {
				best = max(best, v)
			}
			require.Equal(t, best, lp.TokenLogprobs[i], "token %d", i)
		}
		require.Equal(t, lp, streamed.Logprobs, "streamed logprobs are the same")
	})
	t.Run("top_p", func(t *testing.T) {
		// A vanishing nucleus is the argmax: sampling at temperature 2 with
		// top_p 1e-9 gives the greedy text.
		plain, _, _, _, _ := completeBoth(t, srv.URL, strings.Replace(base, `"temperature":0`, `"temperature":2,"seed":3`, 1)+`,"top_p":1e-9}`)
		require.Equal(t, full.Text, plain.Text)
		hot, _, _, _, _ := completeBoth(t, srv.URL, strings.Replace(base, `"temperature":0`, `"temperature":2,"seed":3`, 1)+`}`)
		require.NotEqual(t, full.Text, hot.Text, "without top_p the hot sample differs")
	})
	t.Run("include_usage", func(t *testing.T) {
		chunks := streamChunks(t, srv.URL, `{"stream":true,"stream_options":{"include_usage":true},`+base[1:]+`}`)
		last := chunks[len(chunks)-1]
		require.Empty(t, last.Choices)
		require.NotNil(t, last.Usage)
		require.Equal(t, 40, last.Usage.CompletionTokens)
	})
}

func streamChunks(t *testing.T, url, body string) []completionOut {
	t.Helper()
	resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var chunks []completionOut
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var ch completionOut
		require.NoError(t, json.Unmarshal([]byte(data), &ch), data)
		chunks = append(chunks, ch)
	}
	return chunks
}

// smallBuffers makes accepted connections' send buffers small, so a client
// that stops reading stalls the server's writes quickly.
type smallBuffers struct{ net.Listener }

func (l smallBuffers) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetWriteBuffer(4096)
	}
	return c, err
}

// dialStalled sends a streamed completion on a connection with a tiny
// receive buffer and never reads the answer.
func dialStalled(t *testing.T, addr, body string) net.Conn {
	t.Helper()
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
		if err != nil {
			return err
		}
		return serr
	}}
	c, err := d.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	_, err = io.WriteString(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "+
		fmtInt(len(body))+"\r\n\r\n"+body)
	require.NoError(t, err)
	return c
}

func fmtInt(n int) string { b, _ := json.Marshal(n); return string(b) }

// Issue 19 finding 3: a stream to a client that stops reading is cut after
// the idle write deadline; the request is cancelled and everything it held
// is released (the handler used to block in Write until the client closed).
func TestStalledStreamIsCut(t *testing.T) {
	sched := newModelScheduler(t, model.TinyHybrid, 0, 8)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	handlerDone := make(chan struct{}, 1)
	h := New(Config{Model: model.TinyHybrid, WriteTimeout: 300 * time.Millisecond}, sched)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(w, r)
		handlerDone <- struct{}{}
	}))
	srv.Listener = smallBuffers{ln}
	srv.Start()
	t.Cleanup(srv.Close)

	body := `{"model":"tiny-hybrid","prompt":"stall","max_tokens":3000,"temperature":0,"stream":true}`
	c := dialStalled(t, ln.Addr().String(), body)
	select {
	case <-handlerDone:
	case <-time.After(30 * time.Second):
		t.Fatal("the handler is still blocked writing to a client that stopped reading")
	}
	// The stream was cut, not finished: the client finds no end of stream.
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	got, _ := io.ReadAll(c)
	require.NotContains(t, string(got), "[DONE]", "the stream ran to its end: nothing stalled")
	require.Contains(t, string(got), "data: ", "the stream had begun")
	require.Eventually(t, func() bool { return sched.Live() == 0 }, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, 0, sched.Ranks()[0].Manager().Stats().RowsUsed)
}

// A client that reads slowly but steadily is not cut: the deadline bounds
// one write, not the stream.
func TestSlowReaderNotCut(t *testing.T) {
	sched := newModelScheduler(t, model.TinyHybrid+"?decode_delay=2ms", 0, 8)
	srv := httptest.NewServer(New(Config{Model: model.TinyHybrid, WriteTimeout: 100 * time.Millisecond}, sched))
	t.Cleanup(srv.Close)
	resp, err := http.Post(srv.URL+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"tiny-hybrid","prompt":"slow","max_tokens":100,"temperature":0,"stream":true}`))
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body) // the whole stream lasts longer than the deadline
	require.NoError(t, err)
	require.Contains(t, string(b), "[DONE]")
}

// stalledHeap measures what n stalled streams keep on the heap once the
// scheduler has finished them.
func stalledHeap(t *testing.T, n int, writeTimeout time.Duration) (perStream int64, goroutines int) {
	sched := newModelScheduler(t, model.TinyHybrid, 0, n+1)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := httptest.NewUnstartedServer(New(Config{Model: model.TinyHybrid, WriteTimeout: writeTimeout}, sched))
	srv.Listener = smallBuffers{ln}
	srv.Start()
	t.Cleanup(srv.Close)
	// One stalled stream first, so lazily built state (executor scratch,
	// server maps) is not counted.
	dialStalled(t, ln.Addr().String(), `{"model":"tiny-hybrid","prompt":"warm","max_tokens":2000,"temperature":0,"stream":true}`)
	require.Eventually(t, func() bool { return sched.Live() == 0 }, 60*time.Second, 10*time.Millisecond)
	time.Sleep(2 * writeTimeout)
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	g0 := runtime.NumGoroutine()
	for range n {
		dialStalled(t, ln.Addr().String(), `{"model":"tiny-hybrid","prompt":"stall","max_tokens":1500,"temperature":0,"stream":true}`)
	}
	require.Eventually(t, func() bool { return sched.Live() == 0 }, 60*time.Second, 10*time.Millisecond)
	time.Sleep(2 * writeTimeout)
	var after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&after)
	return (int64(after.HeapAlloc) - int64(before.HeapAlloc)) / int64(n), runtime.NumGoroutine() - g0
}

// TestStalledStreamsHeap reports the heap and goroutines kept per stalled
// stream after the scheduler finished them, with and without a write deadline
// (the closing note's figures). Skipped in -short.
func TestStalledStreamsHeap(t *testing.T) {
	if testing.Short() {
		t.Skip("measurement")
	}
	per, g := stalledHeap(t, 10, 200*time.Millisecond)
	t.Logf("write deadline 200ms: %d bytes of heap and %d goroutines kept per stalled stream (10 streams)", per, g/10)
	require.Less(t, per, int64(48<<10), "c988462 kept 191 KB and 2 goroutines per stalled stream")
	require.Less(t, g, 10, "no goroutine left per stalled stream")
}

// Issue 19 finding 3, through the handler: a request refused with 429
// allocates nothing sized by its max_tokens (the closing note's figure).
func TestRefusedRequestHeap(t *testing.T) {
	exec, err := model.Lookup(model.TinyHybrid)
	require.NoError(t, err)
	cfg, err := worker.PoolConfig(exec.Spec(), worker.PoolParams{MaxBatchSize: 1})
	require.NoError(t, err)
	m, err := hybrid.New(cfg)
	require.NoError(t, err)
	r, err := worker.NewRank(0, m, exec, make([]byte, cfg.KV.ArenaBytes()), make([]byte, cfg.Mamba.ArenaBytes()))
	require.NoError(t, err)
	sched, err := worker.NewScheduler(worker.Config{Role: worker.RoleDecode, QueueSize: 1}, []*worker.Rank{r})
	require.NoError(t, err) // not running: one request fills the queue
	h := New(Config{Model: model.TinyHybrid}, sched)
	body := `{"model":"tiny-hybrid","prompt":"x","max_tokens":` + fmtInt(sched.MaxContext()-1) + `,"stream":true}`
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/completions", strings.NewReader(body))
	go h.ServeHTTP(httptest.NewRecorder(), first) // stays queued until cancelled
	require.Eventually(t, func() bool { return sched.Live() == 1 }, 5*time.Second, time.Millisecond)
	const n = 200
	reqs := make([]*http.Request, n)
	for i := range reqs {
		reqs[i] = httptest.NewRequest(http.MethodPost, "/v1/completions", strings.NewReader(body))
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for _, req := range reqs {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		require.Equal(t, http.StatusTooManyRequests, rec.Code)
	}
	runtime.ReadMemStats(&after)
	per := (after.TotalAlloc - before.TotalAlloc) / n
	t.Logf("max_tokens %d, refused with 429: %d bytes allocated per request", sched.MaxContext()-1, per)
	require.Less(t, per, uint64(32<<10))
}

// Issue 15: what a user reads of tiny-hybrid is printable UTF-8 text, plain
// and streamed, chunk by chunk (no control character but newline, no
// replacement character), whatever the prompt.
func TestTinyHybridTextReadable(t *testing.T) {
	srv := newServer(t, newScheduler(t, 0, 8))
	for i, prompt := range []string{"Hello, handoff", "\x00\x01\xff binary prompt \xc3", "世界"} {
		pb, _ := json.Marshal(prompt)
		for _, temp := range []string{"0", "1", "2"} {
			body := `{"model":"tiny-hybrid","prompt":` + string(pb) + `,"max_tokens":60,"temperature":` + temp + `,"seed":` + fmtInt(i) + `}`
			plain, _, _, _, chunks := completeBoth(t, srv.URL, body)
			texts := []string{plain.Text}
			for _, ch := range chunks {
				if len(ch.Choices) > 0 {
					texts = append(texts, ch.Choices[0].Text)
				}
			}
			for _, text := range texts {
				for _, r := range text {
					require.True(t, r == '\n' || r >= 0x20 && r != 0x7f && r != utf8.RuneError, "prompt %d T=%s: %q", i, temp, text)
				}
			}
		}
	}
}
