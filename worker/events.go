package worker

import "github.com/handoff-io/handoff/prefix"

// PrefixRoot returns the root of the rank's block names (what its cache
// events name blocks from), and whether the rank keeps a prefix cache.
func (r *Rank) PrefixRoot() (prefix.Hash, bool) { return r.root, r.prefix }

// TokensPerBlock is the rank's KV block size in tokens.
func (r *Rank) TokensPerBlock() int { return r.kvCfg.TokensPerBlock }
