package model_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/model"
)

// chunks cuts [0, n) at random points (size 0: one chunk).
func chunks(rng *rand.Rand, n, size int) [][2]int {
	if size <= 0 {
		return [][2]int{{0, n}}
	}
	var out [][2]int
	for from := 0; from < n; {
		to := min(n, from+1+rng.IntN(size))
		out = append(out, [2]int{from, to})
		from = to
	}
	return out
}

// partBytes returns the bytes a Part names, in a fixed order: the K and V
// slots of its positions (and the rest of the last block when End), or the
// Mamba layer's row extent.
func partBytes(c model.Cache, p model.Part) []byte {
	if p.Kind == 'M' {
		e := c.Mamba.LayerExtent(c.Row, p.MambaLayer)
		return append([]byte(nil), c.MambaArena[e.Offset:e.Offset+e.Length]...)
	}
	kv := c.KV
	to := p.To
	if p.End {
		to = (p.To + kv.TokensPerBlock - 1) / kv.TokensPerBlock * kv.TokensPerBlock
	}
	n := int64(kv.HeadDim * kv.ElemSize)
	var out []byte
	for pos := p.From; pos < to; pos++ {
		b, slot := c.Blocks[pos/kv.TokensPerBlock], pos%kv.TokensPerBlock
		for _, k := range []kvcache.KV{kvcache.K, kvcache.V} {
			for h := range kv.KVHeads {
				off := kv.TokenOffset(b, p.KVLayer, k, slot, h)
				out = append(out, c.KVArena[off:off+n]...)
			}
		}
	}
	return out
}

// TestPrefillChunkEqualsPrefill: prefilling layer by layer, in chunks of
// any size, leaves the cache bit-identical to Prefill and gives the same
// logits, and the decode that follows agrees.
func TestPrefillChunkEqualsPrefill(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, e := range smallExecutors(t) {
		t.Run(e.Spec().Name, func(t *testing.T) {
			for _, size := range []int{0, 1, 5, 16, 40} {
				n := 1 + rng.IntN(60)
				toks := prompt(n, byte(size))
				blocks := e.Spec().KV
				nb := (n + 1 + 15) / 8 // room for one decode step at any block size here
				a := newArenas(t, e.Spec(), 2*nb+2, 2)
				b := newArenas(t, e.Spec(), 2*nb+2, 2)
				a.fill(0x11)
				b.fill(0x22)
				ca := a.cache(0, blockRange(0, nb)...)
				cb := b.cache(1, blockRange(nb+1, nb)...)
				want, err := e.Prefill(ca, toks)
				require.NoError(t, err)
				var got []float32
				for _, ch := range chunks(rng, n, size) {
					logits, err := model.PrefillChunk(context.Background(), e, cb, toks, ch[0], ch[1], nil)
					require.NoError(t, err)
					if ch[1] == n {
						got = logits
					} else {
						require.Nil(t, logits)
					}
				}
				require.Equal(t, bits(want), bits(got), "chunk size %d, blocks %v", size, blocks.TokensPerBlock)
				require.Equal(t, state(ca, n), state(cb, n))
				da, err := e.Decode(ca, 7, n)
				require.NoError(t, err)
				db, err := e.Decode(cb, 7, n)
				require.NoError(t, err)
				require.Equal(t, bits(da), bits(db))
			}
		})
	}
}

