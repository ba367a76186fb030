package worker

import "errors"

// Sentinel errors of the worker. Callers match them with errors.Is.
var (
	// ErrInvalidConfig is returned by NewScheduler, NewRank and PoolConfig for
	// a configuration that cannot work.
	ErrInvalidConfig = errors.New("worker: invalid config")
	// ErrInvalidRequest is returned by Generate and Prefill for an empty
	// prompt, a token budget ≤ 0 or an out-of-range sampling parameter.
	ErrInvalidRequest = errors.New("worker: invalid request")
	// ErrTooLong is returned by Generate and Prefill when the prompt plus
	// the tokens to generate exceed what one rank's pools can ever hold.
	ErrTooLong = errors.New("worker: request longer than the pools can hold")
	// ErrQueueFull is returned by Generate and Prefill when the admission
	// queue is at its bound.
	ErrQueueFull = errors.New("worker: queue full")
	// ErrDraining is returned by Generate and Prefill once Drain has begun.
	ErrDraining = errors.New("worker: draining")
	// ErrClosed ends requests still queued or running when the scheduler stops,
	// and is returned by Generate and Prefill after it stopped.
	ErrClosed = errors.New("worker: scheduler stopped")
	// ErrWrongRole is returned by Generate on a prefill scheduler and by
	// Prefill on a decode scheduler.
	ErrWrongRole = errors.New("worker: not served by this role")
	// ErrTransferRefused wraps a peer's refusal of a transfer (no prefill
	// worker, a full queue, a layout mismatch); CacheSource implementations
	// wrap with it so the transfer metric says "refused".
	ErrTransferRefused = errors.New("worker: transfer refused")
	// ErrTransferFailed wraps a transfer whose peer failed mid-way (it
	// died, or its data path or control connection broke) on every
	// attempt: some of its bytes may have landed, none will after Fetch
	// returns, and the destination holds no usable cache.
	ErrTransferFailed = errors.New("worker: transfer failed")
	// ErrTransferTimeout wraps a transfer that ran past its deadline.
	ErrTransferTimeout = errors.New("worker: transfer timed out")
	// ErrStreamEnded is returned by Stream.Next after the final event.
	ErrStreamEnded = errors.New("worker: stream ended")
)
