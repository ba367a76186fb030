package model

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"strings"
	"sync"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
)

// Synthetic preset names.
const (
	NemotronH8B  = "nemotron-h-8b"
	Qwen3Next80B = "qwen3-next-80b"
)

// presets are real models' cache shapes (unsharded: TP 1 or attention DP).
// Element sizes: 2 = bf16. Both keep the SSM state in bf16 by default;
// "?ssm_dtype=fp32" doubles it as fp32-state deployments do.
var presets = map[string]Spec{
	// Nemotron-H-8B-Base-8K: 52 layers = 24 Mamba2 / 4 attention / 24 MLP.
	NemotronH8B: {
		LayerPattern: "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
		MaxContext:   8192,
		KV:           kvcache.Config{KVHeads: 8, HeadDim: 128, ElemSize: 2, TokensPerBlock: 32},
		Mamba: mambacache.Config{DState: 128, DConv: 4, Heads: 128, HeadDim: 64, NGroups: 8,
			ConvElemSize: 2, SSMElemSize: 2, ConvLayout: mambacache.ConvXBC},
	},
	// Qwen3-Next-80B-A3B: 48 layers = 36 Gated DeltaNet / 12 full attention,
	// mapped the TensorRT-LLM way: 32 V heads x 128, d_state 128 (K head dim),
	// 16 groups (K heads), conv sections [Q | K | V].
	Qwen3Next80B: {
		LayerPattern: strings.Repeat("MMM*", 12),
		MaxContext:   262144,
		KV:           kvcache.Config{KVHeads: 2, HeadDim: 256, ElemSize: 2, TokensPerBlock: 32},
		Mamba: mambacache.Config{DState: 128, DConv: 4, Heads: 32, HeadDim: 128, NGroups: 16,
			ConvElemSize: 2, SSMElemSize: 2, ConvLayout: mambacache.ConvQKV},
	},
}

// synthetic has a real model's cache shape and cheap fake math:
//
//   - Prefill folds (token, position) into a running 64-bit hash; the K and V
//     of position p are a pattern seeded by the hash of tokens [0, p]; the Mamba
//     row is a pattern seeded by the final hash.
//   - Decode at pos seeds its hash with a CRC-32C of the whole Mamba row (every
//     conv section and SSM extent) and of the K/V of the tokens in the block
//     holding position pos-1, then folds in (token, pos), writes K/V for pos
//     and rewrites the row.
//   - Logits are a pattern of the hash, so any changed byte of the row or of
//     the last block changes the next token's logits.
//
// Every state byte is written once per call (patterns are doubled with copy),
// and a decode reads the row once, as a real decode step does; with
// Options.DecodeTouch a decode reads and rewrites only the head of each
// state section, so that the CPU keeps up with a simulated GPU.
type synthetic struct {
	spec  Spec
	base  uint64 // hash of the fingerprint: the empty-prefix state
	touch int    // Options.DecodeTouch: bytes of each state section a decode touches; 0 all
	pool  sync.Pool
}

func newSynthetic(name string, o Options) (Executor, error) {
	spec, ok := presets[name]
	if !ok {
		return nil, fmt.Errorf("%w: %q", ErrUnknownModel, name)
	}
	return buildSynthetic(name, spec, o)
}

// buildSynthetic completes a preset's Spec (name, vocabulary, layer counts
// from the pattern) and returns its executor.
func buildSynthetic(name string, spec Spec, o Options) (*synthetic, error) {
	switch o.SSMElemSize {
	case 0:
	case 2, 4:
		spec.Mamba.SSMElemSize = o.SSMElemSize
	default:
		return nil, fmt.Errorf("%w: ssm element size %d", ErrInvalidOption, o.SSMElemSize)
	}
	if o.DecodeTouch < 0 {
		return nil, fmt.Errorf("%w: decode touch %d", ErrInvalidOption, o.DecodeTouch)
	}
	spec.Name = name
	spec.Revision = "1"
	spec.Vocab = ByteVocab
	spec.KV.Layers = strings.Count(spec.LayerPattern, "*")
	spec.Mamba.Layers = strings.Count(spec.LayerPattern, "M")
	if o.MTP {
		spec = withDraftLayer(spec)
	}
	sum := sha256.Sum256([]byte(spec.canonical()))
	s := &synthetic{spec: spec, base: binary.LittleEndian.Uint64(sum[:]), touch: o.DecodeTouch}
	s.pool.New = func() any { return new(rowView) }
	return s, nil
}

