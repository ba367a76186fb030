package transfer

import (
	"context"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/transfer/wire"
)

// Tracing. A handoff is traced when the ctx given to Decoder.Handoff carries
// a recording span (the decode worker's request span): the decoder opens a
// client span "handoff" under it with the tracer of that span's provider and
// sends its W3C trace context (traceparent, tracestate) in the headers of the
// prefill request. A Prefiller with a TracerProvider continues it: a server
// span "prefill" per request, from receipt to reply, with a child "write"
// around the data-path write (bytes, transport). With neither, nothing is
// traced, no header is sent and nothing is allocated for it.

// tracerName is the instrumentation scope of this package's spans.
const tracerName = "github.com/handoff-io/handoff/transfer"

// Span attribute keys of this package's spans: the exported ones are those
// the workers' tests check.
const (
	AttrKVBytes    = attribute.Key("handoff.kv_bytes")    // KV bytes moved
	AttrMambaBytes = attribute.Key("handoff.mamba_bytes") // Mamba row bytes moved
	AttrTransport  = attribute.Key("handoff.transport")   // the data path: tcp, shm, inproc

	attrRequestID = attribute.Key("handoff.request_id")
	attrInstance  = attribute.Key("handoff.instance") // the prefill instance that served it
	attrFrom      = attribute.Key("handoff.from")     // the requesting decode instance
	attrAttempts  = attribute.Key("handoff.attempts") // prefill requests sent
	// attrStreamedBytes (write): of the bytes moved, those that left layer
	// by layer as prefill finished them (layer-wise streaming).
	attrStreamedBytes = attribute.Key("handoff.streamed_bytes")
	attrCode          = attribute.Key("handoff.code") // the outcome code, when not ok
	attrTokens        = attribute.Key("handoff.prompt_tokens")
)

// traceContext is the propagator of the control messages: W3C trace context.
var traceContext propagation.TraceContext

// headerCarrier adapts NATS message headers to propagation.TextMapCarrier.
// NATS header names are case-sensitive: Set writes the lower-case names the
// W3C specification uses, and Get also finds a name written in another case
// (an http.Header-style "Traceparent" from another client).
type headerCarrier nats.Header

var _ propagation.TextMapCarrier = headerCarrier(nil)

func (c headerCarrier) Get(key string) string {
	if v := c[key]; len(v) > 0 {
		return v[0]
	}
	for k, v := range c {
		if len(v) > 0 && strings.EqualFold(k, key) {
			return v[0]
		}
	}
	return ""
}

func (c headerCarrier) Set(key, value string) { c[strings.ToLower(key)] = []string{value} }

func (c headerCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// injectHeader writes span's context into h as W3C trace context.
func injectHeader(span trace.Span, h nats.Header) {
	traceContext.Inject(trace.ContextWithSpan(context.Background(), span), headerCarrier(h))
}

// extractHeader returns ctx with the remote span context h carries, if any.
func extractHeader(ctx context.Context, h nats.Header) context.Context {
	if len(h) == 0 {
		return ctx
	}
	return traceContext.Extract(ctx, headerCarrier(h))
}

// startHandoffSpan opens the decoder's span of one handoff under ctx's span,
// or returns nil when ctx carries no recording span.
func startHandoffSpan(ctx context.Context, req *Request) trace.Span {
	parent := trace.SpanFromContext(ctx)
	if !parent.IsRecording() {
		return nil
	}
	_, span := parent.TracerProvider().Tracer(tracerName).Start(ctx, "handoff",
		trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attrRequestID.Int64(int64(req.ID)), attrTokens.Int(len(req.Tokens))))
	return span
}

// endHandoffSpan ends a handoff's span with its outcome.
func endHandoffSpan(span trace.Span, res *Result, attempts int, err error) {
	span.SetAttributes(attrAttempts.Int(attempts))
	if err != nil {
		span.SetAttributes(attrCode.String(codeOf(err).String()))
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	} else {
		span.SetAttributes(attrInstance.String(res.Instance),
			AttrKVBytes.Int64(int64(res.KVBytes)), AttrMambaBytes.Int64(int64(res.MambaBytes)))
	}
	span.End()
}

// endSpanCode ends span (nil: not traced) with a protocol outcome.
func endSpanCode(span trace.Span, code session.Code, cause error) {
	if span == nil {
		return
	}
	if code != session.CodeOK {
		span.SetAttributes(attrCode.String(code.String()))
		msg := code.String()
		if cause != nil {
			span.RecordError(cause)
			msg = cause.Error()
		}
		span.SetStatus(codes.Error, msg)
	}
	span.End()
}

// msgPublisher is what a traced handoff needs from NATS to send headers
// (*nats.Conn). A publisher without it sends the request without them.
type msgPublisher interface {
	PublishMsg(m *nats.Msg) error
}

var _ msgPublisher = (*nats.Conn)(nil)

// publishRequest publishes a prefill request; a traced one carries h's span
// context in its headers, and the attempt is an event on the span.
func (h *handoff) publishRequest(subj, reply string, data []byte) error {
	mp, ok := h.d.pub.(msgPublisher)
	if h.span == nil || !ok {
		return h.d.pub.PublishRequest(subj, reply, data)
	}
	m := &nats.Msg{Subject: subj, Reply: reply, Data: data, Header: make(nats.Header, 2)}
	injectHeader(h.span, m.Header)
	h.span.AddEvent("prefill request sent", trace.WithAttributes(
		attrAttempts.Int(h.attempt), attribute.String("messaging.destination.name", subj)))
	return mp.PublishMsg(m)
}

// startSpan opens the "prefill" span of request m, received at start, under
// the trace context of r's headers (a new trace when they carry none).
func (p *Prefiller) startSpan(r micro.Request, m *wire.PrefillRequest, start time.Time) trace.Span {
	ctx := extractHeader(context.Background(), nats.Header(r.Headers()))
	_, span := p.tracer.Start(ctx, "prefill",
		trace.WithSpanKind(trace.SpanKindServer), trace.WithTimestamp(start),
		trace.WithAttributes(attrRequestID.Int64(int64(m.RequestID)), attrFrom.String(m.From),
			attrInstance.String(p.cfg.Instance), attrTokens.Int(len(m.Tokens)),
			attrAttempts.Int(int(m.Attempt))))
	return span
}

// startWriteSpan opens the "write" span of t's data-path write, begun at
// start; nil when t is not traced.
func (t *task) startWriteSpan(start time.Time) trace.Span {
	if t.span == nil {
		return nil
	}
	kv, mamba := t.out.Source.bytes()
	_, span := t.p.tracer.Start(trace.ContextWithSpan(context.Background(), t.span), "write",
		trace.WithSpanKind(trace.SpanKindProducer), trace.WithTimestamp(start),
		trace.WithAttributes(AttrKVBytes.Int64(int64(kv)), AttrMambaBytes.Int64(int64(mamba))))
	return span
}

// endWriteSpan ends t's write span (nil: not traced) at end, naming the
// transport the write took (known once it connected).
func (t *task) endWriteSpan(span trace.Span, end time.Time, err error) {
	if span == nil {
		return
	}
	if tr, ok := t.p.eng.TransportFor(t.ticket.Agent); ok {
		span.SetAttributes(AttrTransport.String(string(tr)))
	}
	if t.lw != nil {
		span.SetAttributes(attrStreamedBytes.Int64(int64(t.early)))
	}
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End(trace.WithTimestamp(end))
}
