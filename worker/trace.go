package worker

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// Tracing. A request whose ctx carries a recording span (the API's request
// span on decode, the prefiller's "prefill" span on prefill) gets child spans
// for its phases here, each recorded when the phase ended, with the times the
// scheduler measures anyway: "queue" (accepted to admitted), "compute" (each
// prefill step, one per chunk) and, on decode, "first decode step" (the step
// after the prefilled first token). An untraced request costs one context
// lookup per phase and allocates nothing.

// TracerName is the instrumentation scope of this package's spans.
const TracerName = "github.com/handoff-io/handoff/worker"

// Span attribute keys of this package's spans.
const (
	AttrRank         = attribute.Key("handoff.rank")
	AttrPromptTokens = attribute.Key("handoff.prompt_tokens")
)

// traced returns q's recording span, or nil when q is not traced.
func (q *request) traced() trace.Span {
	if q.ctx == nil {
		return nil
	}
	if span := trace.SpanFromContext(q.ctx); span.IsRecording() {
		return span
	}
	return nil
}

// record adds the finished phase name of q, from start to end, under parent.
func (q *request) record(parent trace.Span, name string, start, end time.Time, attrs ...attribute.KeyValue) {
	ctx := trace.ContextWithSpan(context.Background(), parent)
	if q.rank != nil {
		attrs = append(attrs, AttrRank.Int(q.rank.index))
	}
	_, span := parent.TracerProvider().Tracer(TracerName).Start(ctx, name,
		trace.WithTimestamp(start), trace.WithAttributes(attrs...))
	span.End(trace.WithTimestamp(end))
}

// traceQueued records q's wait for admission, once admitted.
func (q *request) traceQueued() {
	if parent := q.traced(); parent != nil {
		q.record(parent, "queue", q.accepted, q.admitted)
	}
}

// traceCompute records the prefill step of q begun at start and just
// ended: one span per chunk of a prompt prefilled in chunks.
func (q *request) traceCompute(start time.Time) {
	if parent := q.traced(); parent != nil {
		q.record(parent, "compute", start, time.Now(), AttrPromptTokens.Int(len(q.prompt)))
	}
}

// firstStepStart returns the time the decode step about to run on q starts
// when it is q's first (its first token came from prefill) and q is traced,
// else the zero time: the step is not traced.
func (q *request) firstStepStart() time.Time {
	if q.generated != 1 || q.traced() == nil {
		return time.Time{}
	}
	return time.Now()
}

// traceFirstStep records q's first decode step, begun at start (zero: not
// traced).
func (q *request) traceFirstStep(start time.Time) {
	if start.IsZero() {
		return
	}
	if parent := q.traced(); parent != nil {
		q.record(parent, "first decode step", start, time.Now())
	}
}
