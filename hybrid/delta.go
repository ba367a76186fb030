package hybrid

import (
	"fmt"

	"github.com/handoff-io/handoff/kvcache"
)

// Shared blocks without a state: a decode worker that receives a prompt's
// state from a prefill worker (a delta handoff) shares the leading blocks
// its cache holds, and receives only the blocks after them and the row.

// LookupBlocks returns the leading full blocks of p that the KV cache
// holds, at most max, as a Hit with no state (Tokens 0): Shared, and Unheld
// of them that no request holds now. It changes nothing.
func (m *Manager) LookupBlocks(p Prompt, max int) Hit {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.lookupBlocks(p, max)
}

func (m *Manager) lookupBlocks(p Prompt, max int) Hit {
	k := min(m.kv.Match(p.Chain, p.Tokens), max)
	if k <= 0 {
		return Hit{}
	}
	return Hit{Shared: k, Unheld: m.kv.Unheld(p.Chain, p.Tokens, k)}
}

// PrepareShared is Prepare for a request of tokens tokens that shares the
// h.Shared leading blocks of p that LookupBlocks found (nothing changed
// since), read-only, and holds the rest of its room and a real row of its
// own, which something else fills. Errors: ErrStaleHit, and Prepare's.
func (m *Manager) PrepareShared(id uint64, p Prompt, tokens int, h Hit, dst []kvcache.Run) (Resources, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if now := m.lookupBlocks(p, h.Shared); now != h || h.Shared == 0 || h.Tokens != 0 {
		return Resources{}, fmt.Errorf("%w: request %d: %+v, the cache now holds %+v", ErrStaleHit, id, h, now)
	}
	if tokens <= h.Shared*m.kv.Config().TokensPerBlock {
		return Resources{}, fmt.Errorf("hybrid: prepare %d: %w: %d tokens, %d shared blocks", id, kvcache.ErrInvalidTokens, tokens, h.Shared)
	}
	row, err := m.mamba.Allocate(id)
	if err != nil {
		return Resources{}, fmt.Errorf("hybrid: prepare %d: %w", id, err)
	}
	headroom := m.headroomFor(id)
	// Holding the unheld shared blocks takes them out of the evictable
	// ones: room for them as well as for the own blocks.
	m.makeKVRoom(m.kv.Config().BlocksFor(tokens)-h.Shared+h.Unheld, headroom)
	if err := m.kv.AllocateShared(id, p.Chain, p.Tokens, h.Shared, tokens, headroom); err != nil {
		m.mustFreeRow(id)
		return Resources{}, fmt.Errorf("hybrid: prepare %d: %w", id, err)
	}
	runs, err := m.kv.Runs(id, dst)
	if err != nil {
		panic(fmt.Sprintf("hybrid: blocks of %d vanished: %v", id, err))
	}
	return Resources{Row: row, Runs: runs}, nil
}
