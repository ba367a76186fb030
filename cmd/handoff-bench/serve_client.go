package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/handoff-io/handoff/cmd/handoff-bench/internal/serving"
)

// serveClient sends completion requests to OpenAI-compatible servers: one,
// or several taken in turn (a round-robin load balancer in front of
// replicas).
type serveClient struct {
	http        *http.Client
	base        string   // the first base URL, without a trailing slash
	url         string   // the first server's completions endpoint
	urls        []string // every server's completions endpoint, in turn
	next        atomic.Uint64
	apiKey      string // OPENAI_API_KEY, sent as a bearer token when set
	ignoreEOS   bool
	temperature float64 // NaN: not sent
	timeout     time.Duration
}

// newServeClient returns a client for o's server; rt nil means a transport
// that keeps as many connections open as there are requests in flight.
func newServeClient(o serveOptions, rt http.RoundTripper) *serveClient {
	if rt == nil {
		rt = &http.Transport{
			Proxy:               http.ProxyFromEnvironment,
			DialContext:         (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConnsPerHost: 1 << 14, // every request of an inf-rate run may be in flight at once
			IdleConnTimeout:     90 * time.Second,
			DisableCompression:  true, // a compressed event stream would be buffered by the decompressor
		}
	}
	var urls []string
	for _, b := range strings.Split(o.baseURL, ",") {
		urls = append(urls, strings.TrimRight(strings.TrimSpace(b), "/")+"/"+strings.TrimLeft(o.endpoint, "/"))
	}
	base := strings.TrimRight(strings.TrimSpace(strings.Split(o.baseURL, ",")[0]), "/")
	return &serveClient{
		http:        &http.Client{Transport: rt},
		base:        base,
		url:         urls[0],
		urls:        urls,
		apiKey:      os.Getenv("OPENAI_API_KEY"),
		ignoreEOS:   o.ignoreEOS,
		temperature: o.temperature,
		timeout:     o.timeout,
	}
}

func (c *serveClient) newRequest(ctx context.Context, method, url string, body any) (*http.Request, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, fmt.Errorf("encoding request: %w", err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		return nil, fmt.Errorf("building request: %w", err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	return req, nil
}

// nextURL is the completions endpoint of the server whose turn it is.
func (c *serveClient) nextURL() string {
	return c.urls[(c.next.Add(1)-1)%uint64(len(c.urls))]
}

// firstModel returns the id of the first model GET /v1/models lists.
func (c *serveClient) firstModel(ctx context.Context) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	req, err := c.newRequest(ctx, http.MethodGet, c.base+"/v1/models", nil)
	if err != nil {
		return "", fmt.Errorf("serve: models: %w", err)
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := c.doJSON(req, &list); err != nil {
		return "", fmt.Errorf("serve: listing the server's models (or give --model): %w", err)
	}
	if len(list.Data) == 0 || list.Data[0].ID == "" {
		return "", fmt.Errorf("serve: %s/v1/models lists no model; give --model", c.base)
	}
	return list.Data[0].ID, nil
}

// probePrompt is sent once to learn what the server counts as a token.
const probePrompt = "handoff-bench probe: how many tokens does this prompt have?"

// probeUnit sends probePrompt (non-streamed, one output token) and returns
// UnitBytes when the server counts its bytes as its prompt tokens, as a
// byte-level tokenizer does, and UnitWords otherwise.
func (c *serveClient) probeUnit(ctx context.Context, model string) (serving.Unit, error) {
	return c.probeUnitAt(ctx, model, c.url)
}

// probeUnitAt is probeUnit through the completions endpoint at url.
func (c *serveClient) probeUnitAt(ctx context.Context, model, url string) (serving.Unit, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	req, err := c.newRequest(ctx, http.MethodPost, url, map[string]any{
		"model": model, "prompt": probePrompt, "max_tokens": 1, "stream": false})
	if err != nil {
		return "", fmt.Errorf("serve: probe: %w", err)
	}
	var resp struct {
		Usage *serving.Usage `json:"usage"`
	}
	if err := c.doJSON(req, &resp); err != nil {
		return "", fmt.Errorf("serve: probing the tokenizer (or give --token-unit): %w", err)
	}
	if resp.Usage != nil && resp.Usage.PromptTokens == len(probePrompt) {
		return serving.UnitBytes, nil
	}
	return serving.UnitWords, nil
}

// doJSON sends req and decodes a 200 response's JSON body into v.
func (c *serveClient) doJSON(req *http.Request, v any) error {
	resp, err := c.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return statusError(resp)
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(v); err != nil {
		return fmt.Errorf("decoding %s %s: %w", req.Method, req.URL.Path, err)
	}
	return nil
}

// statusError describes a non-200 response by its status and the message of
// its OpenAI error body, if it has one.
func statusError(resp *http.Response) error {
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	var e struct {
		Error json.RawMessage `json:"error"`
	}
	msg := strings.TrimSpace(string(body))
	if json.Unmarshal(body, &e) == nil && len(e.Error) > 0 {
		msg = serving.ErrorMessage(e.Error)
	}
	return fmt.Errorf("HTTP %s: %s", resp.Status, msg)
}

// complete sends one streamed completion and times it. runStart is the
// origin of Result.Start. A request cut short because ctx ended is marked
// Cancelled, not failed; one that ran past --request-timeout failed.
func (c *serveClient) complete(ctx context.Context, model string, runStart time.Time, in serving.Request, id string) serving.Result {
	res := serving.Result{PromptLen: in.PromptLen}
	fail := func(err error) serving.Result {
		res.Success = false
		if ctx.Err() != nil {
			res.Cancelled = true
			res.Error = "cancelled: " + context.Cause(ctx).Error()
		} else {
			res.Error = err.Error()
		}
		return res
	}
	body := map[string]any{
		"model":          model,
		"prompt":         in.Prompt,
		"max_tokens":     in.OutputLen,
		"stream":         true,
		"stream_options": map[string]any{"include_usage": true},
	}
	if c.ignoreEOS {
		body["ignore_eos"] = true
	}
	if !math.IsNaN(c.temperature) {
		body["temperature"] = c.temperature
	}
	rctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	req, err := c.newRequest(rctx, http.MethodPost, c.nextURL(), body)
	if err != nil {
		return fail(err)
	}
	req.Header.Set("X-Request-Id", id)

	start := time.Now()
	res.Start = start.Sub(runStart)
	resp, err := c.http.Do(req)
	if err != nil {
		return fail(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fail(statusError(resp))
	}
	var (
		text   strings.Builder
		last   time.Time
		chunks int
		usage  *serving.Usage
		ended  time.Time // when an end-marker chunk came
	)
	events := serving.NewSSEReader(resp.Body)
	for {
		data, err := events.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fail(err)
		}
		if string(data) == serving.Done {
			break
		}
		now := time.Now()
		ch, err := serving.ParseChunk(data)
		if err != nil {
			return fail(err)
		}
		if ch.Err != "" {
			return fail(fmt.Errorf("server error in stream: %s", ch.Err))
		}
		if ch.Usage != nil {
			usage = ch.Usage
		}
		if ch.HasChoices && !ch.Token() && ended.IsZero() {
			ended = now
		}
		if !ch.Token() {
			continue
		}
		if chunks == 0 {
			res.TTFT = now.Sub(start)
		} else {
			res.ITL = append(res.ITL, now.Sub(last))
		}
		last = now
		chunks++
		text.WriteString(ch.Text)
	}
	if chunks == 0 && !ended.IsZero() {
		// No token chunk, only the end marker: the server generated no
		// text (an immediate EOS). vLLM counts that chunk as the first
		// token; so does this, with the server's token count.
		res.TTFT, last = ended.Sub(start), ended
	} else if chunks == 0 {
		return fail(errors.New("never received a chunk with choices to time TTFT"))
	}
	res.Success = true
	res.Latency = last.Sub(start)
	res.Text = text.String()
	res.OutputTokens = chunks // without usage, one token per chunk
	if usage != nil && usage.CompletionTokens > 0 {
		res.OutputTokens = usage.CompletionTokens
	}
	if usage != nil && usage.PromptTokens > 0 {
		res.PromptLen = usage.PromptTokens
	}
	return res
}
