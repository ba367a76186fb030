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
// own pools). Caches in device memory (OnDevice, and a TP group's shards
// there) are copied in the device memory, through a host buffer: the
// Memory seam has no device-to-device copy. A TP group with shards in
// device memory and shard 0 on the host (not wrapped in OnDevice) is
// refused with ErrInvalidOption.
func CopyState(e Executor, c Cache, cp StateCopy) error {
	var cs []Cache
	switch x := unwrap(e).(type) {
	case *sharded:
		if x.device() {
			return fmt.Errorf("%w: a state copy in device memory with shard 0 on the host", ErrInvalidOption)
		}
		cs = x.caches(c)
	case *onDevice:
		return x.copyState(c, cp)
	case *synthetic:
		if x.touch > 0 {
			return copyIn(c, cp, x)
		}
		cs = []Cache{c}
	default:
		cs = []Cache{c}
	}
	for i, c := range cs {
		if err := copyIn(c, cp, nil); err != nil {
			return fmt.Errorf("model: state copy, shard %d: %w", i, err)
		}
	}
	return nil
}

// copyIn makes cp in c. With head (a synthetic preset with touch=head,
// whose decode reads and rewrites only the head of each state section) it
// copies only those heads of the row: a simulated GPU copies a state row
// in device memory in microseconds, and copying a whole nemotron-h-8b row
// (49 MiB) on the CPU made the simulated workers CPU-bound on their
// prefix cache's copies. The tail block is copied whole either way.
func copyIn(c Cache, cp StateCopy, head *synthetic) error {
	if c.Mamba.Layers > 0 {
		rows := mambacache.Row(c.Mamba.ArenaRows())
		if cp.FromRow >= rows || cp.ToRow >= rows || int64(len(c.MambaArena)) < c.Mamba.ArenaBytes() {
			return fmt.Errorf("%w: rows %d -> %d of %d", ErrInvalidCache, cp.FromRow, cp.ToRow, rows)
		}
		if head != nil {
			head.copyRowHeads(c, cp.FromRow, cp.ToRow)
		} else {
			from, to := c.Mamba.RowExtent(cp.FromRow), c.Mamba.RowExtent(cp.ToRow)
			copy(c.MambaArena[to.Offset:to.End()], c.MambaArena[from.Offset:from.End()])
		}
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

// copyRowHeads copies the first s.touch bytes of each state section of row
// from to row to (checkpoint rows included: the caller checked both rows
// against the arena).
func (s *synthetic) copyRowHeads(c Cache, from, to mambacache.Row) {
	m := c.Mamba
	cp := func(dst, src mambacache.Extent) {
		n := min(int64(s.touch), src.Length)
		copy(c.MambaArena[dst.Offset:dst.Offset+n], c.MambaArena[src.Offset:src.Offset+n])
	}
	for l := range m.Layers {
		for sec := range 3 {
			cp(m.ConvExtent(to, l, mambacache.Section(sec)), m.ConvExtent(from, l, mambacache.Section(sec)))
		}
		cp(m.SSMExtent(to, l), m.SSMExtent(from, l))
	}
}

// copyState makes cp in the device memory of shard 0 (d.kv, d.mamba) and,
// for a TP group, of every other shard (in its device memory, or its host
// arenas where it has none).
func (d *onDevice) copyState(c Cache, cp StateCopy) error {
	if err := copyDevice(c, d.kv, d.mamba, cp); err != nil {
		return fmt.Errorf("model: state copy in device memory: %w", err)
	}
	s, ok := unwrap(d.e).(*sharded)
	if !ok {
		return nil
	}
	for i, sc := range s.caches(c)[1:] {
		p := s.more[i]
		var err error
		switch {
		case p.KVMem != nil && p.MambaMem != nil:
			err = copyDevice(sc, p.KVMem, p.MambaMem, cp)
		case p.KVMem == nil && p.MambaMem == nil:
			err = copyIn(sc, cp, nil)
		default: // refused as sharded.onDevice refuses it
			err = fmt.Errorf("%w: device memory for one pool of two", ErrInvalidCache)
		}
		if err != nil {
			return fmt.Errorf("model: state copy, shard %d: %w", i+1, err)
		}
	}
	return nil
}

// copyDevice makes cp in the device memories kv and mamba of a cache with
// c's pool configs, through a host buffer.
func copyDevice(c Cache, kv, mamba Memory, cp StateCopy) error {
	move := func(mem Memory, from, to, n int64) error {
		buf := make([]byte, n)
		if _, err := mem.ReadAt(buf, from); err != nil {
			return err
		}
		_, err := mem.WriteAt(buf, to)
		return err
	}
	if c.Mamba.Layers > 0 {
		rows := mambacache.Row(c.Mamba.ArenaRows())
		if cp.FromRow >= rows || cp.ToRow >= rows {
			return fmt.Errorf("%w: rows %d -> %d of %d", ErrInvalidCache, cp.FromRow, cp.ToRow, rows)
		}
		from, to := c.Mamba.RowExtent(cp.FromRow), c.Mamba.RowExtent(cp.ToRow)
		if err := move(mamba, from.Offset, to.Offset, from.Length); err != nil {
			return err
		}
	}
	if cp.Block && c.KV.Layers > 0 {
		n := kvcache.BlockID(c.KV.NumBlocks())
		if cp.FromBlock >= n || cp.ToBlock >= n {
			return fmt.Errorf("%w: blocks %d -> %d of %d", ErrInvalidCache, cp.FromBlock, cp.ToBlock, n)
		}
		from, to := c.KV.BlockExtent(cp.FromBlock), c.KV.BlockExtent(cp.ToBlock)
		if err := move(kv, from.Offset, to.Offset, from.Length); err != nil {
			return err
		}
	}
	return nil
}
