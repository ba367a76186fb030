package model

import (
	"context"
	"fmt"
	"time"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/reshard"
)

// Tensor parallelism. A TP-N worker keeps a request's cache on N shards,
// each in its own pools, with the shapes ShardSpec gives: the KV heads, Mamba
// heads, groups and conv sections it would hold on its own GPU, laid out as
// package reshard describes (a replicated KV head or group when N exceeds
// their count). PrefillShards and DecodeShards run a model over the N caches
// of one request, in shard order.
//
// tiny-hybrid runs sharded for real: each shard computes the rows of the
// column-parallel projections (z|x B C|dt, Q, K, V, the MLP's up and gate)
// that feed its own heads and state, and the row-parallel projections (the
// Mamba and attention out-projections, the MLP's down-projection) are
// reduced across shards in one fixed order: the four interleaved partial
// sums of a dot product are carried from shard 0 to shard N-1 (chain),
// exactly as one shard sums them alone. So every reduction adds the same
// numbers in the same order whatever N is, and TP 1, 2 and 4 give
// bit-identical logits and, read back through reshard, bit-identical caches.
// The synthetic presets gather the shards into one TP-1 view, run, and
// scatter back (their fake math reads whole rows).

// ShardedExecutor is an Executor that runs over a tensor-parallel group's
// shard caches itself (see ShardSpec). cs holds one Cache per shard, in
// shard order, each with that shard's pool configs; every shard holds the
// same blocks and row ids.
type ShardedExecutor interface {
	Executor
	PrefillShards(cs []Cache, tokens []int32) ([]float32, error)
	DecodeShards(cs []Cache, token int32, pos int) ([]float32, error)
}

// ShardSpec returns the cache shapes of one shard of a TP-tp group running
// spec: KV and Mamba split by reshard.KVShard and reshard.MambaShard. An
// error wraps ErrInvalidCache and the reshard sentinel, and names the
// dimension that does not split.
func ShardSpec(spec Spec, tp int) (Spec, error) {
	if tp == 1 {
		return spec, nil
	}
	if spec.KV.Layers > 0 {
		kv, err := reshard.KVShard(spec.KV, tp)
		if err != nil {
			return Spec{}, fmt.Errorf("%w: %s at TP %d: %w", ErrInvalidCache, spec.Name, tp, err)
		}
		spec.KV = kv
	}
	if spec.Mamba.Layers > 0 {
		m, err := reshard.MambaShard(spec.Mamba, tp)
		if err != nil {
			return Spec{}, fmt.Errorf("%w: %s at TP %d: %w", ErrInvalidCache, spec.Name, tp, err)
		}
		spec.Mamba = m
	}
	return spec, nil
}

// CheckTP reports whether e can run at tensor-parallel size tp: its caches
// split (ShardSpec) and, for tiny-hybrid, its query heads and the
// row-parallel reductions too. The error names what does not split.
func CheckTP(e Executor, tp int) error {
	if _, err := ShardSpec(e.Spec(), tp); err != nil {
		return err
	}
	if m, ok := unwrap(e).(*tiny); ok {
		return m.checkTP(tp)
	}
	return nil
}

// PrefillShards runs e.Prefill over the shard caches of one request and
// returns the logits of the next token, the same for every len(cs) the
// model splits over. One cache is a plain PrefillContext.
func PrefillShards(ctx context.Context, e Executor, cs []Cache, tokens []int32) ([]float32, error) {
	if len(cs) == 1 {
		return PrefillContext(ctx, e, cs[0], tokens)
	}
	inner, pd, _ := delays(e)
	if err := sleep(ctx, time.Duration(len(tokens))*pd); err != nil {
		return nil, fmt.Errorf("model: prefill: %w", err)
	}
	if se, ok := inner.(ShardedExecutor); ok {
		return se.PrefillShards(cs, tokens)
	}
	return viaTP1(inner, cs, len(tokens), func(c Cache) ([]float32, error) { return inner.Prefill(c, tokens) })
}

// DecodeShards runs e.Decode over the shard caches of one request.
func DecodeShards(ctx context.Context, e Executor, cs []Cache, token int32, pos int) ([]float32, error) {
	if len(cs) == 1 {
		return DecodeContext(ctx, e, cs[0], token, pos)
	}
	inner, _, dd := delays(e)
	if err := sleep(ctx, dd); err != nil {
		return nil, fmt.Errorf("model: decode: %w", err)
	}
	if se, ok := inner.(ShardedExecutor); ok {
		return se.DecodeShards(cs, token, pos)
	}
	return viaTP1(inner, cs, pos+1, func(c Cache) ([]float32, error) { return inner.Decode(c, token, pos) })
}

// delays strips the wrappers that only time a call (delayed, timed).
func delays(e Executor) (inner Executor, prefill, decode time.Duration) {
	switch w := e.(type) {
	case *delayed:
		return w.inner, w.prefill, w.decode
	case timed:
		return w.Executor, 0, 0
	}
	return e, 0, 0
}

func unwrap(e Executor) Executor {
	inner, _, _ := delays(e)
	return inner
}

