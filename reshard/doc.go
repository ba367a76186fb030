// Package reshard computes how a request's cache moves between tensor-
// parallel groups of different sizes: from a TP-P prefill group to a TP-D
// decode group, which bytes of which prefill shard's KV block or Mamba row
// go where in which decode shard's.
//
// It is pure: no IO, no goroutines, no clock. A Plan is computed once per
// (layout, P, D), at the handshake, and reused for every request.
//
// # Units, rows and sections
//
// A unit is what a pool stores back to back in its arena: a KV block
// (kvcache) or a Mamba state row (mambacache). Both are Rows rows of the
// same shape, and each row is a concatenation of sections, each a sequence
// of items split across shards (Layout):
//
//	KV block:   2·L rows (layer 0 K, layer 0 V, layer 1 K, ...)
//	            row = kv [KVHeads items of T·HeadDim·ElemSize]
//	Mamba row:  L rows (one per Mamba layer)
//	  Mamba2    row = x [Heads items of HeadDim·(DConv-1)·ConvElemSize]
//	                | B [NGroups items of DState·(DConv-1)·ConvElemSize]
//	                | C [NGroups items, as B]
//	                | ssm [Heads items of HeadDim·DState·SSMElemSize]
//	  GDN       row = Q [groups] | K [groups] | V [heads] | ssm [heads]
//
// This is exactly kvcache's block layout ([H][T][D] per layer and K|V) and
// mambacache's row layout (conv [conv_dim][DConv-1] in section order, then
// ssm [H][HeadDim][DState], per layer), read as rows: a conv channel is
// DConv-1 contiguous elements, so a head's or a group's channels are one
// contiguous stretch of its section, and a KV head's slots are one
// contiguous stretch of its layer's K or V: a shard's part of a row is one
// copy of kilobytes, never one per token.
//
// # What a shard holds
//
// A shard of a TP-T group holds what it would hold on its own GPU: of
// every section, the items it owns, packed from the section's start, in
// the same row order. So its unit is the pool layout of the shard's own
// Config (KVShard: KVHeads/T heads; MambaShard: Heads/T heads and NGroups/T
// groups), and its section offsets in a Mamba row are those of
// mambacache.Config.ConvExtent for that config: x at 0, B at Heads/T·HeadDim
// channels, C after B's local groups.
//
// Shard r owns items [r·n/T, (r+1)·n/T) of an n-item section when T divides
// n. KV heads and groups may be replicated instead: when T is a multiple of
// n, shard r holds the one item ⌊r·n/T⌋ (so its B section is one group,
// DState channels, not NGroups/T·DState: the offset vLLM #55208 gets
// wrong). Mamba heads are never replicated. Any other shape is refused by
// name (ErrIndivisible): P and D need only each split every dimension, so
// P=4 → D=6 works where the dimensions divide both; nothing requires powers
// of two or an integer ratio.
//
// # Who writes which byte
//
// Exactly one source shard writes each destination byte. Item i of a
// section is written by the source shard that owns it when P divides n.
// When items are replicated at P, item i has P/n replicas, shards
// i·P/n + k, and destination shard rd takes it from replica k = rd mod P/n
// alone: the other replicas write nothing of it there (SGLang has every
// replica write; vLLM PR #55306 picks one writer). The choice spreads the
// destinations over the replicas and makes a plan with P = D the identity,
// each shard writing its whole unit into its mirror. Every destination
// shard holding an item receives it, so an item replicated at D is written
// once into each replica, never twice into one.
//
// For a pair (source rs, destination rd) and a section, the items moved are
// those rs writes intersected with those rd holds: one contiguous range, so
// one Copy, repeated over the rows at the two shards' row strides. Copies
// that continue each other on both sides merge (x|B|C|ssm of a 1→1 plan is
// one copy of the whole unit). A plan therefore has at most
// len(Sections)·(P+D-1) copies, whatever the model's size: the descriptors
// of a transfer are O(sections × shards), and a run of n consecutive blocks
// is the same copies with n times the count (Copy.Repeat), so O(runs ×
// sections × shards) for a request.
//
// # Use
//
//  1. At the handshake, after both sides agree on the model's (TP 1) shapes:
//     New(KV(kv), P, D) and New(Mamba(m), P, D). An error names the
//     dimension that does not split; refuse the peer with it before any
//     byte moves. Both sides must use the same TokensPerBlock: KV(kv)
//     describes both, and Align pairs blocks one to one (no reblocking).
//  2. Build each shard's pools from KVShard / MambaShard: their arenas then
//     have the unit layout the plan addresses.
//  3. Per request, prefill shard rs writes into each decode shard rd the
//     Copies(rs, rd) of its Mamba row (offsets relative to the two rows'
//     extents) and, for its KV blocks, for every Stretch of Align(its
//     runs, rd's runs), the copies Repeat(Len), offsets relative to
//     Src·SrcBytes and Dst·DstBytes. Apply performs copies in host memory;
//     Copy.Pieces lists them as contiguous byte ranges for a data path.
//
// docs/resharding.md describes the transfer built on it: who writes what,
// the grants, and how the manifest check proves that every destination
// byte was written exactly once.
package reshard
