// Package kvcache is the paged KV block pool of the attention layers.
//
// It is a pure data structure: it owns no memory, does no IO and starts no
// goroutines. It hands out block ids and maps them to byte extents of one
// arena of Config.ArenaBytes() bytes that the caller holds (host memory, a
// GPU allocation, a registered region).
//
// # Layout
//
// The arena is block-major. With H = KVHeads, D = HeadDim, E = ElemSize,
// T = TokensPerBlock and L = Layers:
//
//	half       = H*T*D*E                   one (block, layer, K|V)
//	BlockBytes = 2*L*half
//	block b    = [b*BlockBytes, (b+1)*BlockBytes)
//	within b:    layer 0 K, layer 0 V, layer 1 K, layer 1 V, ... each [H][T][D]
//	(b, l, kv) = b*BlockBytes + (2*l+kv)*half
//	token slot s, head h of (b, l, kv) = (b, l, kv) + (h*T+s)*D*E
//
// So a Run of n contiguous blocks is one contiguous extent of
// n*BlockBytes bytes (Config.RunExtent), and a request is described to a
// transfer in O(runs), never O(blocks x layers).
//
// Within a (block, layer, K|V) the heads are outermost ([H][T][D], "HND"),
// as TensorRT-LLM's attention kernels address a block (KVBlockArray:
// [numHeads, tokensPerBlock, hiddenSizePerHead]). So a head's T slots are
// one contiguous stretch of T*D*E bytes, and a
// tensor-parallel shard's heads of a block one stretch per (layer, K|V):
// resharding between TP sizes moves head slices of kilobytes, not a few
// hundred bytes per token.
//
// # Allocation
//
// Free space is kept as maximal free extents, indexed by boundary tags (so a
// freed run merges with its free neighbours in O(1)) and by power-of-two size
// classes (so a fit is found without scanning the pool). A request of k
// blocks takes the front of a free extent of the smallest class that holds
// k (a good fit; a few extents of k's own class are examined, then the
// lowest higher class): on an idle pool that is one run starting at block 0,
// and whenever some free extent holds k the request gets one run. Only when
// no extent holds k does it take the largest extents first, giving as few
// runs as the free space allows. Grow first extends the request's last run
// in place when the next block is free.
//
// # Use
//
//  1. Build a Config (per-rank dimensions), Validate it, and New a Pool.
//  2. Allocate(id, promptTokens) for a request; Grow(id, n) as decode
//     reaches n tokens; AllocateDummy(id) for a padding dummy (one block).
//  3. Runs(id, dst) / Blocks(id, dst) describe where the request's tokens
//     live, in token order; Config.RunExtent and Config.KVExtent turn them
//     into byte extents.
//  4. Free(id) when the request ends, however it ends.
//
// Running out of blocks (ErrNoFreeBlocks) is a condition the caller's
// admission control should prevent; a failed call changes nothing. An
// out-of-range block, layer or slot passed to a Config method is a
// programming error and panics.
//
// A Pool is safe for concurrent use; every method takes its one mutex and
// calls nothing outside the package while holding it. Steady-state
// Allocate/Grow/Free do not allocate memory: per-request records are
// recycled and the free-extent index is sized once by New.
package kvcache
