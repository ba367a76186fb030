package model

import (
	"fmt"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
)

// StateCopy is what the prefix cache moves inside one rank's pools: a
// whole Mamba state row, and optionally one KV block (every layer, K and
// V), from one place to another. A hit copies a checkpoint row into the
// request's row and the checkpoint's tail block into the request's block;
// taking a checkpoint copies the other way.
type StateCopy struct {
	FromRow, ToRow     mambacache.Row
	Block              bool
	FromBlock, ToBlock kvcache.BlockID
}

// CopyState makes the copy cp in every shard of e's caches (c is shard
// 0's; a TP group's other shards hold the same rows and blocks in their
// own pools). It is for executors that resume a prefill from a cached
// state (Chunked); a cache in device memory is refused with
// ErrInvalidOption, as a chunked prefill from it is.
func CopyState(e Executor, c Cache, cp StateCopy) error {
	var cs []Cache
	switch x := unwrap(e).(type) {
	case *sharded:
		if x.device() {
			return fmt.Errorf("%w: a state copy in device memory", ErrInvalidOption)
		}
		cs = x.caches(c)
	case *onDevice:
		return fmt.Errorf("%w: a state copy in device memory", ErrInvalidOption)
	default:
		cs = []Cache{c}
	}
	for i, c := range cs {
		if err := copyIn(c, cp); err != nil {
			return fmt.Errorf("model: state copy, shard %d: %w", i, err)
		}
	}
	return nil
}

func copyIn(c Cache, cp StateCopy) error {
	if c.Mamba.Layers > 0 {
		rows := mambacache.Row(c.Mamba.ArenaRows())
		if cp.FromRow >= rows || cp.ToRow >= rows || int64(len(c.MambaArena)) < c.Mamba.ArenaBytes() {
			return fmt.Errorf("%w: rows %d -> %d of %d", ErrInvalidCache, cp.FromRow, cp.ToRow, rows)
		}
		from, to := c.Mamba.RowExtent(cp.FromRow), c.Mamba.RowExtent(cp.ToRow)
		copy(c.MambaArena[to.Offset:to.End()], c.MambaArena[from.Offset:from.End()])
	}
	if cp.Block && c.KV.Layers > 0 {
		n := kvcache.BlockID(c.KV.NumBlocks())
		if cp.FromBlock >= n || cp.ToBlock >= n || int64(len(c.KVArena)) < c.KV.ArenaBytes() {
			return fmt.Errorf("%w: blocks %d -> %d of %d", ErrInvalidCache, cp.FromBlock, cp.ToBlock, n)
		}
		from, to := c.KV.BlockExtent(cp.FromBlock), c.KV.BlockExtent(cp.ToBlock)
		copy(c.KVArena[to.Offset:to.End()], c.KVArena[from.Offset:from.End()])
	}
	return nil
}
