//go:build integration

package integration

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/require"
)

// Issue 19 finding 1, from exec: /readyz and the API port are probed in a
// tight loop from the moment the binary starts; readiness must never say
// 200 while the API refuses connections. Each mode starts a few times (the
// windows were milliseconds long).
func TestReadinessNeverAheadOfAPI(t *testing.T) {
	for _, mode := range []struct {
		name string
		args []string
	}{
		{"standalone", []string{"--standalone"}},
		{"local", []string{"--prefill", "local"}},
	} {
		t.Run(mode.name, func(t *testing.T) {
			for range 3 {
				probeStart(t, startProc(t, "decode", mode.args...))
			}
		})
	}
}

// probeStart probes p from its start until it is ready, failing on ready
// while its API refuses connections; it stops p.
func probeStart(t *testing.T, p *proc) {
	t.Helper()
	defer func() { // SIGTERM, so the embedded NATS removes its store
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			p.kill()
		}
	}()
	client := &http.Client{Timeout: 500 * time.Millisecond}
	probes, unready := 0, 0
	deadline := time.Now().Add(readyWithin)
	for ; time.Now().Before(deadline); probes++ {
		select {
		case <-p.done:
			t.Fatalf("decode exited: %s", tail(p.log.String(), 3000))
		default:
		}
		resp, err := client.Get(p.admin + "/readyz")
		if err != nil {
			continue // the admin port is not open yet
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			unready++
			continue
		}
		// The API's "listening" line was logged before readiness could
		// pass, so it is in the log by now (a file the worker writes):
		// ready without it is readiness ahead of the API.
		apiHost, ok := p.listening("http")
		require.Truef(t, ok, "probe %d: ready (%s) before the API listened", probes, body)
		c, err := net.DialTimeout("tcp", apiHost, time.Second)
		require.NoErrorf(t, err, "probe %d: ready (%s) while the API refuses connections", probes, body)
		c.Close()
		t.Logf("ready after %d probes (%d answered 503)", probes, unready)
		return
	}
	t.Fatalf("never ready within %v", readyWithin)
}

// A decode whose NATS never answers is never ready (it answered 200 for
// its first milliseconds, before any check was registered).
func TestNotReadyWithoutNATS(t *testing.T) {
	// A reserved port refuses connections (no server listens there), and
	// nothing else is handed it meanwhile (reservePort).
	p := startProc(t, "decode", "--nats-url", "nats://127.0.0.1:"+itoa(reservePort(t)))
	client := &http.Client{Timeout: 500 * time.Millisecond}
	answered := 0
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); {
		resp, err := client.Get(p.admin + "/readyz")
		if err != nil {
			continue
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		answered++
		require.Equalf(t, http.StatusServiceUnavailable, resp.StatusCode, "probe %d: %s", answered, body)
	}
	require.Positive(t, answered)
}

