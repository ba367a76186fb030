package hybrid

import (
	"errors"
	"fmt"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
)

// The prefix cache of a rank: content-addressed KV blocks (kvcache) and
// exact-length state checkpoints (mambacache), composed.
//
// A checkpoint after L tokens is its checkpoint row and, when L is not a
// multiple of the block size, one KV block holding the tokens of the
// unfinished block at L (its tail), held in the KV pool under the holder
// id TailID(row). A hit is the longest L < len(prompt) for which the KV
// blocks of [0, L) and a checkpoint at exactly L both exist: the request
// shares the full blocks, copies the checkpoint row into its own row and
// the tail into its own block (copy on read: a cached row or block is
// never written again), and computes only [L, n). At least one token is
// always computed, since the logits of the prompt's last token are
// needed: a prompt equal to a cached prefix of n tokens hits the longest
// checkpoint at n-1 or before (an earlier turn's end, or an interval
// checkpoint), not the one at n, whose state has absorbed the last token
// already and cannot give its logits.

// Prompt is what the cache needs to know of a prompt: its tokens, the
// root of its names (prefix.Salt of the layout) and the names of its full
// blocks (prefix.Chain).
type Prompt struct {
	Tokens []int32
	Root   mambacache.PrefixHash
	Chain  []kvcache.BlockHash
}

// prefixParent names the first full blocks of p (its root for none).
func prefixParent(p Prompt, full int) mambacache.PrefixHash {
	if full == 0 {
		return p.Root
	}
	return p.Chain[full-1]
}

// Hit is where a prompt's cached prefix lives.
type Hit struct {
	// Tokens is L, the prompt tokens the request does not compute (0: a miss).
	Tokens int
	// Shared is the number of full cached blocks the request shares;
	// Unheld of them no request holds now (sharing them makes them
	// unevictable: see Stats.BlocksSharedOnly).
	Shared, Unheld int
	// Row is the checkpoint row holding the state after L tokens.
	Row mambacache.Row
	// Tail, when HasTail, is the block holding tokens [Shared*T, L): the
	// request copies it into its own block Shared.
	Tail    kvcache.BlockID
	HasTail bool
}

// tailBase is the first KV holder id of checkpoint tails: far above any
// request id a scheduler hands out, below the padding sentinels.
const tailBase = uint64(1) << 62

// TailID is the KV holder id of the tail block of checkpoint row r.
func TailID(r mambacache.Row) uint64 { return tailBase + uint64(r) }

// ErrStaleHit is returned by PrepareHit when the hit it was given is no
// longer what the cache holds.
var ErrStaleHit = errors.New("hybrid: stale prefix hit")

// Lookup returns the longest hit for p, or a zero Hit. It changes nothing.
func (m *Manager) Lookup(p Prompt) Hit {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.lookup(p)
}

func (m *Manager) lookup(p Prompt) Hit {
	n := len(p.Tokens)
	if m.mamba.Config().CheckpointRows == 0 || n < 2 {
		return Hit{}
	}
	tpb := m.kv.Config().TokensPerBlock
	k := m.kv.Match(p.Chain, p.Tokens)
	for j := k; j >= 0; j-- {
		maxPartial := min(tpb-1, n-1-j*tpb)
		if maxPartial < 0 {
			continue
		}
		row, partial, ok := m.mamba.FindCheckpoint(prefixParent(p, j), p.Tokens[j*tpb:], maxPartial)
		if !ok {
			continue
		}
		h := Hit{Tokens: j*tpb + partial, Shared: j, Unheld: m.kv.Unheld(p.Chain, p.Tokens, j), Row: row}
		if j*tpb+partial == 0 {
			return Hit{} // the empty prefix: nothing to reuse
		}
		if partial > 0 {
			bs, err := m.kv.Blocks(TailID(row), nil)
			if err != nil || len(bs) != 1 {
				panic(fmt.Sprintf("hybrid: checkpoint row %d lost its tail block: %v", row, err))
			}
			h.Tail, h.HasTail = bs[0], true
		}
		return h
	}
	return Hit{}
}

