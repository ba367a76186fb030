package model

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
)

// Sentinel errors. Executors wrap them with %w and a detail.
var (
	// ErrUnknownModel is returned by Lookup for a name that is not registered.
	ErrUnknownModel = errors.New("model: unknown model")
	// ErrInvalidOption is returned by Lookup for a malformed or unknown option.
	ErrInvalidOption = errors.New("model: invalid option")
	// ErrInvalidCache is returned when a Cache does not match the executor's
	// Spec or does not fit its arenas (too few blocks, a block or row outside
	// the arena, a shape mismatch).
	ErrInvalidCache = errors.New("model: invalid cache")
	// ErrInvalidToken is returned for a token outside [0, Spec.Vocab).
	ErrInvalidToken = errors.New("model: invalid token")
	// ErrEmptyPrompt is returned by Prefill for zero tokens.
	ErrEmptyPrompt = errors.New("model: empty prompt")
	// ErrContextTooLong is returned when a position reaches Spec.MaxContext.
	ErrContextTooLong = errors.New("model: context too long")
)

// Spec is a model's cache shape. KV and Mamba carry shapes only: the pool-sizing
// fields (kvcache.Config.Blocks/ByteBudget, mambacache.Config.MaxBatchSize,
// PPSize, AttentionDP, MaxDraftTokens) are zero and are filled by the caller
// before it builds its pools:
//
//	kvCfg := spec.KV
//	kvCfg.Blocks = n
//	mCfg := spec.Mamba
//	mCfg.MaxBatchSize, mCfg.AttentionDP = b, adp
//
// The caller may also override KV.TokensPerBlock; executors read the block
// geometry from the Cache they are given, and Fingerprint covers it.
type Spec struct {
	Name         string
	Revision     string // changes whenever the numbers the model computes change
	LayerPattern string // one byte per layer: 'M' mamba, '*' attention, '-' MLP, '+' draft (DraftLayer)
	Vocab        int
	MaxContext   int // positions 0 .. MaxContext-1 are valid
	KV           kvcache.Config
	Mamba        mambacache.Config
}

// Cache is one request's view of the pools.
type Cache struct {
	KVArena    []byte
	KV         kvcache.Config
	Blocks     []kvcache.BlockID // in token order: token p lives in Blocks[p/TokensPerBlock]
	MambaArena []byte
	Mamba      mambacache.Config
	Row        mambacache.Row
}

// Executor runs a model over caches. Implementations are safe for concurrent use
// on distinct caches. All state lives in the caches: a request's next logits
// depend only on its Cache bytes, the token and the position.
type Executor interface {
	Spec() Spec
	// Prefill processes tokens at positions [0, len(tokens)), writing KV and Mamba
	// state, and returns the logits of the next token. The Mamba row's previous
	// contents are ignored (a fresh request starts from a zero state).
	Prefill(c Cache, tokens []int32) ([]float32, error)
	// Decode processes one token at position pos and returns the next logits.
	// The cache must hold the state of positions [0, pos); pos 0 starts fresh.
	Decode(c Cache, token int32, pos int) ([]float32, error)
}

// ContextExecutor is implemented by executors whose calls may block (those
// with a simulated compute delay). Use the package functions PrefillContext
// and DecodeContext to call any Executor with a context.
type ContextExecutor interface {
	Executor
	PrefillContext(ctx context.Context, c Cache, tokens []int32) ([]float32, error)
	DecodeContext(ctx context.Context, c Cache, token int32, pos int) ([]float32, error)
}

// PrefillContext runs e.Prefill, honouring ctx when e is a ContextExecutor.
// On cancellation the cache is left untouched and the error wraps ctx.Err().
func PrefillContext(ctx context.Context, e Executor, c Cache, tokens []int32) ([]float32, error) {
	if ce, ok := e.(ContextExecutor); ok {
		return ce.PrefillContext(ctx, c, tokens)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("model: prefill: %w", err)
	}
	return e.Prefill(c, tokens)
}

// DecodeContext runs e.Decode, honouring ctx when e is a ContextExecutor.
func DecodeContext(ctx context.Context, e Executor, c Cache, token int32, pos int) ([]float32, error) {
	if ce, ok := e.(ContextExecutor); ok {
		return ce.DecodeContext(ctx, c, token, pos)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("model: decode: %w", err)
	}
	return e.Decode(c, token, pos)
}