func (s *synthetic) Spec() Spec { return s.spec }

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func (s *synthetic) Prefill(c Cache, tokens []int32) ([]float32, error) {
	if err := checkPrompt(&s.spec, tokens); err != nil {
		return nil, err
	}
	rv := s.pool.Get().(*rowView)
	defer s.pool.Put(rv)
	if err := checkCache(&s.spec, &c, len(tokens), rv); err != nil {
		return nil, err
	}
	h := s.base
	for p, t := range tokens {
		h = mix64(h, uint64(uint32(t))<<32|uint64(p))
		s.writeKV(&c, p, h)
	}
	s.writeRow(rv, h)
	return s.logits(h), nil
}

var _ chunker = (*synthetic)(nil)

// prefillChunk writes what Prefill writes, layer by layer: the K/V of the
// chunk's positions for each attention layer, and each Mamba layer's part
// of the row once the chunk ends the prompt. The running hash at from is
// folded again from the prompt (cheap next to the writes).
func (s *synthetic) prefillChunk(ctx context.Context, c Cache, tokens []int32, from, to int, done func(layer int) error) ([]float32, error) {
	rv := s.pool.Get().(*rowView)
	defer s.pool.Put(rv)
	if err := checkCache(&s.spec, &c, to, rv); err != nil {
		return nil, err
	}
	h := s.base
	for p := range from {
		h = mix64(h, uint64(uint32(tokens[p]))<<32|uint64(p))
	}
	hs := make([]uint64, to-from) // the hash of each position of the chunk
	for p := from; p < to; p++ {
		h = mix64(h, uint64(uint32(tokens[p]))<<32|uint64(p))
		hs[p-from] = h
	}
	last := to == len(tokens)
	kl, ml := 0, 0
	for i, kind := range []byte(s.spec.LayerPattern) {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("model: prefill: %w", err)
		}
		switch kind {
		case '*', DraftLayer:
			for p := from; p < to; p++ {
				s.writeKVLayer(&c, p, hs[p-from], kl)
			}
			kl++
		case 'M':
			if last {
				s.writeRowLayer(rv, h, ml, 0)
			}
			ml++
		}
		if err := done(i); err != nil {
			return nil, err
		}
	}
	if !last {
		return nil, nil
	}
	return s.logits(h), nil
}

func (s *synthetic) Decode(c Cache, token int32, pos int) ([]float32, error) {
	if err := checkToken(&s.spec, token); err != nil {
		return nil, err
	}
	if err := checkPos(&s.spec, pos); err != nil {
		return nil, err
	}
	rv := s.pool.Get().(*rowView)
	defer s.pool.Put(rv)
	if err := checkCache(&s.spec, &c, pos+1, rv); err != nil {
		return nil, err
	}
	h := s.base
	if pos > 0 {
		h = mix64(h, uint64(s.checksum(&c, rv, pos)))
	}
	h = mix64(h, uint64(uint32(token))<<32|uint64(pos))
	s.writeKV(&c, pos, h)
	s.writeRowHead(rv, h, s.touch)
	return s.logits(h), nil
}

// tokenHeads calls f with the bytes of each head of the token in slot slot
// of block blk, layer l, half kv, in head order.
func tokenHeads(c *Cache, blk kvcache.BlockID, l int, kv kvcache.KV, slot int, f func(h int, p []byte)) {
	n := int64(c.KV.HeadDim * c.KV.ElemSize)
	for h := range c.KV.KVHeads {
		off := c.KV.TokenOffset(blk, l, kv, slot, h)
		f(h, c.KVArena[off:off+n])
	}
}

