package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/handoff-io/handoff/cmd/handoff-bench/internal/serving"
	"github.com/handoff-io/handoff/worker"
)

// multiTurnOptions are serve's flags for --dataset-name multi-turn.
type multiTurnOptions struct {
	conversations int
	turns         int
	systemTokens  int
	turnTokens    int
	thinkTime     time.Duration
	// prefixCache lists the --prefix-cache values of the spawned workers,
	// one run each, in order; empty: one run, the flag not passed.
	prefixCache  []string
	spawnModel   string // non-empty: run the workers in this process
	spawnPrefill string // local (one aggregated decode worker) or remote (a prefill and a decode worker)
	// prefillInstances is how many prefill workers remote runs spawn.
	prefillInstances int
	workerArgs       []string // more flags for every spawned worker
}

func addMultiTurnFlags(fs *flag.FlagSet, m *multiTurnOptions, prefixCache, workerArgs *string) {
	fs.IntVar(&m.conversations, "conversations", 32, "multi-turn: conversations; they start at --request-rate (conversations per second) and run their turns one after another")
	fs.IntVar(&m.turns, "turns", 6, "multi-turn: turns per conversation")
	fs.IntVar(&m.systemTokens, "system-prompt-tokens", 2048, "multi-turn: the system prompt every conversation opens with")
	fs.IntVar(&m.turnTokens, "turn-tokens", 96, "multi-turn: mean length of each new user message (--random-range-ratio applies); replies are --random-output-len")
	fs.DurationVar(&m.thinkTime, "think-time", 2*time.Second, "multi-turn: mean pause between a reply and the next turn (exponential draws; 0: none)")
	fs.StringVar(prefixCache, "prefix-cache", "", "multi-turn with --spawn-model: the spawned workers' --prefix-cache, comma-separated values run one after another on fresh workers (on,off: the same workload with the cache on and off, and the ratio); on/R also passes the decode worker --prefill-routing R (state, affinity or load), so that on/state,on/load compares routings, and on/R/noreturn passes every worker --state-return off (each worker's own cache only); empty: not passed")
	fs.StringVar(&m.spawnModel, "spawn-model", "", "multi-turn: run handoff workers in this process with this --model (e.g. 'nemotron-h-8b?gpu=h200&touch=head') instead of loading --base-url")
	fs.StringVar(&m.spawnPrefill, "spawn-prefill", "local", "with --spawn-model: local (one decode worker prefilling itself) or remote (a prefill worker and a decode worker, the cache handed off)")
	fs.IntVar(&m.prefillInstances, "spawn-prefill-instances", 1, "with --spawn-prefill remote: prefill workers to spawn (the decode worker routes among them: --prefix-cache on/R)")
	fs.StringVar(workerArgs, "worker-args", "", "with --spawn-model: more flags for every spawned worker, space-separated (e.g. '--kv-blocks 4096 --max-batch-size 16')")
}

