// Package api serves the decode worker's OpenAI-compatible HTTP API:
//
//	POST /v1/completions  model, prompt, max_tokens, temperature, seed, stream (SSE)
//	GET  /v1/models       the served model
//
// Bad input never reaches the engine: it is answered with an OpenAI-style
// error body {"error":{"message","type","param","code"}} and a 4xx status.
// A full admission queue is 429, a draining or stopped worker 503. A client
// that disconnects cancels its request, which frees its resources.
//
// Every response carries X-Request-Id (taken from the request when it sends
// a sane one); the same id appears in every log line about the request.
// Non-streaming responses also carry the latency split in X-Handoff-*-Ms
// headers (queue, prefill, transfer, time to first token).
package api