// PrepareHit is Prepare for a request whose prompt p hit h (Lookup, with
// nothing changed since): it shares h's blocks, allocates the rest of room
// for tokens tokens and a real row, and pins h's checkpoint until
// HitCopied or Free. The caller then copies the checkpoint row into the
// request's row, and the tail (when h.HasTail) into the request's block
// h.Shared, before computing from h.Tokens. Errors: ErrStaleHit, and
// Prepare's.
func (m *Manager) PrepareHit(id uint64, p Prompt, tokens int, h Hit, dst []kvcache.Run) (Resources, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if now := m.lookup(p); now != h || h.Tokens == 0 {
		return Resources{}, fmt.Errorf("%w: request %d: %+v, the cache now holds %+v", ErrStaleHit, id, h, now)
	}
	if tokens <= h.Tokens {
		return Resources{}, fmt.Errorf("hybrid: prepare %d: %w: %d tokens, %d cached", id, kvcache.ErrInvalidTokens, tokens, h.Tokens)
	}
	if err := m.mamba.PinCheckpoint(h.Row); err != nil {
		return Resources{}, fmt.Errorf("hybrid: prepare %d: %w", id, err)
	}
	row, err := m.mamba.Allocate(id)
	if err == nil {
		headroom := m.headroomFor(id)
		// Holding the unheld shared blocks takes them out of the
		// evictable ones: room for them as well as for the own blocks.
		m.makeKVRoom(m.kv.Config().BlocksFor(tokens)-h.Shared+h.Unheld, headroom)
		err = m.kv.AllocateShared(id, p.Chain, p.Tokens, h.Shared, tokens, headroom)
		if err != nil {
			m.mustFreeRow(id)
		}
	}
	if err != nil {
		if uerr := m.mamba.UnpinCheckpoint(h.Row); uerr != nil {
			panic(fmt.Sprintf("hybrid: unpin after a failed prepare: %v", uerr))
		}
		return Resources{}, fmt.Errorf("hybrid: prepare %d: %w", id, err)
	}
	if m.copying == nil {
		m.copying = map[uint64]mambacache.Row{}
	}
	m.copying[id] = h.Row
	runs, err := m.kv.Runs(id, dst)
	if err != nil {
		panic(fmt.Sprintf("hybrid: blocks of %d vanished: %v", id, err))
	}
	return Resources{Row: row, Runs: runs}, nil
}

// HitCopied unpins the checkpoint request id copied from (PrepareHit).
// It is a no-op for a request that holds no pin.
func (m *Manager) HitCopied(id uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.unpinLocked(id)
}

func (m *Manager) unpinLocked(id uint64) {
	row, ok := m.copying[id]
	if !ok {
		return
	}
	delete(m.copying, id)
	if err := m.mamba.UnpinCheckpoint(row); err != nil {
		panic(fmt.Sprintf("hybrid: unpin checkpoint %d of %d: %v", row, id, err))
	}
}

// Publish makes request id's computed full blocks cached (kvcache.Pool.Publish)
// and returns how many of its blocks are. p.Tokens are the tokens its
// cache holds, p.Chain their names.
func (m *Manager) Publish(id uint64, p Prompt) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, err := m.kv.Publish(id, p.Chain, p.Tokens)
	if err != nil {
		return 0, fmt.Errorf("hybrid: publish %d: %w", id, err)
	}
	return n, nil
}

// Checkpoint is a checkpoint being filled: its row and, for a length that
// is not a multiple of the block size, its tail block.
type Checkpoint struct {
	Row     mambacache.Row
	Tail    kvcache.BlockID
	HasTail bool
}

// HasCheckpoint reports whether a ready checkpoint after exactly tokens
// tokens of p exists, so a caller need not copy a state that is cached
// already (and evict another checkpoint to make room for the copy).
func (m *Manager) HasCheckpoint(p Prompt, tokens int) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	tpb := m.kv.Config().TokensPerBlock
	full := tokens / tpb
	if m.mamba.Config().CheckpointRows == 0 || tokens < 1 || tokens > len(p.Tokens) || full > len(p.Chain) {
		return false
	}
	rest := p.Tokens[full*tpb : tokens]
	_, n, ok := m.mamba.FindCheckpoint(prefixParent(p, full), rest, len(rest))
	return ok && n == len(rest)
}