// checkMultiTurn validates the multi-turn flags of o (parsed).
func checkMultiTurn(o *serveOptions, prefixCache, workerArgs string, set map[string]bool) error {
	m := &o.mt
	for _, v := range strings.Split(prefixCache, ",") {
		if v = strings.TrimSpace(v); v == "" {
			continue
		}
		cache, rest, _ := strings.Cut(v, "/")
		routing, ret, _ := strings.Cut(rest, "/")
		if v != "on" && v != "off" && (cache != "on" || !slices.Contains([]string{"state", "affinity", "load"}, routing) || ret != "" && ret != "noreturn") {
			return fmt.Errorf("serve: --prefix-cache %q: want on, off, on/R or on/R/noreturn with R state, affinity or load, comma-separated", prefixCache)
		}
		if slices.Contains(m.prefixCache, v) {
			return fmt.Errorf("serve: --prefix-cache %q names %s twice", prefixCache, v)
		}
		m.prefixCache = append(m.prefixCache, v)
	}
	m.workerArgs = strings.Fields(workerArgs)
	if o.dataset != "multi-turn" {
		for _, f := range []string{"conversations", "turns", "system-prompt-tokens", "turn-tokens", "think-time",
			"prefix-cache", "spawn-model", "spawn-prefill", "spawn-prefill-instances", "worker-args"} {
			if set[f] {
				return fmt.Errorf("serve: --%s needs --dataset-name multi-turn", f)
			}
		}
		return nil
	}
	switch {
	case m.conversations < 1 || m.turns < 1:
		return errors.New("serve: --conversations and --turns must be >= 1")
	case m.systemTokens < 0 || m.turnTokens < 1:
		return errors.New("serve: --system-prompt-tokens must be >= 0 and --turn-tokens >= 1")
	case m.thinkTime < 0:
		return errors.New("serve: --think-time must be >= 0")
	case len(o.sweepRates) > 0:
		return errors.New("serve: --sweep-rates does not apply to --dataset-name multi-turn")
	case o.maxConcurrency > 0:
		return errors.New("serve: --max-concurrency does not apply to --dataset-name multi-turn (conversations arrive at --request-rate)")
	case len(m.prefixCache) > 0 && m.spawnModel == "":
		return errors.New("serve: --prefix-cache needs --spawn-model: the benchmark switches the cache of the workers it runs, not of a server at --base-url")
	case m.spawnPrefill != "local" && m.spawnPrefill != "remote":
		return fmt.Errorf("serve: --spawn-prefill %q: want local or remote", m.spawnPrefill)
	case (set["spawn-prefill"] || set["worker-args"] || set["spawn-prefill-instances"]) && m.spawnModel == "":
		return errors.New("serve: --spawn-prefill, --spawn-prefill-instances and --worker-args need --spawn-model")
	case m.prefillInstances < 1 || m.prefillInstances > 1 && m.spawnPrefill != "remote":
		return fmt.Errorf("serve: --spawn-prefill-instances %d: want >= 1, and more than 1 only with --spawn-prefill remote", m.prefillInstances)
	case m.spawnModel != "" && set["base-url"]:
		return errors.New("serve: --spawn-model and --base-url exclude each other")
	}
	if !set["plot"] {
		o.plot = "serve-multiturn.png"
	}
	return nil
}

// chatEndpoint reports whether the endpoint is a chat completions one.
func chatEndpoint(endpoint string) bool {
	return strings.HasSuffix(strings.TrimRight(endpoint, "/"), "chat/completions")
}

// multiTurnRun is one run of the workload (one --prefix-cache value).
type multiTurnRun struct {
	PrefixCache string                `json:"prefix_cache"` // "" when not switched
	Duration    float64               `json:"duration"`     // seconds, the first arrival to the last reply
	Partial     bool                  `json:"partial"`
	NotSent     int                   `json:"not_sent"` // turns never sent: interrupted, or after a failed turn
	Turn1       serving.TurnSummary   `json:"turn1"`
	Later       serving.TurnSummary   `json:"turns_2_up"`
	All         serving.TurnSummary   `json:"all_turns"`
	PerTurn     []serving.TurnSummary `json:"per_turn"`
	// Goodput is the turns per second that met every objective of
	// --goodput, and Attainment their share of the turns sent (both 0
	// without --goodput).
	Goodput    float64  `json:"goodput_turns_per_s,omitempty"`
	Attainment float64  `json:"slo_attainment,omitempty"`
	Errors     []string `json:"errors,omitempty"` // up to 10
	records    []serving.TurnRecord
}

// multiTurnReport is the JSON report of --dataset-name multi-turn.
type multiTurnReport struct {
	Date          string         `json:"date"`
	Dataset       string         `json:"dataset"`
	Label         string         `json:"label"`
	ModelID       string         `json:"model_id"`
	TokenizerID   string         `json:"tokenizer_id"`
	Endpoint      string         `json:"endpoint"`
	Spawned       string         `json:"spawned,omitempty"` // local or remote prefill, when the workers ran here
	Conversations int            `json:"conversations"`
	Turns         int            `json:"turns"`
	SystemTokens  int            `json:"system_prompt_tokens"`
	TurnTokens    int            `json:"turn_tokens"`
	OutputTokens  int            `json:"output_tokens"`
	RangeRatio    float64        `json:"range_ratio"`
	ThinkTime     float64        `json:"think_time_s"`
	RequestRate   any            `json:"request_rate"` // conversations per second; "inf"
	Seed          uint64         `json:"seed"`
	Runs          []multiTurnRun `json:"runs"`
	// Ratios of the run with the cache on to the one with it off, when
	// both ran: turn >= 2 TTFT p50 and p90, and computed prompt tokens.
	RatioTTFTp50 *float64 `json:"ratio_turns_2_up_ttft_p50_on_off,omitempty"`
	RatioTTFTp90 *float64 `json:"ratio_turns_2_up_ttft_p90_on_off,omitempty"`
	RatioCompute *float64 `json:"ratio_computed_prompt_tokens_on_off,omitempty"`
	// SLO is --goodput; RatioGoodput the on run's goodput to the off
	// run's.
	SLO          serving.SLO `json:"slo,omitempty"`
	RatioGoodput *float64    `json:"ratio_goodput_on_off,omitempty"`
}