func (s *synthetic) writeKV(c *Cache, pos int, h uint64) {
	for l := range s.spec.KV.Layers {
		s.writeKVLayer(c, pos, h, l)
	}
}

// writeKVLayer is writeKV for one layer.
func (s *synthetic) writeKVLayer(c *Cache, pos int, h uint64, l int) {
	tpb := c.KV.TokensPerBlock
	blk, slot := c.Blocks[pos/tpb], pos%tpb
	for kv := range kvcache.KV(2) {
		seed := mix64(h, uint64(l)<<1|uint64(kv))
		tokenHeads(c, blk, l, kv, slot, func(hd int, p []byte) { fillPattern(p, mix64(seed, uint64(hd))) })
	}
}

func (s *synthetic) writeRow(rv *rowView, h uint64) { s.writeRowHead(rv, h, 0) }

// writeRowHead is writeRow over the first n bytes of each section (n ≤ 0:
// all of them).
func (s *synthetic) writeRowHead(rv *rowView, h uint64, n int) {
	for l := range rv.conv {
		s.writeRowLayer(rv, h, l, n)
	}
}

// writeRowLayer is writeRowHead for layer l.
func (s *synthetic) writeRowLayer(rv *rowView, h uint64, l, n int) {
	for sec, p := range rv.conv[l] {
		fillPattern(head(p, n), mix64(h, 1<<32|uint64(l)<<2|uint64(sec)))
	}
	fillPattern(head(rv.ssm[l], n), mix64(h, 1<<32|uint64(l)<<2|3))
}

// head is the first n bytes of p, or p when n ≤ 0 or p is shorter.
func head(p []byte, n int) []byte {
	if n <= 0 || n >= len(p) {
		return p
	}
	return p[:n]
}

// checksum is the CRC-32C of the row's state (the first s.touch bytes of
// each section when set) and of the K/V of the tokens of the block holding
// position pos-1 (pos > 0).
func (s *synthetic) checksum(c *Cache, rv *rowView, pos int) uint32 {
	var crc uint32
	for l := range rv.conv {
		for _, p := range rv.conv[l] {
			crc = crc32.Update(crc, castagnoli, head(p, s.touch))
		}
		crc = crc32.Update(crc, castagnoli, head(rv.ssm[l], s.touch))
	}
	tpb := c.KV.TokensPerBlock
	last := pos - 1
	blk := c.Blocks[last/tpb]
	for l := range s.spec.KV.Layers {
		for kv := range kvcache.KV(2) {
			for slot := 0; slot <= last%tpb; slot++ {
				tokenHeads(c, blk, l, kv, slot, func(_ int, p []byte) { crc = crc32.Update(crc, castagnoli, p) })
			}
		}
	}
	return crc
}

// logits are pseudo-random, over text: printable ASCII, newline and EOS
// (every other token far below them), so that a reply decodes to valid
// text that encodes back to the same tokens, as a real model's does, and
// a conversation's next prompt continues the tokens its last turn
// generated.
func (s *synthetic) logits(h uint64) []float32 {
	out := make([]float32, s.spec.Vocab)
	rng := splitmix64(h)
	for i := range out {
		out[i] = rng.uniform(4)
		if !(i >= ' ' && i <= '~' || i == '\n' || i == int(EOS)) {
			out[i] -= 64
		}
	}
	return out
}

// fillPattern fills p with a pseudo-random pattern of seed: up to 1 KiB is
// generated, the rest is doubled with copy, so each byte is written once.
func fillPattern(p []byte, seed uint64) {
	rng := splitmix64(seed)
	n := min(len(p), 1024)
	i := 0
	for ; i+8 <= n; i += 8 {
		binary.LittleEndian.PutUint64(p[i:], rng.next())
	}
	if i < n {
		var w [8]byte
		binary.LittleEndian.PutUint64(w[:], rng.next())
		copy(p[i:n], w[:])
	}
	for n < len(p) {
		n += copy(p[n:], p[:n])
	}
}
