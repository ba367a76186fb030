package model

import (
	"context"
	"fmt"
	"math"
	"strings"
	"time"
)

// This file is a simulation of compute, and only that: a roofline model of
// how long a real model would take on a real GPU, computed from published
// figures (sources below): when the model is looked up with "?gpu=h200",
// the worker sleeps (never spins) each engine step's simulated time: the
// prefills' before the step, the decodes' overlapping the step's own work
// (worker/simstep.go). Everything else a
// request meets (scheduling, queues, the cache pools, the transfers) is the
// real code; only the arithmetic is replaced by sleeping for as long as the
// GPU would compute, so a 2-core machine can stand in for GPU-bound workers.
// Two limits: a prefill's own CPU work (the synthetic presets write every
// state byte) comes on top of its simulated time; and decode steps cannot go
// faster than the executor's CPU work (nemotron-h-8b checksums and rewrites
// its 49 MiB Mamba row per decode: on a small CPU that exceeds an H200's
// whole step, and the CPU is then the bottleneck).
//
// The model (all times in seconds):
//
//	prefill(n)      = max(F(n) / (MFU·peak), W / (MBU·BW))
//	F(n)            = 2·P_active·n + 2·L_attn·H_q·d_head·n²     (causal attention: QKᵀ and AV, halved)
//	decode step(B)  = (W(B) + Σ_i (KV(ctx_i) + 2·row)) / (MBU·BW)
//	W(B)            = bytes of the weights a step of B requests reads: all of them for a
//	                  dense model; for an MoE the dense part plus the experts the B tokens
//	                  route to, E·(1 − (1 − k/E)^B) per layer on average for uniform routing
//	KV(ctx)         = ctx · L_attn · 2 · H_kv · d_head · elem   (the attention cache read)
//	row             = the Mamba/SSM state row, read and written once per step
//
// A step that holds prefills and decodes (an aggregated engine: prefill
// stalls the running decodes) takes the sum of its prefills and its decode
// step.
//
// Sources:
//   - NVIDIA H200 Tensor Core GPU datasheet: 4.8 TB/s HBM3e, 141 GB;
//     989 TFLOPS dense BF16, 1,979 TFLOPS dense FP8 (the datasheet's
//     figures with sparsity halved).
//   - Nemotron-H (NVIDIA, arXiv:2504.03624), Nemotron-H-8B-Base model card:
//     8B parameters; 52 layers (24 Mamba-2, 4 self-attention, 24 MLP);
//     d_model 4096, 32 query heads of 128, 8 KV heads. BF16 weights.
//   - Qwen3-Next-80B-A3B model card (Qwen, 2025): 80B parameters, 3B
//     activated; 48 layers (36 Gated DeltaNet, 12 gated attention with 16
//     query and 2 KV heads of 256); 512 experts, 10 routed and 1 shared per
//     token. Run on one H200 with the published FP8 checkpoint (80 GB of
//     weights; BF16 would not fit in 141 GB).
//
// Assumptions, not measurements (override with ?mfu= and ?mbu=): a prefill
// reaches 50 % of peak FLOPS (MFU) and a decode step 70 % of peak memory
// bandwidth (MBU), figures in the range serving engines report for large
// batched GEMMs and for memory-bound decoding on Hopper. No launch or
// scheduling overhead is added: the engine's own is real.

// StepTimer is implemented by executors that simulate a GPU's compute time.
// Before each engine step on a rank the worker asks it for the time of the
// step's prefills (the positions each computes, decodes nil) and of its
// decodes (their context lengths, prefills nil), so StepTime must add up:
// the time of both together is the sum of the two.
type StepTimer interface {
	StepTime(prefills []Span, decodes []int) time.Duration
}

// Span is the positions [From, To) of a prompt that a prefill step
// computes; [0, From) are cached already (a prefix-cache hit, or the
// chunks before).
type Span struct{ From, To int }

// GPU is an accelerator's published peak figures.
type GPU struct {
	Name      string
	BF16FLOPS float64 // dense, per second
	FP8FLOPS  float64 // dense, per second
	MemBW     float64 // bytes per second
}

// GPUs are the accelerators the timing model knows, by the name ?gpu= takes.
var GPUs = map[string]GPU{
	"h200": {Name: "NVIDIA H200 SXM", BF16FLOPS: 989e12, FP8FLOPS: 1979e12, MemBW: 4.8e12},
}

