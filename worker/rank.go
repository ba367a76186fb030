package worker

import (
	"fmt"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/prefix"
)

// PoolParams sizes one rank's pools.
type PoolParams struct {
	// MaxBatchSize is the number of real requests a rank holds at once
	// (real Mamba rows); reserved rows come on top.
	MaxBatchSize int
	// AttentionDP reserves the ADP dummy row and keeps one KV block aside.
	AttentionDP bool
	// TokensPerBlock overrides the model's block size when > 0.
	TokensPerBlock int
	// KVBlocks is the KV pool size; 0 picks enough for MaxBatchSize requests
	// of the model's full context, capped at DefaultKVBytes.
	KVBlocks int
	// StateCheckpoints is the number of Mamba state checkpoint rows of the
	// prefix cache (mambacache.Config.CheckpointRows), beyond the real and
	// reserved rows; 0 keeps no states, and so no prefix cache.
	StateCheckpoints int
	// DraftTokens, with speculative decoding on, is its most draft tokens
	// (Speculation.Tokens) and DraftLenSchedule its schedule: they size the
	// padding rows (one per reachable draft length) and add a scratch row
	// per real row (mambacache.Config.DraftTokens).
	DraftTokens      int
	DraftLenSchedule mambacache.DraftSchedule
	// AcceptanceGating reserves the zero-length padding row an
	// acceptance-rate gate needs (Speculation.GateWindow).
	AcceptanceGating bool
}

// DefaultKVBytes caps the KV arena a rank gets when KVBlocks is 0, so the
// synthetic presets of large models stay runnable on a laptop.
const DefaultKVBytes = 512 << 20

// DefaultCheckpointBytes caps the state checkpoint rows a rank gets by
// default (DefaultStateCheckpoints), as DefaultKVBytes caps its KV.
const DefaultCheckpointBytes = 1 << 30

// DefaultCheckpointInterval is the default Config.CheckpointInterval: a
// prompt's state is kept every 1024 tokens besides its end. A checkpoint
// costs a row copy (49 MiB for nemotron-h-8b, a few milliseconds) and a
// checkpoint row until evicted; a prompt that shares a longer prefix than
// its nearest checkpoint recomputes fewer than 1024 tokens, a few percent
// of a long shared system prompt's prefill.
const DefaultCheckpointInterval = 1024

// DefaultStateCheckpoints is the checkpoint rows a rank of maxBatch real
// rows of rowBytes each gets by default: four per real row (the end of a
// request's prompt and of its generation, for a turn or two of each
// conversation it serves, and interval checkpoints), within
// DefaultCheckpointBytes, and at least one.
func DefaultStateCheckpoints(maxBatch int, rowBytes int64) int {
	n := 4 * maxBatch
	if rowBytes > 0 {
		n = min(n, int(DefaultCheckpointBytes/rowBytes))
	}
	return max(n, 1)
}

// PoolConfig returns the pool configuration of one rank for spec.
func PoolConfig(spec model.Spec, p PoolParams) (hybrid.Config, error) {
	if p.MaxBatchSize < 1 {
		return hybrid.Config{}, fmt.Errorf("worker: max batch size %d: %w", p.MaxBatchSize, ErrInvalidConfig)
	}
	kv := spec.KV
	if p.TokensPerBlock > 0 {
		kv.TokensPerBlock = p.TokensPerBlock
	}
	kv.ByteBudget = 0
	kv.Blocks = p.KVBlocks
	if kv.Blocks <= 0 {
		kv.Blocks = 1 // placeholder so BlocksFor and BlockBytes can be asked
		if err := kv.Validate(); err != nil {
			return hybrid.Config{}, fmt.Errorf("worker: kv pool: %w", err)
		}
		n := p.MaxBatchSize * kv.BlocksFor(spec.MaxContext)
		if limit := int(DefaultKVBytes / kv.BlockBytes()); n > limit {
			n = limit
		}
		if p.AttentionDP {
			n++ // the dummy's block
		}
		kv.Blocks = max(n, 2)
	}
	m := spec.Mamba
	m.MaxBatchSize = p.MaxBatchSize
	m.AttentionDP = p.AttentionDP
	m.PPSize = 1
	m.CheckpointRows = p.StateCheckpoints
	m.DraftTokens, m.DraftLenSchedule, m.AcceptanceGating = p.DraftTokens, p.DraftLenSchedule, p.AcceptanceGating
	m.MaxDraftTokens = max(m.MaxDraftTokens, p.DraftTokens)
	cfg := hybrid.Config{KV: kv, Mamba: m}
	if err := cfg.Validate(); err != nil {
		return hybrid.Config{}, fmt.Errorf("worker: %w", err)
	}
	return cfg, nil
}

