package transfer

// The executor seam: what a Prefiller asks of the worker that computes.

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/handoff-io/handoff/transfer/wire"
)

// Job is one prefill the executor is asked to admit and run.
type Job struct {
	RequestID uint64
	Tokens    []int32
	Sampling  wire.Sampling
	Deadline  time.Time
	From      string // the requesting instance
	// Span is the request's "prefill" span when it is traced, else nil: the
	// executor may open children under it (queue, compute).
	Span trace.Span
	// TP is the receiver's tensor-parallel size (PrefillRequest.TP, 1 when
	// omitted): the source extents must fill its shards' extents in ticket
	// order (RankRegions.Source), or the executor refuses with
	// ErrLayoutMismatch.
	TP int
	// Drafts is the most draft tokens the receiver verifies in its first
	// decode step (PrefillRequest.Drafts): the executor may draft up to
	// this many after the first token (Prefilled.Drafts).
	Drafts int
	// Skip is how many leading KV blocks of the prompt the receiver holds
	// already (PrefillRequest.Skip): the source extents must leave them
	// out (RankRegions.Source of the resources less them), or the write
	// fails its manifest check.
	Skip int
}

// Prefilled is the outcome of a prefill: the first token and where the
// request's cache lives in this worker's registered regions (its KV runs in
// token order, its Mamba row).
type Prefilled struct {
	FirstToken int32
	Logprobs   []byte // the first token's logprobs, when asked (PrefillReply.Logprobs)
	Cached     int    // prompt tokens the prefix cache served (PrefillReply.Cached)
	Source     CacheExtents
	// Drafts are draft tokens after FirstToken (PrefillReply.Drafts), at
	// most Job.Drafts: more are cut.
	Drafts []int32
}

// PrefillExecutor is what a Prefiller needs from the worker: admission within
// capacity and prefill on one of its ranks.
type PrefillExecutor interface {
	// Admit reserves room for job or refuses at once with an error wrapping
	// ErrCapacityRefused (other errors count as prefill failures). It must not
	// block on compute: it runs on the NATS dispatch path.
	Admit(job Job) (AdmittedJob, error)
}

// AdmittedJob is one admitted job's resources.
type AdmittedJob interface {
	// Prefill runs the prompt and returns the first token and the source
	// extents. It must return promptly once ctx is done.
	Prefill(ctx context.Context) (Prefilled, error)
	// Release frees everything the lease holds. Called exactly once, after
	// Prefill and any write from its extents returned.
	Release()
}