// serveMultiTurn runs --dataset-name multi-turn: the workload once per
// --prefix-cache value (or once), then the report and the plot. As serve,
// an interruption after a run started is reported, not returned.
func serveMultiTurn(ctx context.Context, o serveOptions, stdout, stderr io.Writer, tty bool) error {
	modes := o.mt.prefixCache
	if len(modes) == 0 {
		modes = []string{""}
	}
	rep := multiTurnReport{Date: time.Now().Format("20060102-150405"), Dataset: "multi-turn", Label: o.label,
		Endpoint: o.endpoint, Conversations: o.mt.conversations, Turns: o.mt.turns,
		SystemTokens: o.mt.systemTokens, TurnTokens: o.mt.turnTokens, OutputTokens: o.outputLen,
		RangeRatio: o.rangeRatio, ThinkTime: o.mt.thinkTime.Seconds(), RequestRate: jsonRate(o.requestRate), Seed: o.seed}
	if o.mt.spawnModel != "" {
		rep.Spawned = o.mt.spawnPrefill + " prefill"
		if o.mt.prefillInstances > 1 {
			rep.Spawned = fmt.Sprintf("remote prefill x%d", o.mt.prefillInstances)
		}
	}
	var (
		system string
		convs  []serving.Conversation
		unit   serving.Unit
	)
	for _, mode := range modes {
		if ctx.Err() != nil {
			break
		}
		run, err := func() (multiTurnRun, error) {
			ro := o
			if o.mt.spawnModel != "" {
				cl, base, err := spawnServe(ctx, o, mode)
				if err != nil {
					return multiTurnRun{}, err
				}
				defer cl.close()
				ro.baseURL = base
				fmt.Fprintf(stderr, "spawned %s prefill workers, --prefix-cache %q, API %s\n", o.mt.spawnPrefill, mode, base)
			}
			c := newServeClient(ro, nil)
			defer c.http.CloseIdleConnections()
			if convs == nil {
				var err error
				if unit, err = prepareMultiTurn(ctx, &o, c, stderr); err != nil {
					return multiTurnRun{}, err
				}
				system, convs = serving.Conversations(serving.ConversationSpec{
					Conversations: o.mt.conversations, Turns: o.mt.turns, SystemTokens: o.mt.systemTokens,
					TurnTokens: o.mt.turnTokens, OutputTokens: o.outputLen, RangeRatio: o.rangeRatio,
					ThinkTime: o.mt.thinkTime, Unit: unit}, rand.New(rand.NewPCG(o.seed, 1)))
			}
			test, err := c.testTurn(ctx, o.model, chatEndpoint(o.endpoint), unit)
			if err != nil {
				return multiTurnRun{}, err
			}
			label := "multi-turn"
			if mode != "" {
				label += " prefix-cache " + mode
			}
			prog := newProgress(stderr, o.progress, tty, label, o.mt.conversations*o.mt.turns)
			run := runConversations(ctx, c, o, unit, system, convs, []serving.Seen{test}, prog)
			prog.finish()
			run.PrefixCache = mode
			return run, nil
		}()
		if err != nil {
			if len(rep.Runs) == 0 && ctx.Err() != nil {
				return fmt.Errorf("serve: %w", context.Cause(ctx))
			}
			if len(rep.Runs) == 0 {
				return err
			}
			fmt.Fprintln(stderr, "handoff-bench:", err)
			break
		}
		for i, e := range run.Errors {
			fmt.Fprintf(stderr, "Error %d: %s\n", i, e)
		}
		rep.Runs = append(rep.Runs, run)
	}
	if len(rep.Runs) == 0 {
		return fmt.Errorf("serve: %w", context.Cause(ctx))
	}
	rep.ModelID, rep.TokenizerID = o.model, "handoff-bench:"+string(unit)
	var on, off *multiTurnRun
	for i := range rep.Runs {
		switch rep.Runs[i].PrefixCache {
		case "on", "on/state":
			on = &rep.Runs[i]
		case "off":
			off = &rep.Runs[i]
		}
	}
	if on != nil && off != nil {
		rep.RatioTTFTp50 = onOff(on.Later.TTFTp50, off.Later.TTFTp50)
		rep.RatioTTFTp90 = onOff(on.Later.TTFTp90, off.Later.TTFTp90)
		rep.RatioCompute = onOff(float64(on.All.ComputedTokens), float64(off.All.ComputedTokens))
		if len(o.slo) > 0 {
			rep.RatioGoodput = onOff(on.Goodput, off.Goodput)
		}
	}
	if len(o.slo) > 0 {
		rep.SLO = o.slo
	}
	if o.plot != "" {
		if err := writeMultiTurnPlot(o.plot, rep.Runs, rep.Runs[len(rep.Runs)-1].Partial); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "plot: %s\n", o.plot)
	}
	js, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return fmt.Errorf("serve: report: %w", err)
	}
	if o.resultFile != "" {
		if err := os.WriteFile(o.resultFile, append(js, '\n'), 0o644); err != nil {
			return fmt.Errorf("serve: %w", err)
		}
	}
	if o.output == "json" {
		_, err = fmt.Fprintf(stdout, "%s\n", js)
		return err
	}
	return writeMultiTurnTable(stdout, rep)
}

