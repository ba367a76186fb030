package reshard

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/stretchr/testify/require"
)

// The oracle shards a whole (TP 1) unit the way the reference
// (hetero-tp.md) says a TP-T shard holds it, addressing both through the
// pools' own extent functions (kvcache.Config.TokenOffset,
// mambacache.Config.ConvExtent/SSMExtent) rather than through Layout: a plan
// is right when applying it to the oracle's source shards gives the
// oracle's destination shards.

// refHolds is the reference's ownership rule: shard r of a TP-t group
// holds items [r·n/t, (r+1)·n/t) when t ≤ n, else the single item ⌊r·n/t⌋.
func refHolds(n, t, r int) (lo, hi int) {
	if t <= n {
		return r * n / t, (r + 1) * n / t
	}
	return r * n / t, r*n/t + 1
}

// splits reports whether n items split over t shards: t divides n, or, for
// a replicable dimension, n divides t.
func splits(n, t int, replicable bool) bool {
	return n%t == 0 || (replicable && t%n == 0)
}

// oracle is a cache shape with its oracle: its layout and how a shard holds it.
type oracle struct {
	name   string
	layout Layout
	ok     func(t int) bool                   // the shape splits over t shards
	unit   func(t int) int64                  // a shard's unit size, from the pool's config
	shard  func(full []byte, t, r int) []byte // the oracle's shard r of t
}

func kvModel(c kvcache.Config) oracle {
	c.Blocks, c.ByteBudget = 1, 0
	at := func(t int) kvcache.Config {
		s := c
		s.KVHeads = max(c.KVHeads/t, 1)
		return s
	}
	return oracle{
		name:   "kv",
		layout: KV(c),
		ok:     func(t int) bool { return splits(c.KVHeads, t, true) },
		unit:   func(t int) int64 { return at(t).BlockBytes() },
		shard: func(full []byte, t, r int) []byte {
			s := at(t)
			out := make([]byte, s.BlockBytes())
			lo, hi := refHolds(c.KVHeads, t, r)
			head := int64(c.HeadDim * c.ElemSize)
			for l := range c.Layers {
				for kv := range kvcache.KV(2) {
					for slot := range c.TokensPerBlock {
						for h := lo; h < hi; h++ {
							d := s.TokenOffset(0, l, kv, slot, h-lo)
							f := c.TokenOffset(0, l, kv, slot, h)
							copy(out[d:d+head], full[f:f+head])
						}
					}
				}
			}
			return out
		},
	}
}

func mambaModel(c mambacache.Config) oracle {
	c.MaxBatchSize = 1
	at := func(t int) mambacache.Config {
		s := c
		s.Heads, s.NGroups = c.Heads/t, max(c.NGroups/t, 1)
		return s
	}
	// byHeads[s] says whether conv section s is split by heads (x, V) or
	// by groups (B, C, Q, K).
	byHeads := [3]bool{true, false, false}
	if c.ConvLayout == mambacache.ConvQKV {
		byHeads = [3]bool{false, false, true}
	}
	col := int64((c.DConv - 1) * c.ConvElemSize)
	return oracle{
		name:   "mamba-" + c.ConvLayout.String(),
		layout: Mamba(c),
		ok:     func(t int) bool { return splits(c.Heads, t, false) && splits(c.NGroups, t, true) },
		unit:   func(t int) int64 { return at(t).RowBytes() },
		shard: func(full []byte, t, r int) []byte {
			s := at(t)
			out := make([]byte, s.RowBytes())
			hlo, hhi := refHolds(c.Heads, t, r)
			glo, ghi := refHolds(c.NGroups, t, r)
			for l := range c.Layers {
				for sec := range mambacache.Section(3) {
					lo, hi, ch := glo, ghi, int64(c.DState) // channels per item
					if byHeads[sec] {
						lo, hi, ch = hlo, hhi, int64(c.HeadDim)
					}
					d, f := s.ConvExtent(0, l, sec), c.ConvExtent(0, l, sec)
					n := int64(hi-lo) * ch * col
					if d.Length != n {
						panic(fmt.Sprintf("oracle: conv section %v of the shard has %d bytes, want %d", sec, d.Length, n))
					}
					copy(out[d.Offset:d.Offset+n], full[f.Offset+int64(lo)*ch*col:])
				}
				head := int64(c.HeadDim * c.DState * c.SSMElemSize)
				d, f := s.SSMExtent(0, l), c.SSMExtent(0, l)
				copy(out[d.Offset:d.End()], full[f.Offset+int64(hlo)*head:f.Offset+int64(hhi)*head])
			}
			return out
		},
	}
}

// mambaSDModel is mambaModel for a pool whose conv states are stored
// position by position (MambaSD): its oracle transposes each layer's conv
// state to channel order, shards it as mambaModel's does, and transposes
// the shard back.
func mambaSDModel(c mambacache.Config) oracle {
	m := mambaModel(c)
	c.MaxBatchSize = 1
	ds := m.shard
	m.name += "-sd"
	m.layout = MambaSD(c)
	m.shard = func(full []byte, t, r int) []byte {
		s := c
		s.Heads, s.NGroups = c.Heads/t, max(c.NGroups/t, 1)
		return convOrder(s, ds(convOrder(c, full, false), t, r), true)
	}
	return m
}

