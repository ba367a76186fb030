package service

import (
	"fmt"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/worker/config"
)

// Tensor parallelism (--tp-size, issue 12). A rank of a TP-N worker runs N
// shards. Its manager allocates for the whole group over shard 0's pools,
// and every shard keeps a request at the same block and row ids in pools of
// its own shapes (model.ShardSpec), in its own arenas, registered as its
// own data-path regions. The scheduler sees one rank: its executor is
// model.Sharded over the other shards' pools, and the rank's RankRegions
// grants every shard's extents (decode) or reshards into the peer's
// (prefill, RankRegions.Source).

// tpPoolSpec returns the cache shapes every shard's pools are built from.
// A TP size the model does not split over is refused by name.
func tpPoolSpec(cfg config.Config, exec model.Executor) (model.Spec, error) {
	if err := model.CheckTP(exec, cfg.TPSize); err != nil {
		return model.Spec{}, fmt.Errorf("--tp-size %d: %w", cfg.TPSize, err)
	}
	return model.ShardSpec(exec.Spec(), cfg.TPSize)
}

// rankRegions registers shards 1.. of rank i next to shard 0's regions kv
// and mamba, and returns the rank's RankRegions over all of them.
func (n *node) rankRegions(i int, m *hybrid.Manager, kv, mamba *rdma.Region) (*transfer.RankRegions, error) {
	if n.cfg.TPSize <= 1 {
		return transfer.NewRankRegions(m, kv, mamba)
	}
	kc, mc := m.KV().Config(), m.Mamba().Config()
	shards := []transfer.Shard{{KV: kv, Mamba: mamba, KVConfig: kc, MambaConfig: mc}}
	var more []model.ShardPools
	for s := 1; s < n.cfg.TPSize; s++ {
		pools, kvDev, mDev, err := n.shardPools(kc, mc, s)
		if err != nil {
			return nil, err
		}
		kr, err := n.mem.register(n.data, fmt.Sprintf("rank%d-shard%d-kv", i, s), kvDev, kc.ArenaBytes())
		if err != nil {
			return nil, fmt.Errorf("register kv arena of shard %d: %w", s, err)
		}
		mr, err := n.mem.register(n.data, fmt.Sprintf("rank%d-shard%d-mamba", i, s), mDev, mc.ArenaBytes())
		if err != nil {
			return nil, fmt.Errorf("register mamba arena of shard %d: %w", s, err)
		}
		if kvDev == nil { // host memory: the model computes over the regions themselves
			pools.KVArena, pools.MambaArena = kr.Bytes(), mr.Bytes()
		}
		shards = append(shards, transfer.Shard{KV: kr, Mamba: mr, KVConfig: kc, MambaConfig: mc})
		more = append(more, pools)
	}
	if n.tpMore == nil {
		n.tpMore = tpShards{}
	}
	n.tpMore[i] = more
	return transfer.NewTPRankRegions(m, n.spec.KV, n.spec.Mamba, shards)
}

// shardPools returns the pools of shard s of a rank, before registration:
// with --memory cuda, device arenas (kvDev, mDev) and host copies of them
// for the model; in host memory, no arenas yet (the caller's regions, or
// host arenas of their own in local mode).
func (n *node) shardPools(kc kvcache.Config, mc mambacache.Config, s int) (p model.ShardPools, kvDev, mDev *cuda.Arena, err error) {
	p = model.ShardPools{KV: kc, Mamba: mc}
	if !n.mem.device() {
		return p, nil, nil, nil
	}
	if kvDev, mDev, err = n.mem.arenas(kc.ArenaBytes(), mc.ArenaBytes()); err != nil {
		return p, nil, nil, fmt.Errorf("shard %d: %w", s, err)
	}
	p.KVArena, p.MambaArena = make([]byte, kc.ArenaBytes()), make([]byte, mc.ArenaBytes())
	p.KVMem, p.MambaMem = kvDev, mDev
	return p, kvDev, mDev, nil
}

// tpExec returns rank i's executor: exec itself at TP 1, else exec over
// the rank's other shards (their registered arenas, or, in local mode,
// arenas of their own: host memory, or device memory with --memory cuda).
func (n *node) tpExec(i int, exec model.Executor, m *hybrid.Manager) (model.Executor, error) {
	if n.cfg.TPSize <= 1 {
		return exec, nil
	}
	more, ok := n.tpMore[i]
	if !ok {
		kc, mc := m.KV().Config(), m.Mamba().Config()
		for s := 1; s < n.cfg.TPSize; s++ {
			p, _, _, err := n.shardPools(kc, mc, s)
			if err != nil {
				return nil, err
			}
			if p.KVArena == nil {
				p.KVArena, p.MambaArena = make([]byte, kc.ArenaBytes()), make([]byte, mc.ArenaBytes())
			}
			more = append(more, p)
		}
	}
	return model.Sharded(exec, more)
}

// tpShards are the pools of shards 1.. of each rank, by rank index.
type tpShards map[int][]model.ShardPools