// TestPrefillChunkParts: every Part names bytes that are final when it is
// reported (they equal the cache after the whole prefill); the attention
// layers' parts cover every position once, and each Mamba layer is
// reported once, during the chunk that ends the prompt, never before.
func TestPrefillChunkParts(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, e := range append(smallExecutors(t), lookup(t, model.TinyHybrid+"?prefill_delay=10us")) {
		t.Run(e.Spec().Name, func(t *testing.T) {
			spec := e.Spec()
			for _, size := range []int{0, 3, 8, 13} {
				n := 2 + rng.IntN(50)
				toks := prompt(n, byte(size+1))
				nb := (n + 7) / 8 * 2
				a := newArenas(t, spec, nb+1, 1)
				a.fill(0x33)
				c := a.cache(0, blockRange(0, nb)...)
				type seen struct {
					p     model.Part
					bytes []byte
				}
				var parts []seen
				covered := make([][]int, spec.KV.Layers)
				for l := range covered {
					covered[l] = make([]int, n)
				}
				mamba := make([]int, spec.Mamba.Layers)
				for _, ch := range chunks(rng, n, size) {
					_, err := model.PrefillChunk(context.Background(), e, c, toks, ch[0], ch[1], func(p model.Part) {
						parts = append(parts, seen{p, partBytes(c, p)})
						switch p.Kind {
						case '*':
							require.Equal(t, ch, [2]int{p.From, p.To})
							require.Equal(t, ch[1] == n, p.End)
							for pos := p.From; pos < p.To; pos++ {
								covered[p.KVLayer][pos]++
							}
						case 'M':
							require.Equal(t, n, ch[1], "a Mamba state reported before the last chunk")
							mamba[p.MambaLayer]++
						default:
							t.Fatalf("part of a %q layer", p.Kind)
						}
					})
					require.NoError(t, err)
				}
				for l := range covered {
					for pos, k := range covered[l] {
						require.Equal(t, 1, k, "kv layer %d position %d", l, pos)
					}
				}
				for l, k := range mamba {
					require.Equal(t, 1, k, "mamba layer %d", l)
				}
				for _, s := range parts {
					require.Equal(t, s.bytes, partBytes(c, s.p), "%s changed after it was reported", s.p)
				}
			}
		})
	}
}

// TestPrefillChunkWholeOnly: an executor that prefills whole prompts only
// (one over caches in device memory) takes no chunk, and reports every
// part at the end. A simulated GPU chunks as its model does: the worker
// sleeps each chunk's simulated time.
func TestPrefillChunkWholeOnly(t *testing.T) {
	require.True(t, model.Chunked(lookup(t, model.NemotronH8B+"?gpu=h200")))
	require.True(t, model.Chunked(lookup(t, model.NemotronH8B)))
	require.True(t, model.Chunked(lookup(t, model.TinyHybrid+"?delay=1us")))
	inner := lookup(t, model.NemotronH8B)
	spec := inner.Spec()
	spec.KV.TokensPerBlock = 32
	a := newArenas(t, spec, 2, 1)
	e := model.OnDevice(inner, &memory{b: make([]byte, len(a.kvMem))}, &memory{b: make([]byte, len(a.mMem))})
	require.False(t, model.Chunked(e))
	c := a.cache(0, 0, 1)
	toks := prompt(40, 1)
	_, err := model.PrefillChunk(context.Background(), e, c, toks, 0, 20, nil)
	require.ErrorIs(t, err, model.ErrInvalidOption)
	var n int
	_, err = model.PrefillChunk(context.Background(), e, c, toks, 0, 40, func(model.Part) { n++ })
	require.NoError(t, err)
	require.Equal(t, spec.KV.Layers+spec.Mamba.Layers, n)
	for _, bad := range [][2]int{{-1, 3}, {0, 41}, {5, 5}, {6, 5}} {
		_, err = model.PrefillChunk(context.Background(), e, c, toks, bad[0], bad[1], nil)
		require.ErrorIs(t, err, model.ErrInvalidCache, "%v", bad)
	}
}

// TestPrefillChunkDelaySpread: a delayed executor reports its layers one
// share of the chunk's delay apart, not all at the end, and a cancel ends
// the chunk between layers.
func TestPrefillChunkDelaySpread(t *testing.T) {
	e := lookup(t, model.TinyHybrid+"?prefill_delay=2ms")
	spec := e.Spec()
	a := newArenas(t, spec, 4, 1)
	c := a.cache(0, blockRange(0, 4)...)
	toks := prompt(40, 2)
	var at []time.Duration
	start := time.Now()
	_, err := model.PrefillChunk(context.Background(), e, c, toks, 0, 40, func(model.Part) { at = append(at, time.Since(start)) })
	require.NoError(t, err)
	total := 40 * 2 * time.Millisecond
	require.Len(t, at, spec.KV.Layers+spec.Mamba.Layers)
	// The first part comes after about its layer's share, well before the
	// whole delay (a loaded machine only makes the rest later).
	require.Less(t, at[0], at[len(at)-1])
	require.GreaterOrEqual(t, at[len(at)-1], total*time.Duration(len(spec.LayerPattern)-1)/time.Duration(len(spec.LayerPattern)))

	ctx, cancel := context.WithCancel(context.Background())
	var parts int
	_, err = model.PrefillChunk(ctx, e, c, toks, 0, 40, func(model.Part) { parts++; cancel() })
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, 1, parts)
	require.False(t, errors.Is(err, model.ErrInvalidCache))
}
