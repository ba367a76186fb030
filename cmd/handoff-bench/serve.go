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
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/handoff-io/handoff/cmd/handoff-bench/internal/serving"
)

const serveUsage = `usage: handoff-bench serve [flags]

A load generator for any OpenAI-compatible /v1/completions endpoint (handoff,
vLLM, SGLang) that follows vllm bench serve: the same flags, the same random
dataset, arrival process and metric definitions, the same JSON keys.

Requests stream with stream_options.include_usage; token counts are the
server's usage. TTFT is the POST to the first chunk with choices; ITL the
gaps between such chunks, pooled; E2EL the POST to the last one; TPOT
(E2EL - TTFT)/(output tokens - 1) per request; duration the first dispatch to
the last completion, warm-ups excluded. A chunk with empty text that only
carries a finish_reason is an end marker, not a token.

--random-range-ratio r follows vLLM's convention: lengths are drawn uniformly
from [floor(L*(1-r)), ceil(L*(1+r))] (SGLang's [r*L, L] is the opposite).
Prompts are random words (about one token each for the BPE vocabularies of
real models) or random bytes (one token each for handoff's byte-level
tokenizer); --token-unit auto asks the server which.

--sweep-rates a,b,c runs the benchmark once per rate and reports DistServe's
goodput: the highest rate at which at least --attainment-target of the
requests meet both the TTFT and the TPOT objective of --goodput, with a PNG
plot of p90 TTFT, p90 TPOT and attainment against rate.

--dataset-name multi-turn sends conversations instead: --conversations of
--turns turns that open with one shared system prompt; each turn is the
whole conversation so far (every earlier user message and the reply the
server gave) plus a new user message, after a think time. Conversations
arrive at --request-rate; a chat endpoint gets the messages, a completions
endpoint their rendering in handoff's chat template. The report gives TTFT
p50/p90 of turn 1 and of turns >= 2, prompt, cached and computed tokens
(usage.prompt_tokens_details.cached_tokens), the ideal hit tokens (what a
perfect prefix cache would serve: each prompt's longest prefix seen in an
earlier prompt and reply) and the hit rate against them, with a plot of
TTFT per turn. With --spawn-model the workers run in this process, once
per --prefix-cache value (on,off: the same workload with the cache on and
off, and the ratio of turn >= 2 TTFT p50).

Ctrl-C stops the run: requests in flight are cancelled, and the report of
what finished is printed marked partial (exit status 1).

flags:
`

type serveOptions struct {
	baseURL        string
	endpoint       string
	model          string
	label          string
	numPrompts     int
	requestRate    float64
	burstiness     float64
	maxConcurrency int
	inputLen       int
	outputLen      int
	rangeRatio     float64
	numWarmups     int
	seed           uint64
	slo            serving.SLO
	metrics        []string
	percentiles    []float64
	output         string
	saveDetailed   bool
	resultFile     string
	sweepRates     []float64
	target         float64
	plot           string
	unit           string // auto, words or bytes
	ignoreEOS      bool
	temperature    float64 // NaN: not sent
	timeout        time.Duration
	progress       string
	dataset        string // random or multi-turn
	mt             multiTurnOptions
}

// multiValueFlags take vLLM's space-separated values (argparse nargs="+"):
// the arguments after them up to the next flag are joined into one value.
var multiValueFlags = []string{"goodput"}

// joinMultiValues rewrites "--goodput ttft:1 tpot:2" as "--goodput=ttft:1 tpot:2".
func joinMultiValues(args []string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		name := strings.TrimLeft(a, "-")
		if a == "--" {
			return append(out, args[i:]...)
		}
		if !strings.HasPrefix(a, "-") || strings.Contains(name, "=") || !slices.Contains(multiValueFlags, name) {
			out = append(out, a)
			continue
		}
		var vals []string
		for i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") {
			i++
			vals = append(vals, args[i])
		}
		out = append(out, "--"+name+"="+strings.Join(vals, " "))
	}
	return out
}

