package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/worker"
)

// layerwiseOptions are the flags of the layerwise subcommand.
type layerwiseOptions struct {
	model     string
	tokens    []int
	requests  int
	transport string
	chunk     int
	prefillTP int
	decodeTP  int
	output    string
}

func parseLayerwiseFlags(args []string, stderr io.Writer) (layerwiseOptions, error) {
	fs := flag.NewFlagSet("layerwise", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o layerwiseOptions
	var tokens string
	fs.StringVar(&o.model, "model", model.NemotronH8B+"?prefill_delay=40us", "model of every worker, options as a query: the prefill delay is its simulated compute per prompt token")
	fs.StringVar(&tokens, "prompt-tokens", "1024,4096", "prompt lengths to measure, comma-separated")
	fs.IntVar(&o.requests, "requests", 7, "requests per prompt length and setup (the median is reported)")
	fs.StringVar(&o.transport, "transport", "tcp", "data path between prefill and decode: tcp, shm, or ucx (a -tags ucx build; the workers share this process, so auto would be inproc)")
	fs.IntVar(&o.chunk, "prefill-chunk-tokens", 0, "the prefill workers' --prefill-chunk-tokens")
	fs.IntVar(&o.prefillTP, "prefill-tp", 1, "the remote prefill workers' --tp-size")
	fs.IntVar(&o.decodeTP, "decode-tp", 1, "the remote decode workers' --tp-size (with different sizes, the handoff reshards)")
	fs.StringVar(&o.output, "output", "text", "text or json")
	fs.Usage = func() {
		fmt.Fprint(stderr, `usage: handoff-bench layerwise [flags]

Time to first token of the same prompts through three setups in one run,
requests interleaved: a decode worker that prefills locally (the
aggregated baseline, with the remote prefill's TP size), and remote prefill with --layerwise off and on, all
real workers (NATS, the data path, the pools) in this process. The
handoff exposed in TTFT is remote TTFT minus local TTFT; the ratio on/off
is what streaming each layer while prefill computes saves.

`)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	for _, f := range strings.Split(tokens, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return o, fmt.Errorf("layerwise: --prompt-tokens %q: want positive integers", tokens)
		}
		o.tokens = append(o.tokens, n)
	}
	if o.requests < 1 {
		return o, fmt.Errorf("layerwise: --requests %d: want ≥ 1", o.requests)
	}
	if o.transport != "tcp" && o.transport != "shm" && o.transport != "ucx" {
		return o, fmt.Errorf("layerwise: --transport %q: want tcp, shm or ucx", o.transport)
	}
	if o.output != "text" && o.output != "json" {
		return o, fmt.Errorf("layerwise: --output %q: want text or json", o.output)
	}
	if o.prefillTP < 1 || o.decodeTP < 1 {
		return o, fmt.Errorf("layerwise: --prefill-tp %d, --decode-tp %d: want ≥ 1", o.prefillTP, o.decodeTP)
	}
	return o, nil
}

// layerwiseRow is one prompt length's figures, in milliseconds.
type layerwiseRow struct {
	PromptTokens int     `json:"prompt_tokens"`
	CacheMiB     float64 `json:"cache_mib"`
	LocalTTFT    float64 `json:"local_ttft_ms"`
	OffTTFT      float64 `json:"remote_off_ttft_ms"`
	OnTTFT       float64 `json:"remote_on_ttft_ms"`
	OffExposed   float64 `json:"exposed_off_ms"`
	OnExposed    float64 `json:"exposed_on_ms"`
	Ratio        float64 `json:"ratio_on_off"`
	// LastLayerMs is the last state layer's bytes at the rate the off
	// setup moved the whole cache: what streaming cannot hide.
	LastLayerMs float64 `json:"last_layer_ms"`
}

type layerwiseReport struct {
	Model     string         `json:"model"`
	Transport string         `json:"transport"`
	Chunk     int            `json:"prefill_chunk_tokens"`
	PrefillTP int            `json:"prefill_tp"`
	DecodeTP  int            `json:"decode_tp"`
	Requests  int            `json:"requests"`
	Rows      []layerwiseRow `json:"rows"`
}

func runLayerwise(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseLayerwiseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	rep, err := measureLayerwise(ctx, o)
	if err != nil {
		return err
	}
	if o.output == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	fmt.Fprintf(stdout, "model %s, transport %s, prefill chunk %d, remote prefill TP %d → decode TP %d, median of %d requests\n",
		rep.Model, rep.Transport, rep.Chunk, rep.PrefillTP, rep.DecodeTP, rep.Requests)
	w := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "tokens\tcache MiB\tlocal TTFT ms\toff TTFT ms\ton TTFT ms\texposed off ms\texposed on ms\ton/off\tlast layer ms\t")
	for _, r := range rep.Rows {
		fmt.Fprintf(w, "%d\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.2f\t%.1f\t\n", r.PromptTokens, r.CacheMiB, r.LocalTTFT, r.OffTTFT, r.OnTTFT, r.OffExposed, r.OnExposed, r.Ratio, r.LastLayerMs)
	}
	return w.Flush()
}

