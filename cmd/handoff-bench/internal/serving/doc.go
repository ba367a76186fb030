// Package serving holds the pure parts of handoff-bench serve, a load
// generator for OpenAI-compatible /v1/completions endpoints that follows
// vLLM's `vllm bench serve` (vllm/benchmarks/serve.py): the arrival process,
// the random dataset, the server-sent-events parser, the metric definitions,
// the report with vLLM's JSON keys, and DistServe's SLO attainment.
//
// Nothing here does IO on its own or starts a goroutine: the caller (package
// main) sends the requests, times them and hands the per-request Results to
// Compute. Time enters as durations measured by the caller.
//
// Definitions, as vLLM states them (successful requests only):
//
//   - TTFT: from the POST to the first SSE chunk that carries choices.
//   - ITL: the gaps between consecutive such chunks, pooled over all requests.
//   - E2EL: from the POST to the last such chunk.
//   - TPOT: (E2EL - TTFT) / (output_tokens - 1), per request with more than
//     one output token; output_tokens is the server's usage.completion_tokens.
//   - duration: from the first dispatch to the last completion (warm-ups
//     excluded); every throughput divides by it.
//   - request_goodput: completed requests that meet every --goodput SLO, per
//     second; a request with at most one output token counts TPOT as 0.
//
// One deviation, stated in Chunk.Token: a chunk whose text is empty and that
// carries a finish_reason (the end marker handoff and some other servers send
// after the last token) is not counted as a token, so it adds no ITL sample
// near zero.
package serving
