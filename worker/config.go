package worker

import (
	"fmt"
	"log/slog"
	"time"
)

// Config tunes a Scheduler.
type Config struct {
	Role Role
	// AttentionDP steps ranks in lockstep with dummy padding.
	AttentionDP bool
	// QueueSize bounds the requests waiting for admission; 0 means
	// DefaultQueueSize.
	QueueSize int
	// Source brings remote prefilled caches (decode role). Nil runs
	// prefill in-process: the aggregated baseline.
	Source CacheSource
	// Router, with a Source, decides per admitted request whether its
	// prefill runs at the Source or here (conditional disaggregation,
	// decode --prefill auto); a request whose remote prefill is refused
	// (ErrTransferRefused) or failed (ErrTransferFailed) is then prefilled
	// here instead of failing. Nil
	// sends every request to the Source.
	Router Router
	// Logger receives the scheduler's logs; nil discards them.
	Logger *slog.Logger
	// Metrics receives the scheduler's metrics; nil keeps them unregistered.
	Metrics *Metrics
	// ReleaseGrace is how long a stopping scheduler waits for leases and
	// fetches to end before it frees their resources anyway; 0 means 10s.
	ReleaseGrace time.Duration
	// PrefillChunkTokens splits a prompt's prefill into chunks of at most
	// this many tokens, one per step, so other requests' steps run between
	// them (executors that prefill whole prompts only take them whole); 0
	// prefills each prompt in one step.
	PrefillChunkTokens int
	// PrefixCache reuses cached prompt prefixes on the ranks that keep a
	// prefix cache (PoolParams.StateCheckpoints > 0 and an executor that
	// resumes prefills): see prefix.go. Off, every prompt is computed
	// from its first token, as without a cache.
	PrefixCache bool
	// CheckpointInterval, with PrefixCache, also takes a state checkpoint
	// every this many tokens of a prompt (its chunks end there), so a
	// shared prefix such as a system prompt is reusable by prompts that
	// continue it differently; 0 takes them only at the end of prompts and
	// generations.
	CheckpointInterval int
	// Speculation turns speculative decoding on for decode steps (spec.go);
	// the ranks' pools must be built for it (PoolParams.DraftTokens).
	Speculation Speculation
	// Offers, decode role with a Source and the prefix cache, hears of each
	// end-of-turn state the worker keeps after a remote prefill, for the
	// instance that prefilled it (state.go); nil offers none.
	Offers StateOffers
	// StateSource, prefill role with the prefix cache, fetches the states
	// it adopts (Adopt) from the instances that hold them; nil adopts none.
	StateSource CacheSource
}

func (c *Config) validate(ranks []*Rank) error {
	if c.Role != RolePrefill && c.Role != RoleDecode {
		return fmt.Errorf("%w: role %q", ErrInvalidConfig, c.Role)
	}
	if len(ranks) == 0 {
		return fmt.Errorf("%w: no ranks", ErrInvalidConfig)
	}
	for _, r := range ranks {
		// The pools reserve the ADP dummy's row only with attention DP: a
		// scheduler that pads over pools without it would put the dummy on
		// a real row, which a request may need.
		if c.AttentionDP && !r.mCfg.AttentionDP {
			return fmt.Errorf("%w: attention DP, but rank %d's Mamba pool reserves no row for its dummy", ErrInvalidConfig, r.index)
		}
	}
	if c.Role == RolePrefill && c.Source != nil {
		return fmt.Errorf("%w: a prefill scheduler takes no cache source", ErrInvalidConfig)
	}
	if c.StateSource != nil && (c.Role != RolePrefill || !c.PrefixCache) {
		return fmt.Errorf("%w: a state source needs the prefill role and the prefix cache", ErrInvalidConfig)
	}
	if c.Offers != nil && (c.Role != RoleDecode || c.Source == nil || !c.PrefixCache) {
		return fmt.Errorf("%w: state offers need the decode role, a cache source and the prefix cache", ErrInvalidConfig)
	}
	if c.Router != nil && c.Source == nil {
		return fmt.Errorf("%w: a prefill router needs a cache source", ErrInvalidConfig)
	}
	if c.QueueSize < 0 {
		return fmt.Errorf("%w: queue size %d", ErrInvalidConfig, c.QueueSize)
	}
	if c.PrefillChunkTokens < 0 {
		return fmt.Errorf("%w: prefill chunk of %d tokens", ErrInvalidConfig, c.PrefillChunkTokens)
	}
	if c.CheckpointInterval < 0 {
		return fmt.Errorf("%w: state checkpoint interval of %d tokens", ErrInvalidConfig, c.CheckpointInterval)
	}
	if err := c.Speculation.validate(ranks); err != nil {
		return err
	}
	if c.QueueSize == 0 {
		c.QueueSize = DefaultQueueSize
	}
	if c.ReleaseGrace <= 0 {
		c.ReleaseGrace = 10 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Metrics == nil {
		c.Metrics = NewMetrics(prometheusNopRegisterer{})
	}
	return nil
}

// DefaultQueueSize is the default bound of the admission queue: large
// enough that a burst of a thousand clients on one decode worker waits
// rather than being refused, small enough that the memory it holds stays
// bounded. A queued decode request costs the server about 25 KiB with a
// short prompt and 37 KiB with a 4096-token one (its connection, handler
// goroutine, parsed request and scheduler record; api's
// TestQueuedRequestMemory measures it), so a full default queue holds
// about 30-40 MiB: less than one Mamba row of a large model. What a long
// queue costs instead is waiting: a refused client is told the queue's
// expected wait (QueueWait) in Retry-After.
const DefaultQueueSize = 1024
