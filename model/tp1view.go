package model

import (
	"fmt"
	"sync"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/reshard"
)

// viaTP1 runs call on a TP-1 copy of the shards' caches: it gathers the
// request's blocks and row into a scratch TP-1 cache with the plan tp→1,
// runs call, and scatters the result back with the plan 1→tp. The bytes
// the model sees and leaves are those of a TP-1 run.
func viaTP1(e Executor, cs []Cache, tokens int, call func(Cache) ([]float32, error)) ([]float32, error) {
	v, err := newTP1View(e, cs, tokens, true)
	if err != nil {
		return nil, err
	}
	defer v.release()
	logits, err := call(v.one)
	if err != nil {
		return nil, err
	}
	v.scatterAll()
	return logits, nil
}

// tp1View is a TP-1 scratch copy of a request's cache on a TP group's
// shards (viaTP1).
type tp1View struct {
	one         Cache
	cs          []Cache
	nb          int // the request's blocks
	kvOut, mOut *reshard.Plan
	mRowBytes   int64 // of one row of a shard's Mamba unit
}

// newTP1View checks the shards' caches for a request of tokens positions
// and returns a TP-1 view of them: gathered, or zero where the caller
// overwrites what it scatters back (!gather).
func newTP1View(e Executor, cs []Cache, tokens int, gather bool) (*tp1View, error) {
	spec := e.Spec()
	tp := len(cs)
	shard, err := ShardSpec(spec, tp)
	if err != nil {
		return nil, err
	}
	tpb := cs[0].KV.TokensPerBlock
	for i := range cs {
		var rv rowView
		sh := shard
		sh.KV.TokensPerBlock = tpb
		if err := checkCache(&sh, &cs[i], tokens, &rv); err != nil {
			return nil, fmt.Errorf("shard %d: %w", i, err)
		}
	}
	kv := spec.KV
	kv.TokensPerBlock, kv.ByteBudget = tpb, 0
	nb := 0
	if kv.Layers > 0 {
		nb = kv.BlocksFor(tokens)
	}
	kv.Blocks = max(nb, 1)
	mc := spec.Mamba
	mc.MaxBatchSize, mc.PPSize, mc.AttentionDP = 1, 1, false
	v := &tp1View{one: Cache{KV: kv, Mamba: mc, Row: 0}, cs: cs, nb: nb}
	if kv.Layers > 0 {
		v.one.KVArena = scratchBytes(kv.ArenaBytes())
		for b := range nb {
			v.one.Blocks = append(v.one.Blocks, kvcache.BlockID(b))
		}
	}
	if mc.Layers > 0 {
		v.one.MambaArena = scratchBytes(mc.ArenaBytes())
	}
	kvIn, kvOut, mIn, mOut, err := tp1Plans(spec, kv, tp)
	if err != nil {
		return nil, err
	}
	v.kvOut, v.mOut = kvOut, mOut
	if mOut != nil {
		v.mRowBytes = mOut.Layout.RowBytes(tp)
	}
	if !gather {
		return v, nil
	}
	if kvIn != nil {
		for i := range nb {
			for r := range cs {
				reshard.Apply(v.unit(&v.one, true, i), v.unit(&cs[r], true, i), kvIn.Copies(r, 0))
			}
		}
	}
	if mIn != nil {
		for r := range cs {
			reshard.Apply(v.unit(&v.one, false, 0), v.unit(&cs[r], false, 0), mIn.Copies(r, 0))
		}
	}
	return v, nil
}

// scratch keeps the arenas of TP-1 views between calls (*[]byte): a
// view's bytes are all gathered or all written before they are read, so a
// reused arena needs no clearing, and a synthetic 4k-token view is 113 MiB.
var scratch sync.Pool

// scratchBytes returns n bytes of scratch, of unspecified content.
func scratchBytes(n int64) []byte {
	if b, ok := scratch.Get().(*[]byte); ok {
		if int64(cap(*b)) >= n {
			return (*b)[:n]
		}
		scratch.Put(b) // too small for this one; another view may fit
	}
	return make([]byte, n)
}

// release returns v's arenas to scratch; v is not used after.
func (v *tp1View) release() {
	for _, b := range [][]byte{v.one.KVArena, v.one.MambaArena} {
		if cap(b) > 0 {
			scratch.Put(&b)
		}
	}
	v.one.KVArena, v.one.MambaArena = nil, nil
}

// unit is block i of c's request (kvUnit), else its Mamba row.
func (v *tp1View) unit(c *Cache, kvUnit bool, i int) []byte {
	if kvUnit {
		x := c.KV.BlockExtent(c.Blocks[i])
		return c.KVArena[x.Offset : x.Offset+x.Length]
	}
	x := c.Mamba.RowExtent(c.Row)
	return c.MambaArena[x.Offset : x.Offset+x.Length]
}

// scatterAll copies the whole view back to the shards.
func (v *tp1View) scatterAll() {
	if v.kvOut != nil {
		for i := range v.nb {
			for r := range v.cs {
				reshard.Apply(v.unit(&v.cs[r], true, i), v.unit(&v.one, true, i), v.kvOut.Copies(0, r))
			}
		}
	}
	if v.mOut != nil {
		for r := range v.cs {
			reshard.Apply(v.unit(&v.cs[r], false, 0), v.unit(&v.one, false, 0), v.mOut.Copies(0, r))
		}
	}
}

// scatterMamba copies back Mamba layer layer: one row of the unit in
// package reshard's layout.
func (v *tp1View) scatterMamba(layer int) {
	if v.mOut == nil {
		return
	}
	lo := int64(layer) * v.mRowBytes
	for r := range v.cs {
		reshard.ApplyRange(v.unit(&v.cs[r], false, 0), v.unit(&v.one, false, 0), v.mOut.Copies(0, r), lo, lo+v.mRowBytes)
	}
}

// scatterKV copies back the K and V of KV layer layer at positions
// [from, to): in each block that holds them, the slots of each head of the
// layer's K and V rows.
func (v *tp1View) scatterKV(layer, from, to int) {
	if v.kvOut == nil {
		return
	}
	t := v.one.KV.TokensPerBlock
	for k := from / t; k*t < to && k < v.nb; k++ {
		s0, s1 := int64(max(from, k*t)-k*t), int64(min(to, (k+1)*t)-k*t)
		for lo, hi := range reshard.LayerSlots(v.kvOut, t, layer, s0, s1) {
			for r := range v.cs {
				reshard.ApplyRange(v.unit(&v.cs[r], true, k), v.unit(&v.one, true, k), v.kvOut.Copies(0, r), lo, hi)
			}
		}
	}
}

func tp1Plans(spec Spec, kv kvcache.Config, tp int) (kvIn, kvOut, mIn, mOut *reshard.Plan, err error) {
	if kv.Layers > 0 {
		if kvIn, err = reshard.New(reshard.KV(kv), tp, 1); err != nil {
			return
		}
		if kvOut, err = reshard.New(reshard.KV(kv), 1, tp); err != nil {
			return
		}
	}
	if spec.Mamba.Layers > 0 {
		if mIn, err = reshard.New(reshard.Mamba(spec.Mamba), tp, 1); err != nil {
			return
		}
		mOut, err = reshard.New(reshard.Mamba(spec.Mamba), 1, tp)
	}
	return
}