func parseServeFlags(args []string, stderr io.Writer) (serveOptions, error) {
	o := serveOptions{temperature: math.NaN()}
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var rate, burst, sweep, slo, metrics, pcts, temp string
	fs.StringVar(&o.baseURL, "base-url", "http://127.0.0.1:8000", "server base URL; several, comma-separated, are sent requests in turn (round robin, as a load balancer in front of replicas would)")
	fs.StringVar(&o.endpoint, "endpoint", "/v1/completions", "API endpoint, appended to --base-url")
	fs.StringVar(&o.model, "model", "", "model name; empty: the first model the server's /v1/models lists")
	fs.StringVar(&o.label, "label", "", "a label for the report")
	fs.IntVar(&o.numPrompts, "num-prompts", 1000, "requests to send")
	fs.StringVar(&rate, "request-rate", "inf", "requests per second; inf sends all at once")
	fs.StringVar(&burst, "burstiness", "1", "Gamma shape of the gaps between requests: 1 is a Poisson process, <1 burstier, >1 more regular, inf constant gaps")
	fs.IntVar(&o.maxConcurrency, "max-concurrency", 0, "most requests in flight at once (0: no limit); a request waits for a slot before its POST, and the wait is reported apart (queue_times)")
	fs.IntVar(&o.inputLen, "random-input-len", 1024, "mean prompt length in tokens")
	fs.IntVar(&o.outputLen, "random-output-len", 128, "mean output length in tokens (max_tokens)")
	fs.Float64Var(&o.rangeRatio, "random-range-ratio", 0, "r in [0, 1): lengths uniform in [floor(L*(1-r)), ceil(L*(1+r))], vLLM's convention")
	fs.IntVar(&o.numWarmups, "num-warmups", 0, "unmeasured requests (the first prompt) before the run")
	fs.Uint64Var(&o.seed, "seed", 0, "seed of the dataset and the arrival process")
	fs.StringVar(&slo, "goodput", "", `service level objectives in ms, "ttft:MS tpot:MS e2el:MS" (any subset): request_goodput counts the requests meeting all`)
	fs.StringVar(&metrics, "percentile-metrics", "ttft,tpot,itl", "comma-separated metrics to report: ttft, tpot, itl, e2el")
	fs.StringVar(&pcts, "metric-percentiles", "99", "comma-separated percentiles to report, e.g. 25,50,90,99")
	fs.StringVar(&o.output, "output", "table", "table or json (on stdout)")
	fs.BoolVar(&o.saveDetailed, "save-detailed", false, "add the per-request arrays to the JSON (input_lens, output_lens, ttfts, itls, latencies, start_times, queue_times, generated_texts, errors)")
	fs.StringVar(&o.resultFile, "result-file", "", "also write the JSON report to this file")
	fs.StringVar(&sweep, "sweep-rates", "", "comma-separated request rates: one run per rate and DistServe's goodput over them (needs --goodput with ttft and tpot)")
	fs.Float64Var(&o.target, "attainment-target", serving.DefaultAttainmentTarget, "SLO attainment a swept rate must reach (DistServe: 0.9)")
	fs.StringVar(&o.plot, "plot", "serve-sweep.png", "with --sweep-rates: PNG of p90 TTFT, p90 TPOT and attainment against rate; empty: none")
	fs.StringVar(&o.unit, "token-unit", "auto", "what a prompt token is: words, bytes, or auto (asks the server: bytes when its prompt_tokens count bytes)")
	fs.BoolVar(&o.ignoreEOS, "ignore-eos", false, "send ignore_eos: true, so that vLLM and SGLang generate max_tokens whatever they sample (as vLLM, off by default: OpenAI's API and handoff refuse the unknown parameter)")
	fs.StringVar(&temp, "temperature", "", "sampling temperature to send; empty: the server's default")
	fs.DurationVar(&o.timeout, "request-timeout", 6*time.Hour, "a request running longer fails (vLLM: 6h)")
	fs.StringVar(&o.progress, "progress", "auto", "auto (a bar on a terminal, lines otherwise), bar, lines or none; on stderr")
	fs.StringVar(&o.dataset, "dataset-name", "random", "random (vLLM's random dataset) or multi-turn (conversations sharing a system prompt, each turn appending the reply and a new user message; see --conversations)")
	var prefixCache, workerArgs string
	addMultiTurnFlags(fs, &o.mt, &prefixCache, &workerArgs)
	fs.Usage = func() {
		fmt.Fprint(stderr, serveUsage)
		fs.VisitAll(func(f *flag.Flag) {
			fmt.Fprintf(stderr, "  --%s (default %q)\n    \t%s\n", f.Name, f.DefValue, f.Usage)
		})
	}
	if err := fs.Parse(joinMultiValues(args)); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("serve: unexpected arguments %q", fs.Args())
	}
	for _, b := range strings.Split(o.baseURL, ",") {
		u, err := url.Parse(strings.TrimSpace(b))
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return o, fmt.Errorf("serve: --base-url: %q is not an http(s) URL", b)
		}
	}
	var err error
	if o.requestRate, err = parsePositive("request-rate", rate); err != nil {
		return o, err
	}
	if o.burstiness, err = parsePositive("burstiness", burst); err != nil {
		return o, err
	}
	if o.slo, err = serving.ParseSLO(slo); err != nil {
		return o, fmt.Errorf("serve: --goodput: %w", err)
	}
	for _, m := range strings.Split(metrics, ",") {
		if m = strings.TrimSpace(m); m == "" {
			continue
		}
		if !slices.Contains([]string{"ttft", "tpot", "itl", "e2el"}, m) {
			return o, fmt.Errorf("serve: --percentile-metrics: unknown metric %q (want ttft, tpot, itl, e2el)", m)
		}
		o.metrics = append(o.metrics, m)
	}
	for _, p := range strings.Split(pcts, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		v, err := strconv.ParseFloat(p, 64)
		if err != nil || !(v > 0 && v <= 100) {
			return o, fmt.Errorf("serve: --metric-percentiles: %q is not in (0, 100]", p)
		}
		o.percentiles = append(o.percentiles, v)
	}
	for _, r := range strings.Split(sweep, ",") {
		if r = strings.TrimSpace(r); r == "" {
			continue
		}
		v, err := parsePositive("sweep-rates", r)
		if err != nil {
			return o, err
		}
		o.sweepRates = append(o.sweepRates, v)
	}
	if temp != "" {
		if o.temperature, err = strconv.ParseFloat(temp, 64); err != nil || o.temperature < 0 {
			return o, fmt.Errorf("serve: --temperature %q is not a non-negative number", temp)
		}
	}
	switch {
	case o.numPrompts < 1:
		return o, errors.New("serve: --num-prompts must be >= 1")
	case o.inputLen < 1 || o.outputLen < 1:
		return o, errors.New("serve: --random-input-len and --random-output-len must be >= 1")
	case !(o.rangeRatio >= 0 && o.rangeRatio < 1):
		return o, fmt.Errorf("serve: --random-range-ratio must be in [0, 1), not %v", o.rangeRatio)
	case o.numWarmups < 0 || o.maxConcurrency < 0:
		return o, errors.New("serve: --num-warmups and --max-concurrency must be >= 0")
	case o.output != "table" && o.output != "json":
		return o, fmt.Errorf("serve: --output must be table or json, not %q", o.output)
	case !slices.Contains([]string{"auto", "words", "bytes"}, o.unit):
		return o, fmt.Errorf("serve: --token-unit must be auto, words or bytes, not %q", o.unit)
	case !slices.Contains([]string{"auto", "bar", "lines", "none"}, o.progress):
		return o, fmt.Errorf("serve: --progress must be auto, bar, lines or none, not %q", o.progress)
	case o.timeout <= 0:
		return o, errors.New("serve: --request-timeout must be > 0")
	case !(o.target > 0 && o.target <= 1):
		return o, fmt.Errorf("serve: --attainment-target must be in (0, 1], not %v", o.target)
	}
	if o.dataset != "random" && o.dataset != "multi-turn" {
		return o, fmt.Errorf("serve: --dataset-name must be random or multi-turn, not %q", o.dataset)
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if err := checkMultiTurn(&o, prefixCache, workerArgs, set); err != nil {
		return o, err
	}
	if len(o.sweepRates) > 0 {
		_, ttft := o.slo["ttft"]
		_, tpot := o.slo["tpot"]
		if !ttft || !tpot {
			return o, errors.New("serve: --sweep-rates needs --goodput with both ttft and tpot (DistServe's attainment)")
		}
		for _, r := range o.sweepRates {
			if math.IsInf(r, 1) {
				return o, errors.New("serve: --sweep-rates must be finite rates")
			}
		}
	}
	return o, nil
}

