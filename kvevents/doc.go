// Package kvevents is the vocabulary of cache events: what a worker's
// prefix cache holds, published as it changes so that a router can send a
// prompt where its longest cached state lives. It is pure: the batches,
// their encoding, and the Index a router keeps of every instance's
// holdings; workers publish and decoders subscribe over NATS in package
// transfer.
//
// # The wire format
//
// A batch is vLLM's KV event batch (vllm/distributed/kv_events.py), so that
// consumers of that format (Dynamo's KV router, llm-d's kv-cache indexer)
// read handoff's blocks unchanged: msgpack, array-like, tagged events.
//
//	EventBatch  [ts, events, data_parallel_rank, seq, instance, root, snapshot]
//	BlockStored ["BlockStored", block_hashes, parent_block_hash, token_ids,
//	             block_size, lora_id, medium, lora_name, extra_keys,
//	             group_idx, kv_cache_spec_kind]
//	BlockRemoved ["BlockRemoved", block_hashes, medium, group_idx]
//	AllBlocksCleared ["AllBlocksCleared"]
//
// Block hashes are the prefix cache's own 32-byte names (package prefix:
// SHA-256 chained over each block's tokens from a root that salts the
// layout), sent as msgpack bin, which vLLM's ExternalBlockHash (bytes |
// int) admits. The fields after data_parallel_rank are handoff's:
// consumers that know only vLLM's three ignore them. seq numbers the
// batches of an instance's rank with no gap (each data-parallel rank has a
// cache, and a stream, of its own); root is the root of the chain
// (a router needs it to name a prompt's blocks as the worker does); a
// snapshot batch replaces everything known of the instance.
//
// Two event kinds are new, for the state of recurrent (Mamba) layers, which
// vLLM's schema cannot say (a KV hit is worthless to a hybrid model without
// the state at exactly its end):
//
//	StateStored  ["StateStored", prefix_hash, parent_block_hash, token_ids,
//	              num_tokens, group_idx, kv_cache_spec_kind, medium]
//	StateRemoved ["StateRemoved", ...the same fields]
//
// A state after exactly num_tokens tokens: parent_block_hash names its full
// blocks, token_ids are the tokens after them (fewer than a block), and
// prefix_hash names the exact prefix (prefix.Next of the two, or the parent
// itself when token_ids is empty). kv_cache_spec_kind is "mamba".
//
// Decoders refuse a malformed batch with ErrBadBatch and ignore fields they
// do not know at the end of an array (a later revision may add some).
package kvevents
