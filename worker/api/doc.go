// Package api serves the decode worker's OpenAI-compatible HTTP API:
//
//	POST /v1/completions       see below
//	POST /v1/chat/completions  see below
//	GET  /v1/models            the served model
//
// Every parameter of OpenAI's completions API is served or refused by name:
//
//	model, prompt           a string, an array of one string, or an array of token ids
//	max_tokens, seed        as OpenAI; temperature 0..2
//	top_p                   nucleus sampling (0: the most likely token alone)
//	stop                    up to 4 strings; generation ends at the first match,
//	                        whose text is never sent (a stream holds back text
//	                        that may begin a match); finish_reason "stop"
//	echo                    the prompt before the completion
//	logprobs                0..5: each token's log probability (log-softmax at
//	                        temperature 1) and that many alternatives; not with echo
//	stream, stream_options  SSE; include_usage adds a last chunk with the usage
//	n, best_of              1 only; presence_penalty, frequency_penalty: 0 only;
//	logit_bias              empty only; suffix: empty only; user: logged
//	prompt_cache_key        a string of at most 64 characters naming the
//	                        requests that share a prefix: logged (the prefix
//	                        cache matches tokens, whatever the key)
//
// The usage (in a plain response, and in a stream's last chunk, which has
// no choices, with include_usage only: the other chunks say null) is
// OpenAI's: prompt_tokens,
// completion_tokens, total_tokens and prompt_tokens_details.cached_tokens,
// the prompt tokens a prefix cache served instead of computing them
// (worker.Output.Cached); chat completions add audio_tokens 0 there, as
// OpenAI's do. completion_tokens_details is left out (nothing to detail).
//
// Chat completions share every parameter above but prompt, echo, best_of,
// suffix and logprobs, and add:
//
//	messages               system, developer (as system), user, assistant;
//	                       content a string or text parts; name
//	max_completion_tokens  as max_tokens (both must agree; 16 when neither is
//	                       given, as for completions: every token a request
//	                       may generate is reserved at admission)
//	logprobs, top_logprobs true and 0..20
//	stream                 SSE deltas: the role first, then content (never a
//	                       split character), then finish_reason
//
// and refuse tools, functions, tool/function messages, non-text parts,
// response_format other than text, audio, prediction, reasoning_effort,
// verbosity, web_search_options, store=true and metadata by name; the
// tool_choice/function_call "none"/"auto", parallel_tool_calls and
// service_tier auto/default change nothing and are taken; safety_identifier
// is logged as user. The chat template (chatPrompt) renders each message as
//
//	<|role|>\n{content}\n          (<|role:name|> with a name)
//
// and ends with "<|assistant|>\n": a chat completion is the completion of
// that prompt, token for token.
//
// A refused value is 400 unsupported_value naming the parameter; a key
// that is not a parameter (in any other case, too) is 400
// unknown_parameter. The body is decoded strictly: one JSON object, each
// key once and exactly as spelled, nothing after it (params.go: one table-
// driven decoder for every endpoint).
//
// Bad input never reaches the scheduler: it is answered with an OpenAI-style
// error body {"error":{"message","type","param","code"}} and a 4xx status.
// A full admission queue is 429, a draining or stopped worker 503 (whatever
// phase a request is in when the worker stops), as is a request no prefill
// worker took (prefill_unavailable) or the prefill workers failed with the
// retries spent (prefill_failed); both carry Retry-After. A
// 429's is the queue's expected wait (QueueWaiter: the requests queued times
// the recent interval between admissions), rounded up to whole seconds,
// 1..60; a 503's is 1 (retried through a load balancer it reaches another
// worker). A client that disconnects
// cancels its request, which frees its resources; so does a client that
// stops reading: each response write must complete within
// Config.WriteTimeout (--write-timeout), else the response is cut.
//
// Every response carries X-Request-Id (taken from the request when it sends
// a sane one); the same id appears in every log line about the request.
// Non-streaming responses also carry the latency split in X-Handoff-*-Ms
// headers (queue, prefill, transfer, time to first token).
package api