func onOff(a, b float64) *float64 {
	if b <= 0 {
		return nil
	}
	r := a / b
	return &r
}

func jsonRate(r float64) any {
	if math.IsInf(r, 1) {
		return "inf"
	}
	return r
}

// spawnServe starts the workers of one run and returns the decode worker's
// base URL. The prefix cache's flag is passed only when a value is given,
// so that the benchmark runs on workers that do not know it.
func spawnServe(ctx context.Context, o serveOptions, mode string) (*benchCluster, string, error) {
	cl, err := newBenchCluster(ctx)
	if err != nil {
		return nil, "", fmt.Errorf("serve: %w", err)
	}
	common := []string{"--model", o.mt.spawnModel, "--namespace", "serve-mt"}
	cache, rest, _ := strings.Cut(mode, "/")
	routing, ret, _ := strings.Cut(rest, "/")
	if cache != "" {
		common = append(common, "--prefix-cache", cache)
	}
	if ret == "noreturn" {
		common = append(common, "--state-return", "off")
	}
	common = append(common, o.mt.workerArgs...)
	var d *benchWorker
	if o.mt.spawnPrefill == "remote" {
		for i := range o.mt.prefillInstances {
			// Workers in one process would share the default id
			// (hostname-pid), and with it their instance subjects.
			if _, err = cl.start(worker.RolePrefill, append([]string{"--instance-id", fmt.Sprintf("bench-prefill-%d", i)}, common...)...); err != nil {
				break
			}
		}
		if err == nil {
			args := []string{"--prefill", "remote", "--http-addr", "127.0.0.1:0"}
			if routing != "" {
				args = append(args, "--prefill-routing", routing)
			}
			d, err = cl.start(worker.RoleDecode, append(args, common...)...)
		}
	} else {
		d, err = cl.start(worker.RoleDecode, append([]string{"--prefill", "local", "--http-addr", "127.0.0.1:0"}, common...)...)
	}
	if err != nil {
		cl.close()
		return nil, "", fmt.Errorf("serve: spawning workers: %w", err)
	}
	return cl, d.api, nil
}

// prepareMultiTurn completes o from the server (the model) and picks the
// token unit; a chat endpoint is probed through /v1/completions beside it.
func prepareMultiTurn(ctx context.Context, o *serveOptions, c *serveClient, stderr io.Writer) (serving.Unit, error) {
	var err error
	if o.model == "" {
		if o.model, err = c.firstModel(ctx); err != nil {
			return "", err
		}
		fmt.Fprintf(stderr, "model: %s (the first the server lists)\n", o.model)
	}
	if o.unit != "auto" {
		return serving.ParseUnit(o.unit)
	}
	url := c.url
	if chatEndpoint(o.endpoint) {
		url = c.base + "/v1/completions"
	}
	unit, err := c.probeUnitAt(ctx, o.model, url)
	if err != nil {
		return "", err
	}
	fmt.Fprintf(stderr, "token unit: %s (from the server's prompt_tokens of a probe)\n", unit)
	return unit, nil
}

