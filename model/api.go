package model

// API CONTRACT (to be implemented; exported names are fixed, bodies are not).

import (
	"errors"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
)

var ErrUnknownModel = errors.New("model: unknown model")

// Spec is a model's cache shape. KV and Mamba carry shapes only: the pool-sizing
// fields (Blocks, MaxBatchSize, AttentionDP...) are filled by the worker.
type Spec struct {
	Name         string
	LayerPattern string // e.g. "M*M-" : M mamba, * attention, - MLP
	Vocab        int
	MaxContext   int
	KV           kvcache.Config
	Mamba        mambacache.Config
}

func (s Spec) Fingerprint() string { panic("unimplemented") } // stable hash of everything that must match across peers

// Cache is one request's view of the pools.
type Cache struct {
	KVArena    []byte
	KV         kvcache.Config
	Blocks     []kvcache.BlockID // in token order
	MambaArena []byte
	Mamba      mambacache.Config
	Row        mambacache.Row
}

// Executor runs a model over caches. Implementations are safe for concurrent use
// on distinct caches.
type Executor interface {
	Spec() Spec
	// Prefill processes tokens at positions [0, len(tokens)), writing KV and Mamba
	// state, and returns the logits of the next token.
	Prefill(c Cache, tokens []int32) ([]float32, error)
	// Decode processes one token at position pos and returns the next logits.
	Decode(c Cache, token int32, pos int) ([]float32, error)
}

func Lookup(name string) (Executor, error) { panic("unimplemented") }
func Names() []string                      { panic("unimplemented") }

// Byte-level tokenizer and sampling.
func Encode(s string) []int32    { panic("unimplemented") }
func Decode(toks []int32) string { panic("unimplemented") }
func Sample(logits []float32, temperature float64, seed uint64, step int) int32 {
	panic("unimplemented")
}