// Rank is one attention-DP rank: a hybrid cache manager, the two arenas its
// offsets point into, and the executor that reads and writes them.
//
// The scheduler's loop goroutine owns a Rank's request list and promise count;
// the manager and arenas are also read by transfer code, through the
// offsets of requests it was handed.
type Rank struct {
	index      int
	mgr        *hybrid.Manager
	exec       model.Executor
	kvArena    []byte
	mambaArena []byte
	kvCfg      kvcache.Config
	mCfg       mambacache.Config
	budget     int // blocks real requests may be promised
	rows       int // rows real requests may hold
	// prefix: the rank keeps a prefix cache (it has checkpoint rows and its
	// executor resumes prefills); root is the root of its block names.
	prefix bool
	root   prefix.Hash

	// Owned by the scheduler loop.
	promised  int
	held      []*request
	published hybrid.Stats // the eviction counts last published
}

// NewRank builds a rank over arenas of at least the pools' ArenaBytes. The
// arenas are usually the bytes of registered data-plane regions.
func NewRank(index int, mgr *hybrid.Manager, exec model.Executor, kvArena, mambaArena []byte) (*Rank, error) {
	kvCfg, mCfg := mgr.KV().Config(), mgr.Mamba().Config()
	if int64(len(kvArena)) < kvCfg.ArenaBytes() {
		return nil, fmt.Errorf("worker: rank %d: kv arena %d bytes, want %d: %w",
			index, len(kvArena), kvCfg.ArenaBytes(), ErrInvalidConfig)
	}
	if int64(len(mambaArena)) < mCfg.ArenaBytes() {
		return nil, fmt.Errorf("worker: rank %d: mamba arena %d bytes, want %d: %w",
			index, len(mambaArena), mCfg.ArenaBytes(), ErrInvalidConfig)
	}
	rows, blocks := mgr.Capacity()
	r := &Rank{
		index: index, mgr: mgr, exec: exec,
		kvArena: kvArena, mambaArena: mambaArena,
		kvCfg: kvCfg, mCfg: mCfg, budget: blocks, rows: rows,
		prefix: mCfg.CheckpointRows > 0 && model.Chunked(exec),
	}
	r.root = prefixRoot(r) // also for delta handoffs, which share blocks without states
	return r, nil
}

// Index is the rank's position in the worker.
func (r *Rank) Index() int { return r.index }

// Manager is the rank's cache manager.
func (r *Rank) Manager() *hybrid.Manager { return r.mgr }

// Executor is the rank's model executor.
func (r *Rank) Executor() model.Executor { return r.exec }

// MaxTokens is the most KV tokens one request can ever hold on this rank.
func (r *Rank) MaxTokens() int { return r.budget * r.kvCfg.TokensPerBlock }

// cache builds the model's view of request id's resources; blocks is reused.
func (r *Rank) cache(id uint64, blocks []kvcache.BlockID) (model.Cache, error) {
	blocks, err := r.mgr.KV().Blocks(id, blocks[:0])
	if err != nil {
		return model.Cache{}, err
	}
	row, ok := r.mgr.Mamba().Row(id)
	if !ok {
		return model.Cache{}, fmt.Errorf("worker: request %d has no mamba row: %w", id, mambacache.ErrUnknownRequest)
	}
	return model.Cache{
		KVArena: r.kvArena, KV: r.kvCfg, Blocks: blocks,
		MambaArena: r.mambaArena, Mamba: r.mCfg, Row: row,
	}, nil
}

// room is the rank's admission view.
func (r *Rank) room() RankRoom {
	s := r.mgr.Stats()
	return RankRoom{Rows: s.RowsFree, Blocks: r.budget - r.promised - s.BlocksSharedOnly, Held: len(r.held)}
}

// load is the rank's planning view.
func (r *Rank) load(dst []Phase) RankLoad {
	l := RankLoad{}
	for _, q := range r.held {
		dst = append(dst, q.phase)
		if q.phase.Schedulable() && (q.fromCache || q.adopt) {
			l.NoCompute++
		}
	}
	l.Phases = dst
	return l
}