// Options tune an executor. The zero value is the plain model.
type Options struct {
	// PrefillDelay is slept per prompt token before Prefill computes.
	PrefillDelay time.Duration
	// DecodeDelay is slept before each Decode computes.
	DecodeDelay time.Duration
	// SSMElemSize overrides the SSM state element size of a synthetic preset
	// (2 for bf16, 4 for fp32); 0 keeps the preset's. It changes the layout
	// and so the Fingerprint. The tiny-hybrid model refuses it.
	SSMElemSize int
	// GPU, when set (e.g. "h200"), makes the executor a StepTimer: the
	// worker sleeps each step's simulated compute time on that GPU (see
	// timing.go). MFU and MBU override the assumed utilizations (0: the
	// defaults). Only the synthetic presets have compute figures, and a GPU
	// excludes the flat delays. The Fingerprint does not change.
	GPU      string
	MFU, MBU float64
	// TimingAs, with GPU, prices the simulated compute as the named
	// preset's (its weights, KV and state sizes) while the executor keeps
	// its own math: "tiny-hybrid?gpu=h200&as=nemotron-h-8b" generates
	// tiny-hybrid's text at nemotron-h-8b's pace on an H200, for
	// benchmarks whose result depends on the text (speculative decoding's
	// acceptance) as well as on the step time.
	TimingAs string
	// DecodeTouch, when > 0, makes a synthetic preset's decode read
	// (checksum) and rewrite only the first DecodeTouch bytes of each state
	// section (each conv section and SSM extent of each layer) instead of
	// the whole Mamba row: with a simulated GPU the CPU then keeps up with
	// its decode steps (a whole nemotron-h-8b row is 49 MiB per request per
	// step). Prefill still writes every byte, and transfers move every byte.
	// The tiny-hybrid model refuses it.
	DecodeTouch int
	// MTP ("?mtp=1") gives the model a draft head: a DraftLayer after its
	// layers, with its KV in the pool (one more KV layer, so another
	// Fingerprint), for speculative decoding's Draft. tiny-hybrid's tokens
	// are the same with it; a synthetic preset's are another hash (its
	// tokens hash the whole cache).
	MTP bool
}

const maxDelay = time.Minute

// HeadTouch is the bytes of each state section a decode reads and rewrites
// with "?touch=head": the size fillPattern generates before it doubles, so
// each section still gets its own pattern.
const HeadTouch = 1024

type constructor func(Options) (Executor, error)

var registry = map[string]constructor{
	TinyHybrid: newTinyHybrid,
}

func init() {
	for name := range presets {
		registry[name] = func(o Options) (Executor, error) { return newSynthetic(name, o) }
	}
}

