// Package prefix names the prefixes of a token sequence, for the prefix
// cache of the pools: a full KV block is named by a hash chain over its
// tokens and its parent's name, salted with everything that changes the
// block's bytes (the layout fingerprint).
//
// It is pure: no IO, no goroutines, no clock.
//
// # Why a hit never serves wrong bytes
//
// The pools never trust a name alone. A cached block keeps the tokens it
// was computed from and the block it continues; a lookup walks the chain
// from the first block and accepts block i only when its tokens equal the
// prompt's i-th block and its parent is the block accepted at i-1 (the
// first block has none). By induction an accepted chain holds exactly the
// prompt's tokens, whatever the hash does: a collision (two chains with one
// name) makes the second chain uncacheable, never a wrong KV hit. A Mamba
// checkpoint is found by the name of its full blocks and compares only the
// tokens past them, so for states the guarantee is SHA-256's: two prefixes
// sharing a state need a collision of it (about 2^128 work). SHA-256 is
// also what makes names safe to publish and compare across processes (the
// KV events of a router), where no tokens travel.
package prefix

import (
	"crypto/sha256"
	"encoding/binary"
)

// Hash names a prefix. It is an alias so that the pure pools, which may
// not depend on crypto, store and compare names as plain [32]byte
// (kvcache.BlockHash, mambacache.PrefixHash) without importing this package.
type Hash = [32]byte

// Salt returns the root of every chain of a cache whose bytes are described
// by fingerprint (model, TP shard, block size, dtype, layout: anything that
// changes what a block holds).
func Salt(fingerprint string) Hash {
	h := sha256.New()
	h.Write([]byte("handoff/prefix/v1\x00"))
	h.Write([]byte(fingerprint))
	var out Hash
	h.Sum(out[:0])
	return out
}

// Next returns the name of the block holding tokens after a prefix named
// parent.
func Next(parent Hash, tokens []int32) Hash {
	h := sha256.New()
	h.Write(parent[:])
	var b [4]byte
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(b[:], uint32(t))
		h.Write(b[:])
	}
	var out Hash
	h.Sum(out[:0])
	return out
}

// Chain appends to dst the names of the full blocks of tokens, tpb tokens
// each, from root: Chain[i] names tokens [0, (i+1)*tpb). A partial last
// block has no name.
func Chain(dst []Hash, root Hash, tokens []int32, tpb int) []Hash {
	parent := root
	for i := 0; (i+1)*tpb <= len(tokens); i++ {
		parent = Next(parent, tokens[i*tpb:(i+1)*tpb])
		dst = append(dst, parent)
	}
	return dst
}

// Parent returns the name of the prefix of k full blocks: root for k = 0,
// chain[k-1] otherwise.
func Parent(root Hash, chain []Hash, k int) Hash {
	if k == 0 {
		return root
	}
	return chain[k-1]
}
