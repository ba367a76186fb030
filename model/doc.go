// Package model holds the executors that fill and read a request's caches:
// tiny-hybrid, a small deterministic hybrid model with real math whose whole
// state lives in the pools, and synthetic presets with real models' cache
// shapes (nemotron-h-8b, qwen3-next-80b) for benchmarks and fault windows.
//
// # Caller's duties
//
//  1. Look an executor up by name (Lookup; options ride on the name as a URL
//     query, e.g. "nemotron-h-8b?delay=2ms"). Spec() gives the cache shapes.
//  2. Build the pools from the Spec: copy Spec.KV and set Blocks (or
//     ByteBudget), copy Spec.Mamba and set MaxBatchSize, AttentionDP, PPSize.
//     TokensPerBlock may be overridden; compute Fingerprint on the Spec with
//     the overrides applied and exchange it with the peer.
//  3. For each request hand the executor a Cache: both arenas, both pool
//     configs, the request's blocks in token order (enough for every position
//     the call touches) and its Mamba row.
//  4. Prefill(prompt) writes positions [0, n) and returns the logits of token
//     n; then Decode(token, n), Decode(token', n+1), ... Positions must be
//     consecutive: a Decode at pos reads the state of [0, pos) from the cache.
//  5. Pick tokens with Sample; stop at EOS or a length limit. Encode/Decode
//     convert text to byte tokens and back.
//
// Executors start no goroutines and keep no per-request state: distinct
// caches may be used concurrently. A call with a bad argument returns an error
// wrapping one of the package's sentinels and leaves the cache untouched
// (cache validation happens before any write).
//
// # Determinism
//
// Weights come from a fixed splitmix64 seed, the kernels round every product
// explicitly so no multiply-add is fused, and tiny-hybrid's Prefill runs the
// same per-position step as Decode: prefill(n) then decode(t, n) gives
// bit-identical logits and cache bytes to prefill(n+1).
package model