// Names lists the registered model names, sorted.
func Names() []string {
	names := make([]string, 0, len(registry))
	for name := range registry {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

// Lookup returns the executor for name. A name may carry options as a URL
// query:
//
//	nemotron-h-8b?delay=2ms          PrefillDelay and DecodeDelay = 2ms per token
//	nemotron-h-8b?prefill_delay=1ms&decode_delay=5ms
//	qwen3-next-80b?ssm_dtype=fp32    SSM state in fp32 (bf16 or fp32)
//	nemotron-h-8b?gpu=h200           the worker sleeps each step's simulated H200
//	                                 compute time (timing.go); &mfu=0.5&mbu=0.7
//	tiny-hybrid?gpu=h200&as=nemotron-h-8b
//	                                 tiny-hybrid's math and text, timed as
//	                                 nemotron-h-8b on an H200 (TimingAs)
//	nemotron-h-8b?gpu=h200&touch=head
//	                                 decode reads and rewrites 1 KiB of each state
//	                                 section, not the whole row (DecodeTouch)
//
// Delays take time.ParseDuration syntax, from 0 to 1m. An unknown name wraps
// ErrUnknownModel; a bad option wraps ErrInvalidOption.
func Lookup(name string) (Executor, error) {
	base, query, _ := strings.Cut(strings.TrimSpace(name), "?")
	opts, err := parseOptions(query)
	if err != nil {
		return nil, err
	}
	return New(base, opts)
}

// New returns the executor for a registered base name with explicit options.
func New(name string, o Options) (Executor, error) {
	ctor, ok := registry[name]
	if !ok {
		return nil, fmt.Errorf("%w: %q (known: %s)", ErrUnknownModel, name, strings.Join(Names(), ", "))
	}
	if o.PrefillDelay < 0 || o.PrefillDelay > maxDelay || o.DecodeDelay < 0 || o.DecodeDelay > maxDelay {
		return nil, fmt.Errorf("%w: delay outside [0, %v]", ErrInvalidOption, maxDelay)
	}
	if o.GPU != "" && (o.PrefillDelay > 0 || o.DecodeDelay > 0) {
		return nil, fmt.Errorf("%w: gpu and delay exclude each other", ErrInvalidOption)
	}
	e, err := ctor(o)
	if err != nil {
		return nil, err
	}
	if o.TimingAs != "" && o.GPU == "" {
		return nil, fmt.Errorf("%w: as=%s without gpu", ErrInvalidOption, o.TimingAs)
	}
	if o.GPU != "" {
		tspec := e.Spec()
		if o.TimingAs != "" {
			if _, ok := presets[o.TimingAs]; !ok || o.TimingAs == name {
				return nil, fmt.Errorf("%w: as=%q: want another model's preset (%s or %s)", ErrInvalidOption, o.TimingAs, NemotronH8B, Qwen3Next80B)
			}
			a, err := newSynthetic(o.TimingAs, Options{})
			if err != nil {
				return nil, err
			}
			tspec = a.Spec()
			if o.MTP {
				tspec = withDraftLayer(tspec) // priced with its draft head
			}
		}
		t, err := NewTiming(tspec, o.GPU, o.MFU, o.MBU)
		if err != nil {
			return nil, err
		}
		return timed{Executor: e, Timing: t}, nil
	}
	if o.PrefillDelay > 0 || o.DecodeDelay > 0 {
		return &delayed{inner: e, prefill: o.PrefillDelay, decode: o.DecodeDelay}, nil
	}
	return e, nil
}

func parseOptions(query string) (Options, error) {
	var o Options
	if query == "" {
		return o, nil
	}
	vals, err := url.ParseQuery(query)
	if err != nil {
		return o, fmt.Errorf("%w: %v", ErrInvalidOption, err)
	}
	for key, vs := range vals {
		if len(vs) != 1 {
			return o, fmt.Errorf("%w: %s given %d times", ErrInvalidOption, key, len(vs))
		}
		v := vs[0]
		switch key {
		case "delay", "prefill_delay", "decode_delay":
			d, err := time.ParseDuration(v)
			if err != nil {
				return o, fmt.Errorf("%w: %s: %v", ErrInvalidOption, key, err)
			}
			if key != "decode_delay" {
				o.PrefillDelay = d
			}
			if key != "prefill_delay" {
				o.DecodeDelay = d
			}
		case "ssm_dtype":
			switch v {
			case "bf16", "fp16":
				o.SSMElemSize = 2
			case "fp32":
				o.SSMElemSize = 4
			default:
				return o, fmt.Errorf("%w: ssm_dtype %q (want bf16, fp16 or fp32)", ErrInvalidOption, v)
			}
		case "mtp":
			switch v {
			case "1", "on":
				o.MTP = true
			case "0", "off":
				o.MTP = false
			default:
				return o, fmt.Errorf("%w: mtp %q (want 1 or 0)", ErrInvalidOption, v)
			}
		case "gpu":
			o.GPU = v
		case "as":
			o.TimingAs = v
		case "touch":
			switch v {
			case "full":
				o.DecodeTouch = 0
			case "head":
				o.DecodeTouch = HeadTouch
			default:
				return o, fmt.Errorf("%w: touch %q (want full or head)", ErrInvalidOption, v)
			}
		case "mfu", "mbu":
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || !(f > 0 && f <= 1) {
				return o, fmt.Errorf("%w: %s %q (want a fraction in (0, 1])", ErrInvalidOption, key, v)
			}
			if key == "mfu" {
				o.MFU = f
			} else {
				o.MBU = f
			}
		default:
			return o, fmt.Errorf("%w: unknown option %q", ErrInvalidOption, key)
		}
	}
	// An explicit prefill_delay/decode_delay wins over delay regardless of order.
	if v, ok := vals["prefill_delay"]; ok {
		o.PrefillDelay, _ = time.ParseDuration(v[0])
	}
	if v, ok := vals["decode_delay"]; ok {
		o.DecodeDelay, _ = time.ParseDuration(v[0])
	}
	return o, nil
}