func measureLayerwise(ctx context.Context, o layerwiseOptions) (layerwiseReport, error) {
	exec, err := model.Lookup(o.model)
	if err != nil {
		return layerwiseReport{}, err
	}
	spec := exec.Spec()
	maxTokens := slices.Max(o.tokens)
	if maxTokens >= spec.MaxContext {
		return layerwiseReport{}, fmt.Errorf("layerwise: %d prompt tokens do not fit %s's context of %d", maxTokens, spec.Name, spec.MaxContext)
	}
	cl, err := newBenchCluster(ctx)
	if err != nil {
		return layerwiseReport{}, fmt.Errorf("layerwise: %w", err)
	}
	defer cl.close()
	kvCfg := spec.KV
	blocks := 2 * kvCfg.BlocksFor(maxTokens+1) // one request and room to spare
	start := func(role worker.Role, args ...string) (*benchWorker, error) {
		w, err := cl.start(role, append([]string{"--model", o.model, "--max-batch-size", "1",
			"--kv-blocks", strconv.Itoa(blocks), "--request-timeout", "2m"}, args...)...)
		if err != nil {
			return nil, fmt.Errorf("layerwise: %w", err)
		}
		return w, nil
	}
	chunk := strconv.Itoa(o.chunk)
	// The baseline prefills on a group of the remote prefill's TP size, so
	// that remote minus local is the handoff, not the group's compute.
	local, err := start(worker.RoleDecode, "--namespace", "lw-local", "--prefill", "local", "--http-addr", "127.0.0.1:0", "--prefill-chunk-tokens", chunk,
		"--tp-size", strconv.Itoa(o.prefillTP))
	if err != nil {
		return layerwiseReport{}, err
	}
	remote := map[string]*benchWorker{}
	for _, mode := range []string{"off", "on"} {
		ns := "lw-" + mode
		if _, err := start(worker.RolePrefill, "--namespace", ns, "--layerwise", mode, "--transport", o.transport, "--prefill-chunk-tokens", chunk,
			"--tp-size", strconv.Itoa(o.prefillTP)); err != nil {
			return layerwiseReport{}, err
		}
		if remote[mode], err = start(worker.RoleDecode, "--namespace", ns, "--prefill", "remote", "--transport", o.transport, "--http-addr", "127.0.0.1:0",
			"--tp-size", strconv.Itoa(o.decodeTP)); err != nil {
			return layerwiseReport{}, err
		}
	}
	setups := []*benchWorker{local, remote["off"], remote["on"]}
	rep := layerwiseReport{Model: o.model, Transport: o.transport, Chunk: o.chunk, PrefillTP: o.prefillTP, DecodeTP: o.decodeTP, Requests: o.requests}
	for _, n := range o.tokens {
		prompt := layerwisePrompt(n)
		// One warm-up each: connections, pools, page faults.
		for _, w := range setups {
			if _, err := ttft(ctx, w.api, spec.Name, prompt); err != nil {
				return layerwiseReport{}, err
			}
		}
		times := make([][]float64, len(setups))
		for i := range o.requests {
			for k := range setups {
				// Rotate the order, so that no setup always follows another.
				j := (i + k) % len(setups)
				d, err := ttft(ctx, setups[j].api, spec.Name, prompt)
				if err != nil {
					return layerwiseReport{}, err
				}
				times[j] = append(times[j], d)
			}
		}
		med := func(xs []float64) float64 {
			s := slices.Clone(xs)
			slices.Sort(s)
			return s[len(s)/2]
		}
		cache := float64(kvCfg.BlocksFor(n))*float64(kvCfg.BlockBytes()) + float64(spec.Mamba.RowBytes())
		r := layerwiseRow{PromptTokens: n, CacheMiB: cache / (1 << 20), LocalTTFT: med(times[0]), OffTTFT: med(times[1]), OnTTFT: med(times[2])}
		r.OffExposed, r.OnExposed = r.OffTTFT-r.LocalTTFT, r.OnTTFT-r.LocalTTFT
		if r.OffExposed > 0 {
			r.Ratio = r.OnExposed / r.OffExposed
			r.LastLayerMs = r.OffExposed * float64(spec.Mamba.LayerBytes()) / cache
		}
		rep.Rows = append(rep.Rows, r)
	}
	return rep, nil
}

// layerwisePrompt is a prompt of n tokens (the models' tokens are bytes).
func layerwisePrompt(n int) string {
	const text = "the cache of every layer leaves while the next one computes. "
	s := strings.Repeat(text, n/len(text)+1)[:n]
	if got := len(model.Encode(s)); got != n {
		panic(fmt.Sprintf("layerwise: a %d-byte prompt is %d tokens", n, got))
	}
	return s
}

// ttft returns the milliseconds from sending a one-token completion to its
// answer: its time to first token.
func ttft(ctx context.Context, api, name, prompt string) (float64, error) {
	body, _ := json.Marshal(map[string]any{"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, api+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	d := time.Since(start)
	if err != nil {
		return 0, err
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("layerwise: %s: %s: %s", api, resp.Status, b)
	}
	return float64(d.Microseconds()) / 1000, nil
}
