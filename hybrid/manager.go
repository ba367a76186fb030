package hybrid

import (
	"errors"
	"fmt"
	"sync"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
)

// Config is the pair of pool configs.
type Config struct {
	KV    kvcache.Config
	Mamba mambacache.Config
}

// Validate checks both pool configs. Errors wrap kvcache.ErrInvalidConfig
// or mambacache.ErrInvalidConfig.
func (c Config) Validate() error {
	if err := c.KV.Validate(); err != nil {
		return fmt.Errorf("hybrid: kv: %w", err)
	}
	if err := c.Mamba.Validate(); err != nil {
		return fmt.Errorf("hybrid: mamba: %w", err)
	}
	if c.Mamba.AttentionDP && c.KV.NumBlocks() < 2 {
		return fmt.Errorf("hybrid: %w: attention DP keeps one block aside, a pool of %d blocks leaves none for requests",
			kvcache.ErrInvalidConfig, c.KV.NumBlocks())
	}
	return nil
}

// Resources a request holds.
type Resources struct {
	Row  mambacache.Row
	Runs []kvcache.Run
}

// Stats is a snapshot of both pools for metrics.
type Stats struct {
	RowsFree, RowsUsed, RowsReserved int
	BlocksFree, BlocksUsed           int
	// BlocksHeadroom is the number of free blocks kept aside for the
	// attention-DP dummy (1 while attention DP is on and the dummy is not
	// placed, else 0). It is included in BlocksFree.
	BlocksHeadroom int
	// Requests counts ids holding resources, dummies included.
	Requests int
	// The prefix cache. BlocksCached counts cached blocks (held or not),
	// BlocksAvailable what an allocation may take (free, evictable, and
	// the tails of evictable checkpoints; the headroom included),
	// BlocksEvicted and CheckpointsEvicted the evictions since New.
	BlocksCached, BlocksAvailable int
	// BlocksSharedOnly counts cached blocks held only by requests that
	// share them (kvcache.Pool.SharedOnlyBlocks): in use, yet no request
	// took them as its own.
	BlocksSharedOnly                  int
	BlocksEvicted, CheckpointsEvicted uint64
	Checkpoints                       mambacache.CheckpointState
}

// admitProbeID stands for "some real request" in headroom questions: any id
// other than the ADP dummy's.
const admitProbeID = mambacache.ADPDummyID + 1

// Manager composes the KV block pool and the Mamba row pool, as
// TensorRT-LLM's MixedMambaHybridCacheManager. Pure: no IO, no goroutines.
// Safe for concurrent use; its mutex is taken before the pools' mutexes.
//
// The pools must be changed only through the Manager: KV and Mamba are
// exposed for reading (extents, runs, rows).
type Manager struct {
	mu    sync.Mutex
	kv    *kvcache.Pool
	mamba *mambacache.Pool
	adp   bool
	// copying maps a request to the checkpoint it copies from (pinned).
	copying map[uint64]mambacache.Row
}

// New builds both pools. Errors wrap the pools' ErrInvalidConfig.
func New(cfg Config) (*Manager, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	kv, err := kvcache.New(cfg.KV)
	if err != nil {
		return nil, fmt.Errorf("hybrid: kv: %w", err)
	}
	mp, err := mambacache.New(cfg.Mamba)
	if err != nil {
		return nil, fmt.Errorf("hybrid: mamba: %w", err)
	}
	return &Manager{kv: kv, mamba: mp, adp: cfg.Mamba.AttentionDP}, nil
}

// KV returns the block pool.
func (m *Manager) KV() *kvcache.Pool { return m.kv }

// Mamba returns the row pool.
func (m *Manager) Mamba() *mambacache.Pool { return m.mamba }

// headroomFor is the number of free KV blocks that an allocation for id
// must leave: one while attention DP is on and the ADP dummy holds nothing,
// so that AddDummy(ADPDummyID) always succeeds; none for the ADP dummy
// itself. Once the dummy holds its block the headroom is in use; freeing
// the dummy returns at least one block, restoring it.
func (m *Manager) headroomFor(id uint64) int {
	if !m.adp || id == mambacache.ADPDummyID {
		return 0
	}
	if held, _ := m.kv.Has(mambacache.ADPDummyID); held {
		return 0
	}
	return 1
}

// Prepare gives request id a Mamba row and room for tokens KV tokens. It is
// all or nothing: on error nothing changed. For an id that already holds
// resources it keeps the row and grows the blocks to tokens (like
// TensorRT-LLM's prepare_resources, idempotent per id). Errors wrap
// mambacache.ErrDummyID, mambacache.ErrNoFreeRows, kvcache.ErrNoFreeBlocks
// or kvcache.ErrInvalidTokens.
func (m *Manager) Prepare(id uint64, tokens int) (Resources, error) {
	return m.PrepareTo(id, tokens, nil)
}

