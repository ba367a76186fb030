package model_test

import (
	"bytes"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
)

// arenas are a KV arena of `blocks` blocks and a Mamba arena, sized from a Spec.
type arenas struct {
	spec  model.Spec
	kv    kvcache.Config
	mamba mambacache.Config
	kvMem []byte
	mMem  []byte
}

func newArenas(t testing.TB, spec model.Spec, blocks, batch int) *arenas {
	t.Helper()
	kv := spec.KV
	kv.Blocks = blocks
	require.NoError(t, kv.Validate())
	m := spec.Mamba
	m.MaxBatchSize = batch
	require.NoError(t, m.Validate())
	return &arenas{
		spec:  spec,
		kv:    kv,
		mamba: m,
		kvMem: make([]byte, kv.ArenaBytes()),
		mMem:  make([]byte, m.ArenaBytes()),
	}
}

func (a *arenas) cache(row mambacache.Row, blocks ...kvcache.BlockID) model.Cache {
	return model.Cache{
		KVArena:    a.kvMem,
		KV:         a.kv,
		Blocks:     blocks,
		MambaArena: a.mMem,
		Mamba:      a.mamba,
		Row:        row,
	}
}

// fill sets every byte of both arenas to v.
func (a *arenas) fill(v byte) {
	for _, mem := range [][]byte{a.kvMem, a.mMem} {
		if len(mem) == 0 {
			continue
		}
		mem[0] = v
		for n := 1; n < len(mem); n *= 2 {
			copy(mem[n:], mem[:n])
		}
	}
}

// all reports whether every byte of mem is v.
func all(mem []byte, v byte) bool {
	return bytes.Count(mem, []byte{v}) == len(mem)
}

func blockRange(from, n int) []kvcache.BlockID {
	b := make([]kvcache.BlockID, n)
	for i := range b {
		b[i] = kvcache.BlockID(from + i)
	}
	return b
}

// state returns a copy of a request's state: its Mamba row extents and the K/V
// of positions [0, tokens), in a fixed order independent of where they live.
func state(c model.Cache, tokens int) []byte {
	var out []byte
	m := c.Mamba
	for l := range m.Layers {
		for s := range 3 {
			e := m.ConvExtent(c.Row, l, mambacache.Section(s))
			out = append(out, c.MambaArena[e.Offset:e.Offset+e.Length]...)
		}
		e := m.SSMExtent(c.Row, l)
		out = append(out, c.MambaArena[e.Offset:e.Offset+e.Length]...)
	}
	kv := c.KV
	n := int64(kv.HeadDim * kv.ElemSize)
	for p := range tokens {
		b, slot := c.Blocks[p/kv.TokensPerBlock], p%kv.TokensPerBlock
		for l := range kv.Layers {
			for _, k := range []kvcache.KV{kvcache.K, kvcache.V} {
				for h := range kv.KVHeads {
					off := kv.TokenOffset(b, l, k, slot, h)
					out = append(out, c.KVArena[off:off+n]...)
				}
			}
		}
	}
	return out
}

func lookup(t testing.TB, name string) model.Executor {
	t.Helper()
	e, err := model.Lookup(name)
	require.NoError(t, err)
	return e
}

func prompt(n int, salt byte) []int32 {
	toks := make([]int32, n)
	for i := range toks {
		toks[i] = int32((i*37 + int(salt)*11 + 5) % 256)
	}
	return toks
}

func bits(x []float32) []uint32 {
	b := make([]uint32, len(x))
	for i, v := range x {
		b[i] = math.Float32bits(v)
	}
	return b
}

// smallExecutors are tiny-hybrid (without and with its draft head) and two synthetic executors with small
// shapes (one per conv layout), cheap enough for the race detector. The real
// presets run in norace_test.go.
func smallExecutors(t testing.TB) []model.Executor {
	t.Helper()
	es := []model.Executor{lookup(t, model.TinyHybrid), lookup(t, model.TinyHybrid+"?mtp=1")}
	for _, layout := range []mambacache.ConvLayout{mambacache.ConvXBC, mambacache.ConvQKV} {
		e, err := model.NewSynthetic("synthetic-small-"+layout.String(), model.Spec{
			LayerPattern: "M*M-M*",
			MaxContext:   512,
			KV:           kvcache.Config{KVHeads: 2, HeadDim: 8, ElemSize: 2, TokensPerBlock: 8},
			Mamba: mambacache.Config{DState: 4, DConv: 4, Heads: 4, HeadDim: 4, NGroups: 2,
				ConvElemSize: 2, SSMElemSize: 4, ConvLayout: layout},
		})
		require.NoError(t, err)
		es = append(es, e)
	}
	return es
}

// touchSpec is a small synthetic shape whose SSM extents (4·16·8·4 = 2 KiB)
// are longer than touchBytes, for the touch=head tests.
var touchSpec = model.Spec{
	LayerPattern: "M*M-M*",
	MaxContext:   512,
	KV:           kvcache.Config{KVHeads: 2, HeadDim: 8, ElemSize: 2, TokensPerBlock: 8},
	Mamba: mambacache.Config{DState: 8, DConv: 4, Heads: 4, HeadDim: 16, NGroups: 2,
		ConvElemSize: 2, SSMElemSize: 4, ConvLayout: mambacache.ConvXBC},
}

// touchBytes is the decode touch of the touch=head tests.
const touchBytes = 64
