// Package worker runs a prefill or decode worker's attention-DP ranks.
//
// A worker holds --dp-size ranks (Rank). Each rank owns a hybrid cache
// manager (KV blocks plus Mamba rows) over two arenas, usually the bytes of
// registered data-plane regions, and the model executor that reads and
// writes them. The Scheduler steps all ranks in lockstep from one loop
// goroutine the caller owns (Run):
//
//  1. Apply inbox events: cancelled requests, finished cache fetches,
//     released prefill leases.
//  2. Admit queued requests in order. A request goes to a rank with a free
//     real row and enough unpromised KV blocks for its whole life (prompt
//     plus every token it may generate), so a running request never runs
//     out of blocks and the pools are never over-committed (PickRank).
//     Requests beyond the queue bound are refused (ErrQueueFull); after
//     Drain they are refused with ErrDraining.
//  3. Plan the iteration (PlanStep, pure): when any rank has schedulable
//     work, every rank takes part; a rank with none pads the attention-DP
//     dummy (request id 0) on its reserved row, runs one decode step on it,
//     and frees it at the end of the iteration. Requests whose cache is in
//     flight (decode, PhaseAwaitCache) or being pushed (prefill, PhasePush)
//     hold their rows and blocks but are not schedulable work: a rank whose
//     only real row is held by a transfer looks idle and pads, which is why
//     the dummy needs a reserved row (TensorRT-LLM PR #14853).
//  4. Step: one prefill or decode step per schedulable request, ranks in
//     parallel; then end the finished and failed requests and free their
//     resources (a failed prefill job's once its holder let go of it:
//     PhaseHeld, see PendingPrefill).
//
// The decode role serves Generate: with no CacheSource it prefills in
// process (the aggregated baseline); with one, an admitted request first
// waits for its prefilled cache (CacheSource.Fetch) and then generates. The
// prefill role serves Prefill: the returned Lease holds the cache until the
// caller has pushed it and calls Release.
//
// # Caller duties
//
//  1. Size each rank's pools with PoolConfig, build one Rank per ADP rank
//     over its manager and arenas, and one Scheduler over all of them.
//  2. Call Run once, on a goroutine the caller owns; cancel its ctx to stop.
//     Queued and running requests then fail with ErrClosed and every row
//     and block is freed (leases and fetches in flight get ReleaseGrace).
//  3. Decode: Generate per request; read the Stream (Next) to its final
//     event, or cancel the request's ctx to leave early. A stream grows
//     with the tokens generated: nothing is sized by MaxTokens before the
//     request runs. Stop sequences end a generation without emitting the
//     match (stopper); Sampling asks for top_p and logprobs.
//  4. Prefill: Prefill (or SubmitPrefill then Wait); Release the lease once
//     its cache was pushed. After SubmitPrefill, let go of a job whose Wait
//     failed with Abandon once nothing reads what its Parts named: until
//     then its blocks and row stay allocated (PendingPrefill). A
//     CacheSource must not return from Fetch while a byte can still land
//     in the destination.
//  5. To stop gracefully, Drain first (intake stops, accepted requests
//     finish), then cancel Run's ctx.
//
// Lock order: Scheduler.mu, then a manager's lock; never the reverse. No IO,
// executor call or CacheSource call runs under Scheduler.mu.
//
// Sub-packages: api (the OpenAI-compatible HTTP API), admin (liveness,
// readiness, metrics), config (flags and environment), service (wiring of
// the two binaries, NATS and the data path).
package worker