// computeFigures are a real model's compute figures (see the sources above).
type computeFigures struct {
	activeParams    float64 // multiplied per token
	denseParams     float64 // read every step whatever the routing (= activeParams for a dense model)
	expertParams    float64 // all routed experts together; 0 for a dense model
	experts, routed int     // routed experts per layer, and chosen per token
	weightBytes     float64 // bytes per parameter
	fp8             bool    // computes at the FP8 peak
	qHeads          int     // attention query heads (the quadratic term)
}

var computes = map[string]computeFigures{
	NemotronH8B: {activeParams: 8e9, denseParams: 8e9, weightBytes: 2, qHeads: 32},
	// 80B in all, 3B active: with E = 512 and k = 10, the dense part X and
	// the experts Y solve X + Y = 80e9, X + Y·10/512 = 3e9.
	Qwen3Next80B: {activeParams: 3e9, denseParams: 3e9 - 77e9/(1-10.0/512)*10/512,
		expertParams: 77e9 / (1 - 10.0/512), experts: 512, routed: 10, weightBytes: 1, fp8: true, qHeads: 16},
}

// Default utilizations (see Assumptions above).
const (
	DefaultMFU = 0.5
	DefaultMBU = 0.7
)

// Timing is a model's simulated compute time on one GPU.
type Timing struct {
	GPU      GPU
	MFU, MBU float64
	c        computeFigures
	attn     float64 // L_attn·H_q·d_head
	kvToken  float64 // KV bytes per context token
	rowBytes float64
	// draftParams are the draft head's parameters (a model with a
	// DraftLayer): about one attention and one MLP layer's share of the
	// model, read by each drafting pass; draftKVToken its KV bytes per
	// context token, which only the head reads. A target step writes the
	// head's entry of its positions (a projection and one layer's K and V:
	// not priced).
	draftParams  float64
	draftKVToken float64
}

