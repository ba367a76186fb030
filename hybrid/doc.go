// Package hybrid composes the KV block pool (kvcache) and the Mamba row pool
// (mambacache) behind one API, as TensorRT-LLM's
// MixedMambaHybridCacheManager: a request holds one Mamba row and the KV
// blocks of its tokens.
//
// It is pure: no IO, no goroutines. A Manager is safe for concurrent use;
// its mutex is always taken before a pool's mutex, never the reverse.
//
// # Semantics
//
//   - Prepare(id, tokens) takes the row first, then the blocks; it is all or
//     nothing (a row taken by the call is given back if the blocks do not
//     fit). For an id already prepared it keeps the row and grows the
//     blocks, so it can be called every iteration.
//   - AddDummy(id) places the Mamba side first (reserved rows for the ADP
//     dummy and padding sentinels), then one KV block, and rolls the row
//     back if the block cannot be had.
//   - Free(id) releases both; reserved rows stay reserved.
//
// # Attention-DP headroom
//
// With attention DP, an idle rank must pad with the ADP dummy
// (mambacache.ADPDummyID) every iteration, even when every real row and
// block is held by requests whose cache is in transfer. The Mamba pool has a
// reserved row for it; the Manager keeps one KV block free for it: every
// allocation other than the ADP dummy's must leave one block free while the
// dummy is not placed. Capacity and CanAdmit exclude that block, and
// Stats.BlocksHeadroom reports it. AddDummy(ADPDummyID) therefore always
// succeeds with attention DP on.
//
// # Use
//
//  1. New(Config{KV: ..., Mamba: ...}).
//  2. Admit with CanAdmit(tokens) and Capacity(); Prepare admitted requests
//     (on the decode side, before the transfer starts: the row and blocks are
//     the transfer's destination).
//  3. Grow(id, n) as decode appends tokens; AddDummy for padding.
//  4. Free(id) when a request ends or its transfer fails, and every
//     iteration for the dummies.
//
// Change the pools only through the Manager; KV() and Mamba() are for
// reading extents, runs and rows.
package hybrid