// PrepareTo is Prepare, appending the runs to dst (which the returned
// Resources.Runs then shares), so a caller reusing dst allocates nothing.
func (m *Manager) PrepareTo(id uint64, tokens int, dst []kvcache.Run) (Resources, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if tokens < 1 {
		return Resources{}, fmt.Errorf("hybrid: prepare %d: %w", id, kvcache.ErrInvalidTokens)
	}
	_, hadRow := m.mamba.Row(id)
	row, err := m.mamba.Allocate(id)
	if err != nil {
		return Resources{}, fmt.Errorf("hybrid: prepare %d: %w", id, err)
	}
	m.makeKVRoom(m.kv.Config().BlocksFor(tokens)-m.kv.HeldBlocks(id), m.headroomFor(id))
	if held, _ := m.kv.Has(id); held {
		err = m.kv.GrowWithHeadroom(id, tokens, m.headroomFor(id))
	} else {
		err = m.kv.AllocateWithHeadroom(id, tokens, m.headroomFor(id))
	}
	if err != nil {
		if !hadRow {
			m.mustFreeRow(id)
		}
		return Resources{}, fmt.Errorf("hybrid: prepare %d: %w", id, err)
	}
	runs, err := m.kv.Runs(id, dst)
	if err != nil {
		panic(fmt.Sprintf("hybrid: blocks of %d vanished: %v", id, err))
	}
	return Resources{Row: row, Runs: runs}, nil
}

func (m *Manager) mustFreeRow(id uint64) {
	if err := m.mamba.Free(id); err != nil {
		panic(fmt.Sprintf("hybrid: rollback of row of %d: %v", id, err))
	}
}

// Grow ensures request id has room for tokens KV tokens (decode appends
// one token per step). Errors wrap kvcache.ErrUnknownRequest,
// kvcache.ErrNoFreeBlocks or kvcache.ErrInvalidTokens; on error nothing
// changed.
func (m *Manager) Grow(id uint64, tokens int) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if held := m.kv.HeldBlocks(id); held > 0 {
		// Room for the blocks beyond those it holds (a shared prefix included).
		m.makeKVRoom(m.kv.Config().BlocksFor(tokens)-held, m.headroomFor(id))
	}
	if err := m.kv.GrowWithHeadroom(id, tokens, m.headroomFor(id)); err != nil {
		return fmt.Errorf("hybrid: grow %d: %w", id, err)
	}
	return nil
}

// AddDummy places dummy request id: its Mamba row first (a reserved row for
// ADPDummyID with attention DP and for padding sentinel ids, a real row
// otherwise), then one KV block. If the KV step fails the row taken by this
// call is released. With attention DP, AddDummy(ADPDummyID) always
// succeeds. Errors wrap mambacache.ErrNoFreeRows, kvcache.ErrNoFreeBlocks or
// kvcache.ErrAlreadyExists.
func (m *Manager) AddDummy(id uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, hadRow := m.mamba.Row(id)
	if _, err := m.mamba.AddDummy(id); err != nil {
		return fmt.Errorf("hybrid: dummy %d: %w", id, err)
	}
	if held, _ := m.kv.Has(id); !held {
		m.makeKVRoom(1, m.headroomFor(id))
	}
	if err := m.kv.AllocateDummyWithHeadroom(id, m.headroomFor(id)); err != nil {
		if !hadRow {
			m.mustFreeRow(id)
		}
		return fmt.Errorf("hybrid: dummy %d: %w", id, err)
	}
	return nil
}

// Free releases everything id holds: its blocks and its row (a reserved row
// is unmapped but stays reserved). An id unknown to both pools gives an
// error wrapping kvcache.ErrUnknownRequest and
// mambacache.ErrUnknownRequest.
func (m *Manager) Free(id uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.unpinLocked(id)
	kerr := m.kv.Free(id)
	merr := m.mamba.Free(id)
	if kerr != nil && merr != nil {
		return fmt.Errorf("hybrid: free %d: %w", id, errors.Join(kerr, merr))
	}
	return nil
}

// CanAdmit reports whether Prepare of a new request of tokens tokens would
// succeed now: a free real row, and the blocks it needs beyond the
// attention-DP headroom.
func (m *Manager) CanAdmit(tokens int) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if tokens < 1 {
		return false
	}
	return m.mamba.FreeRows() > 0 &&
		m.availableLocked()-m.headroomFor(admitProbeID) >= m.kv.Config().BlocksFor(tokens)
}

// Capacity returns what the scheduler may plan with: the real rows, and the
// blocks minus the one kept for the attention-DP dummy.
func (m *Manager) Capacity() (rows, blocks int) {
	blocks = m.kv.TotalBlocks()
	if m.adp {
		blocks--
	}
	return m.mamba.Capacity(), blocks
}

// Stats returns a snapshot of both pools.
func (m *Manager) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	return Stats{
		RowsFree:       m.mamba.FreeRows(),
		RowsUsed:       m.mamba.UsedRows(),
		RowsReserved:   m.mamba.ReservedRows(),
		BlocksFree:     m.kv.FreeBlocks(),
		BlocksUsed:     m.kv.UsedBlocks(),
		BlocksHeadroom: m.headroomFor(admitProbeID),
		Requests:       m.mamba.Requests(),

		BlocksCached:       m.kv.CachedBlocks(),
		BlocksSharedOnly:   m.kv.SharedOnlyBlocks(),
		BlocksAvailable:    m.availableLocked(),
		BlocksEvicted:      m.kv.Evictions(),
		CheckpointsEvicted: m.mamba.CheckpointEvictions(),
		Checkpoints:        m.mamba.Checkpoints(),
	}
}