// fmtRate writes a rate or burstiness as vLLM prints it: "inf" for +Inf.
func fmtRate(v float64) string {
	if math.IsInf(v, 1) {
		return "inf"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}

// parsePositive parses a positive number or inf.
func parsePositive(name, s string) (float64, error) {
	v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil || !(v > 0) {
		return 0, fmt.Errorf("serve: --%s must be a positive number or inf, not %q", name, s)
	}
	return v, nil
}

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseServeFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	if o.dataset == "multi-turn" {
		return serveMultiTurn(ctx, o, stdout, stderr, isTerminal(stderr))
	}
	c := newServeClient(o, nil)
	defer c.http.CloseIdleConnections()
	return serve(ctx, o, c, stdout, stderr, isTerminal(stderr))
}

// serve runs the benchmark (or the sweep) and writes the report. An
// interruption (ctx cancelled) after the run started is not an error here:
// the partial report is written and nil returned; the caller reports the
// interruption.
func serve(ctx context.Context, o serveOptions, c *serveClient, stdout, stderr io.Writer, tty bool) error {
	reqs, unit, err := prepareServe(ctx, &o, c, stderr)
	if err != nil {
		return err
	}
	rates := o.sweepRates
	if len(rates) == 0 {
		rates = []float64{o.requestRate}
	}
	var points []serving.SweepPoint
	for _, rate := range rates {
		if ctx.Err() != nil {
			break
		}
		points = append(points, measureRate(ctx, o, c, reqs, unit, rate, stderr, tty))
	}
	if len(points) == 0 {
		return fmt.Errorf("serve: %w", context.Cause(ctx))
	}
	return writeServeReport(o, points, stdout, stderr)
}

