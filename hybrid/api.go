package hybrid

// API CONTRACT (to be implemented; signatures are fixed, bodies are not).

import (
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
)

type Config struct {
	KV    kvcache.Config
	Mamba mambacache.Config
}

// Resources a request holds.
type Resources struct {
	Row  mambacache.Row
	Runs []kvcache.Run
}

type Stats struct {
	RowsFree, RowsUsed, RowsReserved int
	BlocksFree, BlocksUsed           int
}

// Manager composes the KV block pool and the Mamba row pool. Pure: no IO, no goroutines.
type Manager struct{}

func New(cfg Config) (*Manager, error)                              { panic("unimplemented") }
func (m *Manager) KV() *kvcache.Pool                                { panic("unimplemented") }
func (m *Manager) Mamba() *mambacache.Pool                          { panic("unimplemented") }
func (m *Manager) Prepare(id uint64, tokens int) (Resources, error) { panic("unimplemented") } // row + blocks, all or nothing
func (m *Manager) Grow(id uint64, tokens int) error                 { panic("unimplemented") }
func (m *Manager) AddDummy(id uint64) error                         { panic("unimplemented") } // Mamba first, then KV
func (m *Manager) Free(id uint64) error                             { panic("unimplemented") }
func (m *Manager) CanAdmit(tokens int) bool                         { panic("unimplemented") }
func (m *Manager) Capacity() (rows, blocks int)                     { panic("unimplemented") }
func (m *Manager) Stats() Stats                                     { panic("unimplemented") }