// NewTiming returns the timing of the model spec on the named GPU, with the
// given utilizations (0: the defaults). Only the synthetic presets have
// compute figures; others wrap ErrInvalidOption.
func NewTiming(spec Spec, gpu string, mfu, mbu float64) (Timing, error) {
	g, ok := GPUs[gpu]
	if !ok {
		return Timing{}, fmt.Errorf("%w: unknown gpu %q (known: h200)", ErrInvalidOption, gpu)
	}
	c, ok := computes[spec.Name]
	if !ok {
		return Timing{}, fmt.Errorf("%w: %s has no compute figures for a simulated gpu (the presets %s and %s have)",
			ErrInvalidOption, spec.Name, NemotronH8B, Qwen3Next80B)
	}
	if mfu == 0 {
		mfu = DefaultMFU
	}
	if mbu == 0 {
		mbu = DefaultMBU
	}
	if !(mfu > 0 && mfu <= 1) || !(mbu > 0 && mbu <= 1) {
		return Timing{}, fmt.Errorf("%w: mfu and mbu must be in (0, 1]", ErrInvalidOption)
	}
	kv := spec.KV
	heads := strings.Count(spec.LayerPattern, string(rune(DraftLayer)))
	layers := kv.Layers - heads // the target's attention layers
	perLayer := float64(2 * kv.KVHeads * kv.HeadDim * kv.ElemSize)
	t := Timing{GPU: g, MFU: mfu, MBU: mbu, c: c,
		attn:     float64(layers * c.qHeads * kv.HeadDim),
		kvToken:  float64(layers) * perLayer,
		rowBytes: float64(spec.Mamba.RowBytes()),
	}
	if heads > 0 {
		t.draftParams = c.activeParams * 2 * float64(heads) / float64(len(spec.LayerPattern)-heads)
		t.draftKVToken = float64(heads) * perLayer
	}
	return t, nil
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// weightRead returns the weight bytes a step of b requests reads.
func (t Timing) weightRead(b int) float64 {
	p := t.c.denseParams
	if t.c.experts > 0 {
		e := float64(t.c.experts)
		touched := e * (1 - math.Pow(1-float64(t.c.routed)/e, float64(b)))
		p += t.c.expertParams * touched / e
	}
	return p * t.c.weightBytes
}

// PrefillTime returns the time to prefill a prompt of n tokens alone.
func (t Timing) PrefillTime(n int) time.Duration { return t.SpanTime(Span{0, n}) }

// SpanTime returns the time to prefill positions [s.From, s.To) of a prompt
// whose first s.From positions are cached: the weights and MLPs see only
// the new positions, attention reads every earlier one.
func (t Timing) SpanTime(s Span) time.Duration {
	if s.To <= s.From || s.From < 0 {
		return 0
	}
	peak := t.GPU.BF16FLOPS
	if t.c.fp8 {
		peak = t.GPU.FP8FLOPS
	}
	fn, from, to := float64(s.To-s.From), float64(s.From), float64(s.To)
	flops := 2*t.c.activeParams*fn + 2*t.attn*(to*to-from*from)
	compute := flops / (t.MFU * peak)
	memory := t.weightRead(s.To-s.From) / (t.MBU * t.GPU.MemBW)
	return seconds(max(compute, memory))
}

// DecodeStepTime returns the time of one decode step over requests with
// the given context lengths (positions already cached).
func (t Timing) DecodeStepTime(contexts []int) time.Duration {
	if len(contexts) == 0 {
		return 0
	}
	bytes := t.weightRead(len(contexts))
	for _, ctx := range contexts {
		bytes += float64(ctx)*t.kvToken + 2*t.rowBytes
	}
	return seconds(bytes / (t.MBU * t.GPU.MemBW))
}

// VerifyTimer is implemented by StepTimers that price a speculative
// decoding step, in which a request runs its last token and its drafts.
type VerifyTimer interface {
	VerifyStepTime(contexts, tokens []int) time.Duration
}

// VerifyStepTime returns the time of one decode step in which request i
// runs tokens[i] positions (its last token and tokens[i]-1 drafts) after
// contexts[i] cached ones. A verification is one forward pass: it reads
// the weights, each request's KV and its state row once, as a decode step
// does, and writes the row's per-position states (one row each); it
// computes every position, 2·P_active·Σtokens plus the attention over each
// position's context. It takes the longer of the memory and the compute
// time: at low batch decode is memory-bound and K+1 positions cost about
// one step; at large batch the positions' compute overtakes the weights'
// read, which is why a draft-length schedule drafts less there. A step in
// which every request runs one position is priced as DecodeStepTime, so
// speculation off and on with no drafts cost the same.
func (t Timing) VerifyStepTime(contexts, tokens []int) time.Duration {
	n, most := 0, 0
	for _, k := range tokens {
		n += k
		most = max(most, k)
	}
	if n <= len(contexts) {
		return t.DecodeStepTime(contexts)
	}
	// A model with a draft head drafts with it before the verification:
	// one pass per draft for the whole batch, memory-bound, reading the
	// head's weights and each request's head KV each time. (A worker that
	// drafts otherwise on such a model, or verifies drafts a prefill
	// shipped, is priced as drafting too: serve a head with mtp.)
	headKV := 0.0
	for _, ctx := range contexts {
		headKV += float64(ctx) * t.draftKVToken
	}
	drafting := float64(most-1) * (t.draftParams*t.c.weightBytes + headKV) / (t.MBU * t.GPU.MemBW)
	bytes := t.weightRead(n) // an MoE routes every position
	flops := 0.0
	for i, ctx := range contexts {
		k := 1
		if i < len(tokens) {
			k = max(tokens[i], 1)
		}
		bytes += float64(ctx+k)*t.kvToken + float64(1+k)*t.rowBytes
		flops += 2*t.c.activeParams*float64(k) + 4*t.attn*float64(k)*float64(ctx+k)
	}
	peak := t.GPU.BF16FLOPS
	if t.c.fp8 {
		peak = t.GPU.FP8FLOPS
	}
	return seconds(drafting + max(bytes/(t.MBU*t.GPU.MemBW), flops/(t.MFU*peak)))
}

// StepTime is the time of an engine step that prefills the given spans
// and decodes requests with the given contexts.
func (t Timing) StepTime(prefills []Span, decodes []int) time.Duration {
	var d time.Duration
	for _, s := range prefills {
		d += t.SpanTime(s)
	}
	return d + t.DecodeStepTime(decodes)
}

// timed is an executor whose compute the worker sleeps per step
// (StepTimer); its own calls compute the inner executor's cheap math at once.
type timed struct {
	Executor
	Timing
}

var (
	_ StepTimer   = timed{}
	_ VerifyTimer = timed{}
	_ chunker     = timed{}
)

// prefillChunk chunks as the inner executor does; the step's simulated
// time (StepTime over the chunk's Span) is the worker's to sleep.
func (t timed) prefillChunk(ctx context.Context, c Cache, tokens []int32, from, to int, done func(layer int) error) ([]float32, error) {
	ch, ok := t.Executor.(chunker)
	if !ok {
		return nil, fmt.Errorf("%w: %s prefills whole prompts only", ErrInvalidOption, t.Spec().Name)
	}
	return ch.prefillChunk(ctx, c, tokens, from, to, done)
}