// testTurn sends one short turn and fails when it does not complete. It
// returns what the turn showed the server, for the ideal hits: its
// template's header is a prefix of every conversation.
func (c *serveClient) testTurn(ctx context.Context, model string, chat bool, unit serving.Unit) (serving.Seen, error) {
	msgs := []serving.Message{{Role: "system", Content: "handoff-bench multi-turn test"}, {Role: "user", Content: "hello"}}
	r := c.sendTurn(ctx, model, msgs, 2, 1, chat, "multiturn-test")
	if r.err != nil {
		if ctx.Err() != nil {
			return serving.Seen{}, fmt.Errorf("serve: test turn: %w", context.Cause(ctx))
		}
		return serving.Seen{}, fmt.Errorf("serve: the test turn failed; check --base-url, --endpoint and --model: %w", r.err)
	}
	prompt := serving.RenderChat(msgs)
	return serving.Seen{Sent: -2, Done: -1, Prompt: serving.Tokens(unit, prompt),
		Seq: serving.Tokens(unit, prompt+r.reply)}, nil
}

// turnResult is what one turn's request gave.
type turnResult struct {
	start, done time.Time
	ttft        time.Duration
	reply       string
	usage       *serving.Usage
	err         error
}

// sendTurn sends one turn, streamed with usage: the messages to a chat
// endpoint, or their rendering (serving.RenderChat) as the prompt of a
// completions endpoint. TTFT is the POST to the first chunk with text.
func (c *serveClient) sendTurn(ctx context.Context, model string, msgs []serving.Message, maxTokens int, seed int64,
	chat bool, id string) turnResult {
	body := map[string]any{
		"model":          model,
		"max_tokens":     maxTokens,
		"stream":         true,
		"stream_options": map[string]any{"include_usage": true},
		"seed":           seed,
	}
	if chat {
		body["messages"] = msgs
	} else {
		body["prompt"] = serving.RenderChat(msgs)
	}
	if c.ignoreEOS {
		body["ignore_eos"] = true
	}
	if !math.IsNaN(c.temperature) {
		body["temperature"] = c.temperature
	}
	var res turnResult
	rctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	req, err := c.newRequest(rctx, http.MethodPost, c.nextURL(), body)
	if err != nil {
		res.err = err
		return res
	}
	req.Header.Set("X-Request-Id", id)
	res.start = time.Now()
	resp, err := c.http.Do(req)
	if err != nil {
		res.err = err
		return res
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		res.err = statusError(resp)
		return res
	}
	var text strings.Builder
	var first, ended time.Time
	events := serving.NewSSEReader(resp.Body)
	for {
		data, err := events.Next()
		if errors.Is(err, io.EOF) || (err == nil && string(data) == serving.Done) {
			break
		}
		if err != nil {
			res.err = err
			return res
		}
		now := time.Now()
		ch, err := serving.ParseChunk(data)
		if err != nil {
			res.err = err
			return res
		}
		if ch.Err != "" {
			res.err = fmt.Errorf("server error in stream: %s", ch.Err)
			return res
		}
		if ch.Usage != nil {
			res.usage = ch.Usage
		}
		if ch.HasChoices && ended.IsZero() && ch.FinishReason != "" {
			ended = now
		}
		if ch.Text != "" && first.IsZero() {
			first = now
		}
		text.WriteString(ch.Text)
	}
	res.done = time.Now()
	switch {
	case !first.IsZero():
		res.ttft = first.Sub(res.start)
	case !ended.IsZero():
		res.ttft = ended.Sub(res.start) // no text: an immediate EOS, timed by the end marker
	default:
		res.err = errors.New("never received a chunk with choices to time TTFT")
		return res
	}
	res.reply = text.String()
	return res
}

