package transfer

import (
	"container/list"
	"sync"

	"github.com/handoff-io/handoff/prefix"
)

// Prefix affinity: a decoder remembers which prefill instance prefilled
// each prompt, and sends a prompt that continues one (a conversation's
// next turn, another user under the same system prompt) to that instance
// first: its prefix cache holds the state at the end of the earlier
// prompt, so it computes only what is new. Other instances would compute
// the whole prompt.
//
// The cost rule (pickAffine): the instance that prefilled the longest
// remembered prefix of the prompt is chosen while it is usable (same
// layout, not draining, not reported gone, not excluded for this
// request) and has a free row (its requests in flight, counted as pick
// does, below its rows): a prefill that queues behind a full instance
// costs more time to first token than recomputing the prefix elsewhere
// for any prefix a prefill worker computes in one step. Otherwise the
// request goes where it would without affinity.
//
// A request's prompt_cache_key (transfer.Request.CacheKey) is remembered
// the same way, as one more name: a prompt whose prefixes name no
// instance goes where its key's last request was prefilled (the client
// says the two share a prefix that is not in the prompt's first grains,
// or that is shorter than one).
//
// Prompts are remembered by the names of their prefixes at every
// affinityGrain tokens (a SHA-256 chain, package prefix), each naming the
// instance that last prefilled a prompt through it, at most
// affinityEntries names (about 1,400 prompts of 3,000 tokens), least
// recently used first out. A prompt is looked up by its own prefix names,
// longest first, so a prompt that shares only a system prompt with earlier
// ones finds where one of them was prefilled (whose interval checkpoints
// hold it). An instance that no longer holds the state (it
// evicted it, or restarted) costs a recompute there, never a wrong
// answer: the prefill worker's cache checks what it serves.

const (
	affinityGrain   = 64
	affinityEntries = 1 << 16
)

type affinity struct {
	root prefix.Hash
	max  int // entries kept

	mu   sync.Mutex
	byID map[prefix.Hash]*list.Element
	lru  list.List // of affinityEntry, most recent at the front
}

type affinityEntry struct {
	name     prefix.Hash
	instance string
}

func newAffinity(fingerprint string, max int) *affinity {
	return &affinity{root: prefix.Salt("affinity|" + fingerprint), max: max, byID: map[prefix.Hash]*list.Element{}}
}

// names returns the names of tokens' prefixes at every affinityGrain.
func (a *affinity) names(tokens []int32) []prefix.Hash {
	return prefix.Chain(nil, a.root, tokens, affinityGrain)
}

// allNames returns names(tokens) and then the name of key when it is
// set.
func (a *affinity) allNames(tokens []int32, key string) []prefix.Hash {
	names := a.names(tokens)
	if key != "" {
		names = append(names, prefix.Salt("affinity key|"+key))
	}
	return names
}

// remember records that instance prefilled tokens, of the requests of
// key ("" for none).
func (a *affinity) remember(tokens []int32, key, instance string) {
	names := a.allNames(tokens, key)
	if instance == "" {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, name := range names {
		if e, ok := a.byID[name]; ok {
			e.Value = affinityEntry{name, instance}
			a.lru.MoveToFront(e)
			continue
		}
		a.byID[name] = a.lru.PushFront(affinityEntry{name, instance})
		if a.lru.Len() > a.max {
			old := a.lru.Back()
			a.lru.Remove(old)
			delete(a.byID, old.Value.(affinityEntry).name)
		}
	}
}

// lookup returns the instance that prefilled the longest remembered
// prefix of tokens, and that prefix's length in tokens; else the instance
// that prefilled key's last request, with 0; "" when neither is known.
func (a *affinity) lookup(tokens []int32, key string) (string, int) {
	names := a.names(tokens)
	a.mu.Lock()
	defer a.mu.Unlock()
	for i := len(names) - 1; i >= 0; i-- {
		if e, ok := a.byID[names[i]]; ok {
			a.lru.MoveToFront(e)
			return e.Value.(affinityEntry).instance, (i + 1) * affinityGrain
		}
	}
	if key != "" {
		if e, ok := a.byID[prefix.Salt("affinity key|"+key)]; ok {
			a.lru.MoveToFront(e)
			return e.Value.(affinityEntry).instance, 0
		}
	}
	return "", 0
}
