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
//  5. Pick tokens with Sample(logits, temperature, seed, step), step being the
//     index of the generated token (0 for the one drawn from Prefill's
//     logits), so that where prefill ran never changes the draw; stop at EOS or
//     a length limit. Encode/Decode convert text to byte tokens and back.
//  6. Calls that may block (a model looked up with a delay) are cancelled
//     through PrefillContext/DecodeContext.
//  7. To ship the cache while prefill still computes, prefill with
//     PrefillChunk: consecutive chunks of the prompt, each run layer by
//     layer, with a callback told of each Part of the cache as soon as it
//     is final: an attention layer's positions of the chunk once the chunk
//     passed the layer, a Mamba layer's state only once the chunk that
//     ends the prompt passed it. The executor reports only which layer
//     finished; PrefillChunk alone turns that into Parts, so no executor
//     can release a Mamba state early. The result is bit-identical to
//     Prefill's, whatever the chunks. A simulated prefill delay is spread
//     over the layers (layer i is reported after its share), so streaming
//     overlaps it as it would a real model's compute.
//
// # Models
//
// tiny-hybrid, layers "M*M-M*-" (d_model 64): Mamba2 layers (in-projection to
// z | x B C | dt, causal depthwise conv over x|B|C whose last d_conv-1 inputs
// are the conv state, h = exp(dt*A)*h + dt*B*x, y = C.h + D*x gated by
// silu(z)), GQA attention (4 query / 2 KV heads of 16, rotary positions) that
// writes each position's K/V into its block and reads every earlier position
// back from the pool, SwiGLU MLPs, RMSNorm, an LM head plus a fixed output
// bias (textPrior: English character frequencies; -Inf for every token but
// printable ASCII, newline and EOS), so its completions are printable UTF-8
// that reads like text. States are float32
// little-endian: conv [128][3] and SSM [4][16][16] per Mamba layer, so a
// flipped sign/exponent byte anywhere changes the next logits.
//
// nemotron-h-8b and qwen3-next-80b have the real cache shapes (bf16 KV, bf16
// conv, bf16 SSM unless "?ssm_dtype=fp32"; conv sections x|B|C and Q|K|V) and
// cheap fake math: Prefill hashes the prompt and fills every byte of the row
// and of the prompt's K/V with a pattern of it; Decode seeds from a CRC-32C of
// the whole row and of the K/V in the block holding the previous position,
// writes K/V and rewrites the row. Logits are a pattern of that seed, so a
// corrupted transfer changes the next token. A decode reads and writes the
// whole row (49 MiB for nemotron-h-8b, 37.7 MiB for qwen3-next-80b), as a real
// decode step does.
//
// # Draft head
//
// "?mtp=1" gives a model a draft head for speculative decoding (mtp.go):
// a DraftLayer ('+') after its layers, an attention layer whose K and V
// live in the KV pool as its last KV layer (so they travel with the
// blocks, and the Fingerprint differs from the model without it). Every
// prefill and decode step writes the layer's entry of each position it
// processes, from the token and the target's context at the position
// before; Draft reads them and chains the layer over its own drafts, in a
// scratch of the call, never writing the pools. tiny-hybrid's head ties
// its attention and MLP to the target's last ones; its tokens are the
// same as without the head. The simulated timing prices the head's passes.
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
