package model

import (
	"context"
	"fmt"
)

// Part is a piece of a request's cache that prefill has finished: its bytes
// will not change again during this prefill, so they may leave for the
// decode worker while later layers (or chunks) still compute.
//
// Parts are made only by PrefillChunk, from the executor's report that a
// layer finished some positions, by one rule:
//
//   - attention layer: the K and V of positions [From, To) of KVLayer are
//     final once the chunk [From, To) passed the layer (later positions
//     write other slots);
//   - Mamba layer: the conv and SSM state of MambaLayer are final only once
//     the whole prompt passed the layer: the chunk that ends the prompt.
//     Earlier chunks leave a state the next chunk reads and rewrites, so no
//     Part names it then.
type Part struct {
	Layer int  // index into Spec.LayerPattern
	Kind  byte // 'M' (Mamba) or '*' (attention)
	// KVLayer (attention) is the kvcache layer; positions [From, To) of it
	// are final. End is true when To is the prompt's length: the block
	// holding To-1 gets nothing more from this prefill, its slots past To
	// included.
	KVLayer  int
	From, To int
	End      bool
	// MambaLayer (Mamba) is the mambacache layer whose whole state (conv
	// sections and SSM) is final.
	MambaLayer int
}

func (p Part) String() string {
	if p.Kind == 'M' {
		return fmt.Sprintf("layer %d (mamba %d)", p.Layer, p.MambaLayer)
	}
	return fmt.Sprintf("layer %d (kv %d) positions [%d, %d)", p.Layer, p.KVLayer, p.From, p.To)
}

// chunker is implemented by executors that prefill a chunk of the prompt
// layer by layer.
type chunker interface {
	// prefillChunk runs positions [from, to) of tokens (the whole prompt)
	// through the layers, one layer for every position of the chunk before
	// the next layer, and calls done(i) once layer i finished them. It
	// assumes [0, from) was prefilled by earlier calls on the same cache
	// and returns the next-token logits when to == len(tokens), else nil.
	// The arguments are valid (PrefillChunk checked them).
	prefillChunk(ctx context.Context, c Cache, tokens []int32, from, to int, done func(layer int) error) ([]float32, error)
}

// Chunked reports whether e prefills layer by layer, in chunks
// (PrefillChunk with any bounds). Other executors take the whole prompt at
// once, and their Parts come when it is done.
func Chunked(e Executor) bool {
	if s, ok := e.(*sharded); ok {
		if s.device() {
			return false // see sharded.prefillChunk
		}
		e = unwrap(s.inner) // a group chunks what its model chunks
	}
	_, ok := e.(chunker)
	return ok
}

// PrefillChunk runs positions [from, to) of the prompt tokens and calls
// ready with each Part of the cache as soon as it is final (see Part),
// synchronously, on the calling goroutine: ready must not block, and must
// copy out nothing it does not need (the bytes stay unchanged until the
// cache is freed or decoded into). Calling it for consecutive chunks
// [0, a), [a, b), ..., [y, len(tokens)) leaves the cache exactly as
// Prefill(tokens) does and returns the same logits from the last call (nil
// from the others). An executor that is not Chunked takes only the whole
// prompt (from 0, to len(tokens)) and reports every Part once it is done.
//
// On cancellation the error wraps ctx.Err(), and the cache may hold part of
// the chunk: the request is over, its cache is freed.
func PrefillChunk(ctx context.Context, e Executor, c Cache, tokens []int32, from, to int, ready func(Part)) ([]float32, error) {
	n := len(tokens)
	if from < 0 || to > n || from >= to {
		return nil, fmt.Errorf("%w: chunk [%d, %d) of a %d-token prompt", ErrInvalidCache, from, to, n)
	}
	spec := e.Spec()
	parts := partsOf(spec.LayerPattern)
	emit := func(i int) {
		if ready == nil {
			return
		}
		p := parts[i]
		switch p.Kind {
		case '*':
			p.From, p.To, p.End = from, to, to == n
		case 'M':
			if to != n {
				return // the state is not final before the prompt's last chunk
			}
		default:
			return
		}
		ready(p)
	}
	ch, ok := e.(chunker)
	if !ok {
		if from != 0 || to != n {
			return nil, fmt.Errorf("%w: %s prefills whole prompts only, not chunk [%d, %d) of %d tokens", ErrInvalidOption, spec.Name, from, to, n)
		}
		logits, err := PrefillContext(ctx, e, c, tokens)
		if err != nil {
			return nil, err
		}
		for i := range parts {
			emit(i)
		}
		return logits, nil
	}
	if err := checkPrompt(&spec, tokens); err != nil {
		return nil, err
	}
	next := 0 // the layer done must report next
	logits, err := ch.prefillChunk(ctx, c, tokens, from, to, func(layer int) error {
		if layer != next {
			// An executor bug: refuse to ship anything on its word.
			return fmt.Errorf("model: %s reported layer %d done, expected layer %d", spec.Name, layer, next)
		}
		next++
		emit(layer)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if next != len(parts) {
		return nil, fmt.Errorf("model: %s ran %d of %d layers over chunk [%d, %d)", spec.Name, next, len(parts), from, to)
	}
	return logits, nil
}

// partsOf returns, per layer of pattern, its Part without positions.
func partsOf(pattern string) []Part {
	parts := make([]Part, len(pattern))
	kv, m := 0, 0
	for i := range len(pattern) {
		parts[i] = Part{Layer: i, Kind: pattern[i]}
		switch pattern[i] {
		case '*', DraftLayer:
			parts[i].Kind = '*' // a draft layer's KV is final as the target's is
			parts[i].KVLayer = kv
			kv++
		case 'M':
			parts[i].MambaLayer = m
			m++
		}
	}
	return parts
}

// CachedParts returns the Parts of a prompt's first cached positions
// [0, cached) that a prefill resumed from a prefix-cache hit never
// computes: every attention layer's K and V of those positions, final
// already (the shared blocks are read-only and the copied tail is done).
// The Mamba state is not among them: the prefill rewrites it, and reports
// it when the prompt ends.
func CachedParts(spec Spec, cached int) []Part {
	var out []Part
	for _, p := range partsOf(spec.LayerPattern) {
		if p.Kind == '*' && cached > 0 {
			p.From, p.To = 0, cached
			out = append(out, p)
		}
	}
	return out
}