// prepareServe completes o from the server (the model, when not given),
// picks the token unit, makes the dataset, and sends the test request and
// the warm-ups.
func prepareServe(ctx context.Context, o *serveOptions, c *serveClient, stderr io.Writer) ([]serving.Request, serving.Unit, error) {
	var err error
	if o.model == "" {
		if o.model, err = c.firstModel(ctx); err != nil {
			return nil, "", err
		}
		fmt.Fprintf(stderr, "model: %s (the first the server lists)\n", o.model)
	}
	var unit serving.Unit
	if o.unit == "auto" {
		if unit, err = c.probeUnit(ctx, o.model); err != nil {
			return nil, "", err
		}
		fmt.Fprintf(stderr, "token unit: %s (from the server's prompt_tokens of a probe)\n", unit)
	} else if unit, err = serving.ParseUnit(o.unit); err != nil {
		return nil, "", fmt.Errorf("serve: --token-unit: %w", err)
	}
	reqs := serving.RandomRequests(o.numPrompts, o.inputLen, o.outputLen, o.rangeRatio, unit,
		rand.New(rand.NewPCG(o.seed, 1)))

	fmt.Fprintln(stderr, "Starting initial single prompt test run...")
	if r := c.complete(ctx, o.model, time.Now(), reqs[0], "test"); !r.Success {
		if ctx.Err() != nil {
			return nil, "", fmt.Errorf("serve: test run: %w", context.Cause(ctx))
		}
		return nil, "", fmt.Errorf("serve: the initial test run failed; check --base-url, --endpoint and --model: %s", r.Error)
	}
	fmt.Fprintln(stderr, "Initial test run completed.")
	if o.numWarmups > 0 {
		fmt.Fprintf(stderr, "Warming up with %d requests...\n", o.numWarmups)
		warm := make([]serving.Request, o.numWarmups)
		for i := range warm {
			warm[i] = reqs[0]
		}
		w := runLoad(ctx, c, o.model, "warmup", warm, make([]time.Duration, len(warm)), o.maxConcurrency, nil)
		if ctx.Err() != nil {
			return nil, "", fmt.Errorf("serve: warm-up: %w", context.Cause(ctx))
		}
		fmt.Fprintf(stderr, "Warmup run completed (%d of %d succeeded).\n", countSuccess(w.results), o.numWarmups)
	}
	return reqs, unit, nil
}