// prefillChunk implements chunker for a TP group: the group runs the chunk
// layer by layer, its simulated compute spread over the layers as
// delayed's is, and reports a layer done once every shard holds it.
// tiny-hybrid runs sharded; the synthetic presets run on a TP-1 view and
// scatter each layer back to the shards before reporting it (a synthetic
// prefill only writes, so its view is not gathered first, and only what
// the chunk wrote goes back). An inner executor that is not chunked takes only whole
// prompts.
func (s *sharded) prefillChunk(ctx context.Context, c Cache, tokens []int32, from, to int, done func(layer int) error) ([]float32, error) {
	if s.device() {
		// Not chunked (Chunked): a layer is final in device memory only
		// once the whole call stored it back.
		if from != 0 || to != len(tokens) {
			return nil, fmt.Errorf("%w: a TP group in device memory prefills whole prompts only", ErrInvalidOption)
		}
		logits, err := s.PrefillContext(ctx, c, tokens)
		if err != nil {
			return nil, err
		}
		for i := range s.inner.Spec().LayerPattern {
			if err := done(i); err != nil {
				return nil, err
			}
		}
		return logits, nil
	}
	cs := s.caches(c)
	inner, pd, _ := delays(s.inner)
	done = paced(ctx, time.Duration(to-from)*pd, len(inner.Spec().LayerPattern), done)
	if m, ok := inner.(*tiny); ok {
		return m.prefillChunkShards(ctx, cs, tokens, from, to, done)
	}
	ch, ok := inner.(chunker)
	if !ok {
		if from != 0 || to != len(tokens) {
			return nil, fmt.Errorf("%w: %s prefills whole prompts only", ErrInvalidOption, inner.Spec().Name)
		}
		logits, err := PrefillShards(ctx, s.inner, cs, tokens)
		if err != nil {
			return nil, err
		}
		for i := range inner.Spec().LayerPattern {
			if err := done(i); err != nil {
				return nil, err
			}
		}
		return logits, nil
	}
	_, writesOnly := inner.(*synthetic)
	v, err := newTP1View(inner, cs, to, !writesOnly)
	if err != nil {
		return nil, err
	}
	defer v.release()
	parts := partsOf(inner.Spec().LayerPattern)
	last := to == len(tokens)
	return ch.prefillChunk(ctx, v.one, tokens, from, to, func(layer int) error {
		switch p := parts[layer]; p.Kind {
		case '*':
			v.scatterKV(p.KVLayer, from, to)
		case 'M':
			if last || !writesOnly { // a synthetic Mamba layer is written in the last chunk only
				v.scatterMamba(p.MambaLayer)
			}
		}
		return done(layer)
	})
}

// ShardPools are the pools of one further shard of a TP group: its arenas
// and their configs (the shard shapes, ShardSpec). With KVMem and MambaMem
// set the pools live in device memory and the arenas are host copies the
// model computes over, moved per call as OnDevice moves shard 0's (wrap
// the group in OnDevice for that one).
type ShardPools struct {
	KVArena    []byte
	KV         kvcache.Config
	MambaArena []byte
	Mamba      mambacache.Config
	KVMem      Memory
	MambaMem   Memory
}

// Sharded returns e over a TP-(1+len(more)) group, as one Executor: the
// Cache of each call is shard 0's, and shards 1.. keep the same request
// (the same blocks and row ids, allocated once for the group) in more.
// Every call runs PrefillShards or DecodeShards. A group size e cannot run
// at is refused (CheckTP). Simulated step times (StepTimer) are not
// forwarded: a TP group is not modelled by the roofline.
func Sharded(e Executor, more []ShardPools) (Executor, error) {
	if err := CheckTP(e, 1+len(more)); err != nil {
		return nil, err
	}
	if len(more) == 0 {
		return e, nil
	}
	return &sharded{inner: e, more: more}, nil
}

type sharded struct {
	inner Executor
	more  []ShardPools
}

var (
	_ ContextExecutor = (*sharded)(nil)
	_ chunker         = (*sharded)(nil)
)

func (s *sharded) Spec() Spec { return s.inner.Spec() }

func (s *sharded) caches(c Cache) []Cache {
	cs := make([]Cache, 1+len(s.more))
	cs[0] = c
	for i, p := range s.more {
		cs[i+1] = Cache{KVArena: p.KVArena, KV: p.KV, Blocks: c.Blocks, MambaArena: p.MambaArena, Mamba: p.Mamba, Row: c.Row}
	}
	return cs
}

func (s *sharded) Prefill(c Cache, tokens []int32) ([]float32, error) {
	return s.PrefillContext(context.Background(), c, tokens)
}

func (s *sharded) Decode(c Cache, token int32, pos int) ([]float32, error) {
	return s.DecodeContext(context.Background(), c, token, pos)
}

func (s *sharded) PrefillContext(ctx context.Context, c Cache, tokens []int32) ([]float32, error) {
	cs := s.caches(c)
	return s.onDevice(cs, len(tokens), func() ([]float32, error) { return PrefillShards(ctx, s.inner, cs, tokens) })
}

func (s *sharded) DecodeContext(ctx context.Context, c Cache, token int32, pos int) ([]float32, error) {
	cs := s.caches(c)
	return s.onDevice(cs, pos+1, func() ([]float32, error) { return DecodeShards(ctx, s.inner, cs, token, pos) })
}

// device reports whether shards 1.. live in device memory.
func (s *sharded) device() bool {
	for _, p := range s.more {
		if p.KVMem != nil || p.MambaMem != nil {
			return true
		}
	}
	return false
}

// onDevice runs call with the request's bytes of shards 1.. (cs[1:], for a
// call over tokens positions) loaded from their device memory, and stores
// them back if it succeeded, as OnDevice does for one cache.
func (s *sharded) onDevice(cs []Cache, tokens int, call func() ([]float32, error)) ([]float32, error) {
	if !s.device() {
		return call()
	}
	var xs []touch
	for i, p := range s.more {
		if p.KVMem == nil || p.MambaMem == nil {
			return nil, fmt.Errorf("%w: shard %d: device memory for one pool of two", ErrInvalidCache, i+1)
		}
		xs = touched(xs, cs[i+1], tokens, p.KVMem, p.MambaMem, fmt.Sprintf("shard %d ", i+1))
	}
	return withDevice(xs, call)
}
