package kvevents

import (
	"slices"

	"github.com/handoff-io/handoff/prefix"
)

// Index is a router's view of what each instance's ranks hold, built from
// their event streams. It is pure and not safe for concurrent use: its
// owner serialises Apply, Longest and Hits.
//
// A stream is trusted only while it is in sync: its first batch is a
// snapshot, and each batch after it carries the next sequence number. A
// batch that skips ahead takes the stream out of sync (Apply says which
// sequence number to replay from) until a snapshot puts it back; one that
// comes late or twice is dropped. A stream out of sync, unknown, or over
// its bounds is left out of Hits (Longest: ok false), so a router degrades to load
// alone for that instance, never to a state the instance may not hold.
type Index struct {
	// MaxBlocks and MaxStates bound what one stream may hold; a stream that
	// would hold more is dropped and must resynchronise (a flood costs its
	// routing, not the router's memory).
	MaxBlocks, MaxStates int

	streams map[streamKey]*stream
}

type streamKey struct {
	instance string
	rank     int
}

type stream struct {
	seq       uint64
	synced    bool
	root      Hash
	blockSize int
	blocks    map[Hash]block
	children  map[Hash][]Hash  // cached blocks by parent, for orphans
	states    map[Hash][]state // by parent
	nstates   int
}

// block is a cached block as the index knows it. A block whose parent
// was removed is an orphan: the rank's cache never reaches it again
// (kvcache: a block continues only the parent it was published under)
// until it is removed itself.
type block struct {
	parent    Hash
	hasParent bool
	orphan    bool
}

type state struct {
	tokens  int
	partial []int32
}

// Verdict is what Apply did with a batch.
type Verdict uint8

const (
	// Applied: the batch is part of what the index knows.
	Applied Verdict = iota
	// Stale: a batch at or before the stream's sequence, dropped.
	Stale
	// Gap: batches are missing; the stream is out of sync until a snapshot.
	// Replay from Want.
	Gap
	// Overflow: the stream would hold more than the index's bounds; it is
	// out of sync until a snapshot that fits.
	Overflow
)

// NewIndex returns an empty index with the given bounds per stream.
func NewIndex(maxBlocks, maxStates int) *Index {
	return &Index{MaxBlocks: maxBlocks, MaxStates: maxStates, streams: map[streamKey]*stream{}}
}

// Apply takes batch b of its instance's rank and returns what it did and,
// for Gap, the sequence number the stream needs next (replay from it, or
// take a snapshot).
func (x *Index) Apply(b *Batch) (v Verdict, want uint64) {
	k := streamKey{b.Instance, b.Rank}
	s := x.streams[k]
	if s == nil {
		s = &stream{}
		x.streams[k] = s
	}
	switch {
	case b.Snapshot:
		if s.synced && b.Seq < s.seq {
			return Stale, 0 // an older snapshot than what the stream applied
		}
		*s = stream{seq: b.Seq, synced: true, root: b.Root}
	case !s.synced:
		return Gap, s.seq + 1
	case b.Seq <= s.seq:
		return Stale, 0
	case b.Seq > s.seq+1 || b.Root != s.root:
		s.synced = false
		return Gap, s.seq + 1
	default:
		s.seq = b.Seq
	}
	for i := range b.Events {
		if !s.apply(&b.Events[i]) || len(s.blocks) > x.MaxBlocks || s.nstates > x.MaxStates {
			*s = stream{seq: b.Seq}
			return Overflow, 0
		}
	}
	return Applied, 0
}