// Issue 19 finding 6: a second SIGTERM during the drain ends it at once and
// the process exits nonzero (it waited for --drain-timeout).
func TestSecondSignalEndsDrain(t *testing.T) {
	p := startProc(t, "decode", "--prefill", "local", "--model", "tiny-hybrid?decode_delay=20ms", "--drain-timeout", "120s")
	p.waitReady(readyWithin)
	reqDone := make(chan int, 1)
	go func() {
		resp, err := http.Post(p.api+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"tiny-hybrid","prompt":"keep me busy","max_tokens":3000,"temperature":0}`))
		if err != nil {
			reqDone <- 0
			return
		}
		resp.Body.Close()
		reqDone <- resp.StatusCode
	}()
	require.Eventually(t, func() bool {
		return sum(p.metrics(), "handoff_mamba_rows", map[string]string{"role": "decode", "state": "used"}) == 1
	}, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	require.Eventually(t, func() bool {
		resp, err := http.Get(p.admin + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusServiceUnavailable
	}, 10*time.Second, 10*time.Millisecond, "draining")
	start := time.Now()
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-p.done:
	case <-time.After(20 * time.Second):
		t.Fatal("a second SIGTERM did not end the drain")
	}
	t.Logf("exited %v after the second signal: %v", time.Since(start).Round(time.Millisecond), p.cmd.ProcessState)
	require.NotZero(t, p.cmd.ProcessState.ExitCode(), "an aborted drain exits nonzero")
	require.Equal(t, http.StatusServiceUnavailable, <-reqDone)
}

// The official OpenAI Go client drives the API: plain and streamed
// completions, stop, echo and logprobs (issue 19), and a typed error for a
// parameter that is refused by name.
func TestOpenAIClient(t *testing.T) {
	p := startProc(t, "decode", "--standalone")
	p.waitReady(readyWithin)
	client := openai.NewClient(option.WithBaseURL(p.api+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	params := openai.CompletionNewParams{
		Model:       openai.CompletionNewParamsModel("tiny-hybrid"),
		Prompt:      openai.CompletionNewParamsPromptUnion{OfString: openai.String("Hello, handoff")},
		MaxTokens:   openai.Int(40),
		Temperature: openai.Float(0),
	}
	full, err := client.Completions.New(ctx, params)
	require.NoError(t, err)
	require.Len(t, full.Choices, 1)
	text := full.Choices[0].Text
	require.Equal(t, openai.CompletionChoiceFinishReasonLength, full.Choices[0].FinishReason)
	require.Equal(t, int64(40), full.Usage.CompletionTokens)

	t.Run("stream", func(t *testing.T) {
		s := client.Completions.NewStreaming(ctx, params)
		var got strings.Builder
		for s.Next() {
			if c := s.Current(); len(c.Choices) > 0 {
				got.WriteString(c.Choices[0].Text)
			}
		}
		require.NoError(t, s.Err())
		require.Equal(t, text, got.String())
	})
	t.Run("stop", func(t *testing.T) {
		// Two ASCII characters of the output: the same bytes in the
		// generated text (other bytes reach the client as U+FFFD).
		at := -1
		for i := 8; i+1 < len(text); i++ {
			if text[i] > 0 && text[i] < 0x80 && text[i+1] > 0 && text[i+1] < 0x80 {
				at = i
				break
			}
		}
		require.GreaterOrEqual(t, at, 0, "no ASCII pair in %q", text)
		stop := text[at : at+2]
		at = strings.Index(text, stop)
		sp := params
		sp.Stop = openai.CompletionNewParamsStopUnion{OfStringArray: []string{"not in it", stop}}
		c, err := client.Completions.New(ctx, sp)
		require.NoError(t, err)
		require.Equal(t, text[:at], c.Choices[0].Text)
		require.Equal(t, openai.CompletionChoiceFinishReasonStop, c.Choices[0].FinishReason)
		s := client.Completions.NewStreaming(ctx, sp)
		var got strings.Builder
		var finish string
		for s.Next() {
			if c := s.Current(); len(c.Choices) > 0 {
				got.WriteString(c.Choices[0].Text)
				if c.Choices[0].FinishReason != "" {
					finish = string(c.Choices[0].FinishReason)
				}
			}
		}
		require.NoError(t, s.Err())
		require.Equal(t, text[:at], got.String(), "the stream never shows the stop sequence")
		require.Equal(t, "stop", finish)
	})
	t.Run("echo", func(t *testing.T) {
		ep := params
		ep.Echo = openai.Bool(true)
		c, err := client.Completions.New(ctx, ep)
		require.NoError(t, err)
		require.Equal(t, "Hello, handoff"+text, c.Choices[0].Text)
	})
	t.Run("logprobs", func(t *testing.T) {
		lp := params
		lp.Logprobs = openai.Int(2)
		c, err := client.Completions.New(ctx, lp)
		require.NoError(t, err)
		require.Equal(t, text, c.Choices[0].Text)
		l := c.Choices[0].Logprobs
		require.Len(t, l.Tokens, 40)
		require.Len(t, l.TokenLogprobs, 40)
		require.Len(t, l.TopLogprobs, 40)
		require.Len(t, l.TextOffset, 40)
		for i := range l.Tokens {
			require.LessOrEqual(t, l.TokenLogprobs[i], 0.0)
			require.Len(t, l.TopLogprobs[i], 2)
			best := -1e30
			for _, v := range l.TopLogprobs[i] {
				best = max(best, v)
			}
			require.InDelta(t, best, l.TokenLogprobs[i], 1e-6, "greedy picks the most likely token (%d)", i)
		}
	})
	t.Run("chat", func(t *testing.T) {
		cp := openai.ChatCompletionNewParams{
			Model: "tiny-hybrid",
			Messages: []openai.ChatCompletionMessageParamUnion{
				openai.SystemMessage("Be brief."), openai.UserMessage("Hello, handoff"),
			},
			MaxCompletionTokens: openai.Int(24),
			Temperature:         openai.Float(0),
			Logprobs:            openai.Bool(true),
			TopLogprobs:         openai.Int(2),
		}
		c, err := client.Chat.Completions.New(ctx, cp)
		require.NoError(t, err)
		require.Len(t, c.Choices, 1)
		require.Equal(t, "assistant", string(c.Choices[0].Message.Role))
		require.Equal(t, "length", c.Choices[0].FinishReason)
		require.Equal(t, int64(24), c.Usage.CompletionTokens)
		require.Len(t, c.Choices[0].Logprobs.Content, 24)
		require.Len(t, c.Choices[0].Logprobs.Content[0].TopLogprobs, 2)

		cp.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
		s := client.Chat.Completions.NewStreaming(ctx, cp)
		var acc openai.ChatCompletionAccumulator
		var got strings.Builder
		for s.Next() {
			ch := s.Current()
			acc.AddChunk(ch)
			if len(ch.Choices) > 0 {
				got.WriteString(ch.Choices[0].Delta.Content)
			}
		}
		require.NoError(t, s.Err())
		require.Equal(t, c.Choices[0].Message.Content, got.String(), "streamed deltas add up to the message")
		require.Equal(t, c.Choices[0].Message.Content, acc.Choices[0].Message.Content)
		require.Equal(t, int64(24), acc.Usage.CompletionTokens, "include_usage")
	})
	t.Run("refused by name", func(t *testing.T) {
		bp := params
		bp.BestOf = openai.Int(3)
		_, err := client.Completions.New(ctx, bp)
		var apiErr *openai.Error
		require.True(t, errors.As(err, &apiErr), "%v", err)
		require.Equal(t, http.StatusBadRequest, apiErr.StatusCode)
		require.Equal(t, "unsupported_value", apiErr.Code)
		require.Equal(t, "best_of", apiErr.Param)
	})
}