// measureRate runs the dataset at one rate and summarizes it.
func measureRate(ctx context.Context, o serveOptions, c *serveClient, reqs []serving.Request, unit serving.Unit,
	rate float64, stderr io.Writer, tty bool) serving.SweepPoint {
	dist := "Poisson process"
	if o.burstiness != 1 {
		dist = "Gamma distribution"
	}
	conc := "None"
	if o.maxConcurrency > 0 {
		conc = strconv.Itoa(o.maxConcurrency)
	}
	fmt.Fprintf(stderr, "Traffic request rate: %s\nBurstiness factor: %s (%s)\nMaximum request concurrency: %s\n",
		fmtRate(rate), fmtRate(o.burstiness), dist, conc)
	arrivals := serving.Arrivals(len(reqs), rate, o.burstiness, rand.New(rand.NewPCG(o.seed, 2)))
	prog := newProgress(stderr, o.progress, tty, "rate "+fmtRate(rate), len(reqs))
	run := runLoad(ctx, c, o.model, "bench", reqs, arrivals, o.maxConcurrency, prog)
	prog.finish()
	if failed := firstErrors(run.results, 10); len(failed) > 0 {
		fmt.Fprintln(stderr, "Failed requests during benchmark run detected (capping to 10):")
		for i, e := range failed {
			fmt.Fprintf(stderr, "Error %d: %s\n", i, e)
		}
	}
	p := serving.SweepPoint{
		Rate: rate,
		Header: serving.Header{Date: time.Now(), Label: o.label, ModelID: o.model, Unit: unit,
			NumPrompts: o.numPrompts, RequestRate: rate, Burstiness: o.burstiness,
			MaxConcurrency: o.maxConcurrency, SLO: o.slo, Partial: run.partial, NotSent: run.notSent},
		Metrics: serving.Compute(run.results, run.duration, o.percentiles, o.slo),
	}
	if o.saveDetailed {
		p.Results = run.results
	}
	return p
}

// writeServeReport writes the report of one run or of a sweep (and its
// plot): JSON to --result-file, and the table or the JSON to stdout.
func writeServeReport(o serveOptions, points []serving.SweepPoint, stdout, stderr io.Writer) error {
	partial := points[len(points)-1].Header.Partial
	var rep any
	if len(o.sweepRates) == 0 {
		p := points[0]
		rep = serving.Report(p.Header, p.Metrics, o.metrics, p.Results)
	} else {
		rep = serving.SweepReport(points, o.slo, o.target, o.metrics, partial)
		if o.plot != "" {
			if err := writeSweepPlot(o.plot, points, o.slo, o.target, partial); err != nil {
				return err
			}
			fmt.Fprintf(stderr, "plot: %s\n", o.plot)
		}
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
	if len(o.sweepRates) == 0 {
		return serving.WriteTable(stdout, points[0].Header, points[0].Metrics, o.metrics)
	}
	return serving.WriteSweepTable(stdout, points, o.target, partial)
}

func countSuccess(rs []serving.Result) int {
	n := 0
	for _, r := range rs {
		if r.Success {
			n++
		}
	}
	return n
}

// firstErrors returns the errors of up to n failed requests.
func firstErrors(rs []serving.Result, n int) []string {
	var out []string
	for _, r := range rs {
		if !r.Success && !r.Cancelled && len(out) < n {
			out = append(out, r.Error)
		}
	}
	return out
}
