package hybrid

import (
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
)

// Events are the changes to a rank's prefix cache since the last take:
// cached KV blocks stored or evicted, and state checkpoints made ready or
// evicted (kvcache.CacheEvent, mambacache.StateEvent), for a router. When
// Overflow is set the journal lost track and the lists are empty: the
// consumer starts over from Snapshot.
type Events struct {
	Blocks   []kvcache.CacheEvent
	States   []mambacache.StateEvent
	Overflow bool
}

// RecordEvents starts recording the prefix cache's events in both pools,
// keeping at most max of each kind until taken (0 stops).
func (m *Manager) RecordEvents(max int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.kv.RecordEvents(max)
	m.mamba.RecordEvents(max)
}

// TakeEvents moves the events recorded since the last take into e,
// replacing what it held (its slices are reused).
func (m *Manager) TakeEvents(e *Events) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var kvOver, stOver bool
	e.Blocks, kvOver = m.kv.TakeEvents(e.Blocks[:0])
	e.States, stOver = m.mamba.TakeEvents(e.States[:0])
	e.Overflow = kvOver || stOver
	if e.Overflow {
		e.Blocks, e.States = e.Blocks[:0], e.States[:0]
	}
}

// Snapshot fills e with a stored event for everything the prefix cache
// holds now (both pools at one instant); the journals go on.
func (m *Manager) Snapshot(e *Events) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e.Blocks = m.kv.Snapshot(e.Blocks[:0])
	e.States = m.mamba.Snapshot(e.States[:0])
	e.Overflow = false
}