// runConversations runs the conversations: each starts at its arrival
// (--request-rate conversations per second, --burstiness) and sends its
// turns one after another, each after its think time, appending the reply
// it got. A conversation whose turn fails sends no more. The ideal hits are
// counted after the run from the times and texts of every turn, and of the
// requests the server saw before (before, at negative times).
func runConversations(ctx context.Context, c *serveClient, o serveOptions, unit serving.Unit, system string,
	convs []serving.Conversation, before []serving.Seen, prog *progress) multiTurnRun {
	arrivals := serving.Arrivals(len(convs), o.requestRate, o.burstiness, rand.New(rand.NewPCG(o.seed, 2)))
	chat := chatEndpoint(o.endpoint)
	type sent struct {
		rec       serving.TurnRecord
		seen      serving.Seen
		cancelled bool
	}
	out := make([][]sent, len(convs))
	runID := fmt.Sprintf("mt-%d", time.Now().UnixNano())
	start := time.Now()
	var wg sync.WaitGroup
	for i, conv := range convs {
		wg.Go(func() {
			sleep := func(d time.Duration) bool {
				t := time.NewTimer(d)
				defer t.Stop()
				select {
				case <-ctx.Done():
					return false
				case <-t.C:
					return true
				}
			}
			if !sleep(time.Until(start.Add(arrivals[i]))) {
				return
			}
			var replies []string
			for t := range conv.Users {
				if t > 0 && !sleep(conv.Think[t]) {
					return
				}
				msgs := serving.Turn(system, conv.Users, replies, t)
				prompt := serving.RenderChat(msgs)
				r := c.sendTurn(ctx, o.model, msgs, conv.MaxTokens[t], conv.Seeds[t], chat, fmt.Sprintf("%s-%d-%d", runID, i, t))
				toks := serving.Tokens(unit, prompt)
				s := sent{rec: serving.TurnRecord{Conversation: i, Turn: t, Success: r.err == nil,
					TTFT: r.ttft, Latency: r.done.Sub(r.start), PromptUnits: len(toks)}}
				s.seen = serving.Seen{Sent: r.start.Sub(start), Done: r.done.Sub(start), Prompt: toks}
				if r.err != nil {
					// A failed turn adds nothing to what was seen; its own
					// ideal hit is not counted either.
					now := time.Since(start)
					s.seen = serving.Seen{Sent: now, Done: now, Prompt: toks, Failed: true}
					s.rec.Error = r.err.Error()
					s.cancelled = ctx.Err() != nil
				} else {
					s.seen.Seq = serving.Tokens(unit, prompt+r.reply)
					if r.usage != nil {
						s.rec.PromptTokens, s.rec.CachedTokens = r.usage.PromptTokens, r.usage.Cached()
						s.rec.OutputTokens = r.usage.CompletionTokens
					}
					if s.rec.PromptTokens == 0 {
						s.rec.PromptTokens = s.rec.PromptUnits // no usage: the client's count
					}
				}
				out[i] = append(out[i], s)
				prog.add(serving.Result{Success: r.err == nil, Cancelled: s.cancelled})
				if r.err != nil {
					return
				}
				replies = append(replies, r.reply)
			}
		})
	}
	wg.Wait()
	run := multiTurnRun{Duration: time.Since(start).Seconds(), Partial: ctx.Err() != nil}
	seen := slices.Clone(before)
	var recs []serving.TurnRecord
	for _, ts := range out {
		run.NotSent += len(convs[0].Users) - len(ts)
		for _, s := range ts {
			if s.cancelled {
				run.NotSent++ // cut short by the interruption: not a failure of the server
				continue
			}
			seen = append(seen, s.seen)
			recs = append(recs, s.rec)
			if !s.rec.Success && len(run.Errors) < 10 {
				run.Errors = append(run.Errors, s.rec.Error)
			}
		}
	}
	for i, h := range serving.IdealHits(seen)[len(before):] {
		recs[i].IdealHit = h
	}
	run.records = recs
	run.Turn1 = serving.Summarize(recs, func(r serving.TurnRecord) bool { return r.Turn == 0 })
	run.Later = serving.Summarize(recs, func(r serving.TurnRecord) bool { return r.Turn >= 1 })
	run.All = serving.Summarize(recs, func(serving.TurnRecord) bool { return true })
	for t := range len(convs[0].Users) {
		run.PerTurn = append(run.PerTurn, serving.Summarize(recs, func(r serving.TurnRecord) bool { return r.Turn == t }))
	}
	if len(o.slo) > 0 && len(recs) > 0 {
		met := 0
		for _, r := range recs {
			if o.slo.Meets(serving.Result{Success: r.Success, TTFT: r.TTFT, Latency: r.Latency, OutputTokens: r.OutputTokens}) {
				met++
			}
		}
		run.Goodput = float64(met) / run.Duration
		run.Attainment = float64(met) / float64(len(recs))
	}
	return run
}