// apply applies one event; false when it contradicts the stream (a block
// size that changed).
func (s *stream) apply(e *Event) bool {
	if s.blocks == nil {
		s.blocks, s.children, s.states = map[Hash]block{}, map[Hash][]Hash{}, map[Hash][]state{}
	}
	switch e.Kind {
	case BlockStored:
		if s.blockSize != 0 && e.BlockSize != s.blockSize {
			return false
		}
		s.blockSize = e.BlockSize
		parent, has := e.Parent, e.HasParent
		for _, h := range e.Hashes {
			orphan := false
			if has {
				p, ok := s.blocks[parent]
				orphan = !ok || p.orphan
				s.children[parent] = append(s.children[parent], h)
			}
			s.blocks[h] = block{parent: parent, hasParent: has, orphan: orphan}
			parent, has = h, true
		}
	case BlockRemoved:
		for _, h := range e.Hashes {
			b, ok := s.blocks[h]
			if !ok {
				continue
			}
			delete(s.blocks, h)
			if b.hasParent {
				kids := slices.DeleteFunc(s.children[b.parent], func(c Hash) bool { return c == h })
				if len(kids) == 0 {
					delete(s.children, b.parent)
				} else {
					s.children[b.parent] = kids
				}
			}
			s.orphan(h)
		}
	case AllBlocksCleared:
		clear(s.blocks)
		clear(s.children)
		clear(s.states)
		s.nstates = 0
	case StateStored:
		for _, st := range s.states[e.Parent] {
			if st.tokens == e.NumTokens && slices.Equal(st.partial, e.Tokens) {
				return true
			}
		}
		s.states[e.Parent] = append(s.states[e.Parent], state{tokens: e.NumTokens, partial: e.Tokens})
		s.nstates++
	case StateRemoved:
		list := s.states[e.Parent]
		for i, st := range list {
			if st.tokens == e.NumTokens && slices.Equal(st.partial, e.Tokens) {
				list = slices.Delete(list, i, i+1)
				s.nstates--
				break
			}
		}
		if len(list) == 0 {
			delete(s.states, e.Parent)
		} else {
			s.states[e.Parent] = list
		}
	}
	return true
}

// orphan marks the descendants of removed block h orphans.
func (s *stream) orphan(h Hash) {
	for _, c := range s.children[h] {
		if b, ok := s.blocks[c]; ok && !b.orphan {
			b.orphan = true
			s.blocks[c] = b
			s.orphan(c)
		}
	}
}

// Forget drops everything known of instance (it left the registry).
func (x *Index) Forget(instance string) {
	for k := range x.streams {
		if k.instance == instance {
			delete(x.streams, k)
		}
	}
}

// Longest returns the longest prefix of tokens that one of instance's
// ranks can resume from (the prefix cache's hit: hybrid.Manager.Lookup):
// the largest L < len(tokens) with a state after exactly L tokens and
// every full block before it cached. ok is false when the index cannot
// tell: no stream of the instance, or one out of sync.
func (x *Index) Longest(instance string, tokens []int32) (L int, ok bool) {
	L, ok = x.hits(tokens, instance)[instance]
	return L, ok
}

// Hits returns Longest for every instance the index can tell about (those
// it cannot are absent), naming tokens' blocks once per chain root.
func (x *Index) Hits(tokens []int32) map[string]int {
	return x.hits(tokens, "")
}

// hits is Hits, for only instance when it is not empty.
func (x *Index) hits(tokens []int32, only string) map[string]int {
	out := map[string]int{}
	bad := map[string]bool{}
	type chainKey struct {
		root Hash
		bs   int
	}
	chains := map[chainKey][]Hash{}
	for k, s := range x.streams {
		if only != "" && k.instance != only || bad[k.instance] {
			continue
		}
		if !s.synced {
			bad[k.instance] = true
			delete(out, k.instance)
			continue
		}
		ck := chainKey{s.root, s.blockSize}
		chain, ok := chains[ck]
		if !ok {
			chain = s.chain(nil, tokens)
			chains[ck] = chain
		}
		out[k.instance] = max(out[k.instance], s.longest(chain, tokens))
	}
	return out
}

// chain names tokens' full blocks as the stream's rank does.
func (s *stream) chain(dst []Hash, tokens []int32) []Hash {
	if s.blockSize == 0 {
		return dst
	}
	return prefix.Chain(dst, s.root, tokens, s.blockSize)
}

func (s *stream) longest(chain []Hash, tokens []int32) int {
	n := len(tokens)
	k := 0
	for k < len(chain) {
		if b, ok := s.blocks[chain[k]]; !ok || b.orphan {
			break
		}
		k++
	}
	tpb := s.blockSize
	for j := k; j >= 0; j-- {
		parent := s.root
		if j > 0 {
			parent = chain[j-1]
		}
		best := 0
		for _, st := range s.states[parent] {
			p := len(st.partial)
			lo := j * tpb
			if st.tokens != lo+p || (tpb > 0 && p >= tpb) || lo+p >= n {
				continue
			}
			if slices.Equal(st.partial, tokens[lo:lo+p]) {
				best = max(best, st.tokens)
			}
		}
		if best > 0 {
			return best
		}
	}
	return 0
}