// convOrder returns row, a row of a pool of c, with each layer's conv state
// transposed: channel order [channels][DConv-1] to position order
// [DConv-1][channels] (toSD), or back.
func convOrder(c mambacache.Config, row []byte, toSD bool) []byte {
	out := bytes.Clone(row)
	e, pos := c.ConvElemSize, c.DConv-1
	for l := range c.Layers {
		at := c.ConvExtent(0, l, 0).Offset
		ch := int(c.ConvBytes()) / (pos * e)
		for i := range ch {
			for k := range pos {
				ds, sd := at+int64((i*pos+k)*e), at+int64((k*ch+i)*e)
				if toSD {
					copy(out[sd:sd+int64(e)], row[ds:ds+int64(e)])
				} else {
					copy(out[ds:ds+int64(e)], row[sd:sd+int64(e)])
				}
			}
		}
	}
	return out
}

// dims with many divisors, so that most TP sizes up to 8 split them and
// some replicate.
var itemChoices = []int{1, 2, 3, 4, 5, 6, 7, 8, 12, 24}

func randKV(rng *rand.Rand) kvcache.Config {
	return kvcache.Config{
		Layers:         1 + rng.IntN(2),
		KVHeads:        itemChoices[rng.IntN(len(itemChoices))],
		HeadDim:        1 + rng.IntN(3),
		ElemSize:       []int{1, 2}[rng.IntN(2)],
		TokensPerBlock: []int{2, 4}[rng.IntN(2)],
	}
}

func randMamba(rng *rand.Rand) mambacache.Config {
	return mambacache.Config{
		Layers:       1 + rng.IntN(2),
		DState:       1 + rng.IntN(3),
		DConv:        2 + rng.IntN(3),
		Heads:        []int{8, 24, 40, 56}[rng.IntN(4)],
		HeadDim:      1 + rng.IntN(2),
		NGroups:      itemChoices[rng.IntN(len(itemChoices))],
		ConvElemSize: []int{1, 2, 4}[rng.IntN(3)],
		SSMElemSize:  []int{1, 2, 4}[rng.IntN(3)],
		ConvLayout:   mambacache.ConvLayout(rng.IntN(2)),
	}
}

// newRand returns a fixed-seed generator.
func newRand() *rand.Rand { return rand.New(rand.NewPCG(4, 6)) }

// fill returns n random bytes.
func fill(rng *rand.Rand, n int64) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

// shards returns the oracle's t shards of full.
func (m oracle) shards(full []byte, t int) [][]byte {
	out := make([][]byte, t)
	for r := range out {
		out[r] = m.shard(full, t, r)
	}
	return out
}

// reshard applies p to the source shards src and returns the destination
// shards.
func reshard(t testing.TB, p *Plan, src [][]byte) [][]byte {
	t.Helper()
	require.Len(t, src, p.From)
	dst := make([][]byte, p.To)
	for rd := range dst {
		dst[rd] = make([]byte, p.DstBytes)
		for rs := range src {
			Apply(dst[rd], src[rs], p.Copies(rs, rd))
		}
	}
	return dst
}

// exactlyOnce returns an error unless every byte of every destination
// unit of p is written by exactly one piece of one pair, every piece reads
// inside the source unit, and the plan has at most
// len(Sections)·(From+To-1) copies. It counts writes per byte,
// independently of how the plan was built.
func exactlyOnce(p *Plan) error {
	count := make([]uint8, p.DstBytes)
	for rd := range p.To {
		clear(count)
		for rs := range p.From {
			for _, c := range p.Copies(rs, rd) {
				if c.Len < 1 || c.Count < 1 {
					return fmt.Errorf("%d→%d: empty copy %v", rs, rd, c)
				}
				for pc := range c.Pieces() {
					if pc.Src < 0 || pc.Src+pc.Len > p.SrcBytes {
						return fmt.Errorf("%d→%d reads [%d, +%d) of a %d-byte source unit", rs, rd, pc.Src, pc.Len, p.SrcBytes)
					}
					if pc.Dst < 0 || pc.Dst+pc.Len > p.DstBytes {
						return fmt.Errorf("%d→%d writes [%d, +%d) of a %d-byte destination unit", rs, rd, pc.Dst, pc.Len, p.DstBytes)
					}
					for i := pc.Dst; i < pc.Dst+pc.Len; i++ {
						count[i]++
					}
				}
			}
		}
		for i, n := range count {
			if n != 1 {
				return fmt.Errorf("%s: destination shard %d byte %d written %d times\n%v", p.Layout.Name, rd, i, n, p)
			}
		}
	}
	if max := len(p.Layout.Sections) * (p.From + p.To - 1); p.Len() > max {
		return fmt.Errorf("plan of %d copies, want at most %d:\n%v", p.Len(), max, p)
	}
	return nil
}

// sameShards returns an error naming the first shard of got that differs
// from want.
func sameShards(got, want [][]byte) error {
	if len(got) != len(want) {
		return fmt.Errorf("%d shards, want %d", len(got), len(want))
	}
	for r := range got {
		if !bytes.Equal(got[r], want[r]) {
			return fmt.Errorf("shard %d differs from the oracle's", r)
		}
	}
	return nil
}