// writeMultiTurnTable writes the runs side by side, and the ratios.
func writeMultiTurnTable(w io.Writer, rep multiTurnReport) error {
	fmt.Fprintf(w, "multi-turn: %d conversations x %d turns, system prompt %d, turns %d, replies <= %d tokens, think %.1f s, model %s (%s)\n",
		rep.Conversations, rep.Turns, rep.SystemTokens, rep.TurnTokens, rep.OutputTokens, rep.ThinkTime, rep.ModelID, rep.TokenizerID)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := "\t"
	for _, r := range rep.Runs {
		name := "run"
		if r.PrefixCache != "" {
			name = "prefix cache " + r.PrefixCache
		}
		if r.Partial {
			name += " (PARTIAL)"
		}
		head += name + "\t"
	}
	fmt.Fprintln(tw, head)
	row := func(label string, f func(multiTurnRun) string) {
		line := label + "\t"
		for _, r := range rep.Runs {
			line += f(r) + "\t"
		}
		fmt.Fprintln(tw, line)
	}
	f1 := func(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }
	pct := func(v float64) string { return strconv.FormatFloat(100*v, 'f', 1, 64) }
	row("turns ok / failed / not sent", func(r multiTurnRun) string {
		return fmt.Sprintf("%d / %d / %d", r.All.Turns, r.All.Failed, r.NotSent)
	})
	row("duration (s)", func(r multiTurnRun) string { return strconv.FormatFloat(r.Duration, 'f', 2, 64) })
	row("turn 1 TTFT p50 (ms)", func(r multiTurnRun) string { return f1(r.Turn1.TTFTp50) })
	row("turn 1 TTFT p90 (ms)", func(r multiTurnRun) string { return f1(r.Turn1.TTFTp90) })
	row("turns >= 2 TTFT p50 (ms)", func(r multiTurnRun) string { return f1(r.Later.TTFTp50) })
	row("turns >= 2 TTFT p90 (ms)", func(r multiTurnRun) string { return f1(r.Later.TTFTp90) })
	row("prompt tokens", func(r multiTurnRun) string { return strconv.Itoa(r.All.PromptTokens) })
	row("cached tokens", func(r multiTurnRun) string { return strconv.Itoa(r.All.CachedTokens) })
	row("computed prompt tokens", func(r multiTurnRun) string { return strconv.Itoa(r.All.ComputedTokens) })
	row("ideal hit tokens", func(r multiTurnRun) string { return strconv.Itoa(r.All.IdealHit) })
	row("seen before (% of prompts)", func(r multiTurnRun) string { return pct(r.All.SeenShare) })
	row("hit rate vs ideal (%)", func(r multiTurnRun) string { return pct(r.All.HitRateVsIdeal) })
	row("turns >= 2 hit rate vs ideal (%)", func(r multiTurnRun) string { return pct(r.Later.HitRateVsIdeal) })
	if len(rep.SLO) > 0 {
		row("goodput (turns/s in SLO)", func(r multiTurnRun) string { return strconv.FormatFloat(r.Goodput, 'f', 2, 64) })
		row("SLO attainment (%)", func(r multiTurnRun) string { return pct(r.Attainment) })
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if rep.RatioTTFTp50 != nil {
		fmt.Fprintf(w, "cache on/off, turns >= 2 TTFT p50: %.3f", *rep.RatioTTFTp50)
		if rep.RatioTTFTp90 != nil {
			fmt.Fprintf(w, ", p90: %.3f", *rep.RatioTTFTp90)
		}
		if rep.RatioCompute != nil {
			fmt.Fprintf(w, "; computed prompt tokens: %.3f", *rep.RatioCompute)
		}
		if rep.RatioGoodput != nil {
			fmt.Fprintf(w, "; goodput: %.3f", *rep.RatioGoodput)
		}
		fmt.Fprintln(w)
	}
	return nil
}