// BeginCheckpoint takes a checkpoint row to fill (evicting the oldest
// unpinned checkpoint when none is free) and, when withTail, a KV block
// for the tail (evicting cached blocks or other checkpoints' tails for
// room). A tail never takes a block a running request was promised: an
// unpinned checkpoint's tail is evictable, and every allocation evicts one
// before it refuses (makeKVRoom); the caller's admission counts a pinned
// tail in the pinning request's promise. The caller copies the state row
// (and the unfinished block) in, then calls EndCheckpoint or
// AbortCheckpoint, with no allocation on this manager in between. Errors
// wrap mambacache.ErrNoCheckpointRow or kvcache.ErrNoFreeBlocks.
func (m *Manager) BeginCheckpoint(withTail bool) (Checkpoint, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	row, evicted, err := m.mamba.NewCheckpoint()
	if err != nil {
		return Checkpoint{}, fmt.Errorf("hybrid: checkpoint: %w", err)
	}
	if evicted {
		m.freeTail(row)
	}
	ck := Checkpoint{Row: row}
	if !withTail {
		return ck, nil
	}
	headroom := m.headroomFor(admitProbeID)
	m.makeKVRoom(1, headroom)
	if err := m.kv.AllocateWithHeadroom(TailID(row), 1, headroom); err != nil {
		m.mustAbort(row)
		return Checkpoint{}, fmt.Errorf("hybrid: checkpoint tail: %w", err)
	}
	bs, err := m.kv.Blocks(TailID(row), nil)
	if err != nil || len(bs) != 1 {
		panic(fmt.Sprintf("hybrid: tail of checkpoint %d: %v", row, err))
	}
	ck.Tail, ck.HasTail = bs[0], true
	return ck, nil
}

// EndCheckpoint makes ck the ready checkpoint after tokens tokens of p
// (p.Tokens holds at least that many): named by its full blocks and the
// tokens after them. A checkpoint of that prefix that exists already wins
// and ck is let go.
func (m *Manager) EndCheckpoint(ck Checkpoint, p Prompt, tokens int) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	tpb := m.kv.Config().TokensPerBlock
	full := tokens / tpb
	if tokens > len(p.Tokens) || full > len(p.Chain) || ck.HasTail != (tokens%tpb != 0) {
		m.abortLocked(ck)
		return fmt.Errorf("hybrid: checkpoint at %d of a %d-token prompt (%d names), tail %v: %w",
			tokens, len(p.Tokens), len(p.Chain), ck.HasTail, kvcache.ErrInvalidTokens)
	}
	dup, err := m.mamba.FillCheckpoint(ck.Row, prefixParent(p, full), p.Tokens[full*tpb:tokens], tokens)
	if err != nil {
		return fmt.Errorf("hybrid: checkpoint: %w", err)
	}
	if dup {
		m.freeTail(ck.Row)
	}
	return nil
}

// AbortCheckpoint lets go of a checkpoint BeginCheckpoint took.
func (m *Manager) AbortCheckpoint(ck Checkpoint) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.abortLocked(ck)
}

func (m *Manager) abortLocked(ck Checkpoint) {
	m.freeTail(ck.Row)
	m.mustAbort(ck.Row)
}

func (m *Manager) mustAbort(row mambacache.Row) {
	if err := m.mamba.AbortCheckpoint(row); err != nil {
		panic(fmt.Sprintf("hybrid: abort checkpoint %d: %v", row, err))
	}
}

func (m *Manager) freeTail(row mambacache.Row) {
	if held, _ := m.kv.Has(TailID(row)); held {
		if err := m.kv.Free(TailID(row)); err != nil {
			panic(fmt.Sprintf("hybrid: free tail of %d: %v", row, err))
		}
	}
}

// makeKVRoom evicts checkpoints that hold a tail block, oldest first,
// while the KV pool cannot give need blocks beyond headroom from its free
// and evictable blocks: a cached state never makes the pool refuse.
func (m *Manager) makeKVRoom(need, headroom int) {
	for m.kv.AvailableBlocks()-headroom < need {
		row, ok := m.mamba.EvictCheckpoint(true)
		if !ok {
			return
		}
		m.freeTail(row)
	}
}

// availableLocked is what an allocation may take: free and evictable
// blocks, and the tails of evictable checkpoints.
func (m *Manager) availableLocked() int {
	_, tails := m.mamba.EvictableCheckpoints()
	return m.kv.AvailableBlocks() + tails
}
