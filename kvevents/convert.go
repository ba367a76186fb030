package kvevents

import (
	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/prefix"
)

// FromCache appends to dst the events describing e, a take of a rank's
// prefix cache (hybrid.Manager.TakeEvents or Snapshot) whose blocks hold
// blockSize tokens each, in medium: every block event first, then every
// state event. A snapshot is preceded by AllBlocksCleared.
func FromCache(dst []Event, e *hybrid.Events, blockSize int, medium string, snapshot bool) []Event {
	if snapshot {
		dst = append(dst, Event{Kind: AllBlocksCleared})
	}
	for i := range e.Blocks {
		b := &e.Blocks[i]
		if b.Stored {
			dst = append(dst, Event{Kind: BlockStored, Hashes: []Hash{b.Hash}, Parent: b.Parent, HasParent: b.HasParent,
				Tokens: b.Tokens, BlockSize: blockSize, Medium: medium})
			continue
		}
		// Consecutive removals go as one event.
		if n := len(dst); n > 0 && dst[n-1].Kind == BlockRemoved {
			dst[n-1].Hashes = append(dst[n-1].Hashes, b.Hash)
			continue
		}
		dst = append(dst, Event{Kind: BlockRemoved, Hashes: []Hash{b.Hash}, Medium: medium})
	}
	for i := range e.States {
		s := &e.States[i]
		k := StateRemoved
		if s.Stored {
			k = StateStored
		}
		ph := s.Parent
		if len(s.Partial) > 0 {
			ph = prefix.Next(s.Parent, s.Partial)
		}
		dst = append(dst, Event{Kind: k, PrefixHash: ph, Parent: s.Parent, HasParent: true, Tokens: s.Partial,
			NumTokens: s.Tokens, Medium: medium})
	}
	return dst
}
