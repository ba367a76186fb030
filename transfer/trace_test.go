package transfer

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/transfer/wire"
)

// spansNamed waits until exp holds n spans and returns them by name.
func spansNamed(t *testing.T, exp *tracetest.InMemoryExporter, n int) map[string]tracetest.SpanStub {
	t.Helper()
	natstest.CheckFor(t, 5*time.Second, time.Millisecond, func() error {
		if got := len(exp.GetSpans()); got < n {
			return fmt.Errorf("%d spans ended, want %d", got, n)
		}
		return nil
	})
	out := map[string]tracetest.SpanStub{}
	for _, s := range exp.GetSpans() {
		out[s.Name] = s
	}
	require.Len(t, out, n, "span names")
	return out
}

func attrOf(s tracetest.SpanStub, k attribute.Key) attribute.Value {
	for _, kv := range s.Attributes {
		if kv.Key == k {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// spyPrefill records the headers of the prefill requests published to the
// queue group subject.
func spyPrefill(t *testing.T, f *fixture) <-chan nats.Header {
	nc := natstest.Connect(t, f.srv)
	got := make(chan nats.Header, 4)
	_, err := nc.Subscribe(wire.Subject(wire.DefaultPrefix, f.ns, wire.SubjectPrefill, ""), func(m *nats.Msg) { got <- m.Header })
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	return got
}

// A traced handoff joins one trace across the two sides: the decoder's
// "handoff" span under the caller's, the prefiller's "prefill" span under it
// (carried in the NATS headers as W3C trace context), and the data-path
// "write" under that.
func TestHandoffTraced(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	exp := tracetest.NewInMemoryExporter()
	decTP := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	preTP := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp)) // the other process's
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", f.fp, newExec(ps), func(c *PrefillerConfig) { c.TracerProvider = preTP })
	headers := spyPrefill(t, f)

	ctx, root := decTP.Tracer("test").Start(context.Background(), "request")
	res, err := ds.handoff(ctx, d, Request{ID: 7, Tokens: tokens(20), Deadline: time.Now().Add(5 * time.Second)})
	require.NoError(t, err)
	root.End()
	require.NoError(t, ds.m.Free(7))

	h := <-headers
	require.Len(t, h.Get("traceparent"), 55, "W3C traceparent in the NATS headers: %v", h)

	spans := spansNamed(t, exp, 4)
	req, ho, pf, wr := spans["request"], spans["handoff"], spans["prefill"], spans["write"]
	for _, s := range []tracetest.SpanStub{ho, pf, wr} {
		require.Equal(t, req.SpanContext.TraceID(), s.SpanContext.TraceID(), "%s in the request's trace", s.Name)
	}
	require.Equal(t, req.SpanContext.SpanID(), ho.Parent.SpanID())
	require.Equal(t, ho.SpanContext.SpanID(), pf.Parent.SpanID())
	require.True(t, pf.Parent.IsRemote(), "prefill's parent came over NATS")
	require.Equal(t, pf.SpanContext.SpanID(), wr.Parent.SpanID())
	require.Equal(t, trace.SpanKindClient, ho.SpanKind)
	require.Equal(t, trace.SpanKindServer, pf.SpanKind)

	require.Equal(t, int64(7), attrOf(ho, attrRequestID).AsInt64())
	require.Equal(t, "p1", attrOf(ho, attrInstance).AsString())
	require.Equal(t, int64(res.KVBytes), attrOf(ho, AttrKVBytes).AsInt64())
	require.Equal(t, "d1", attrOf(pf, attrFrom).AsString())
	require.Equal(t, int64(res.KVBytes), attrOf(wr, AttrKVBytes).AsInt64())
	require.Equal(t, int64(res.MambaBytes), attrOf(wr, AttrMambaBytes).AsInt64())
	require.NotEmpty(t, attrOf(wr, AttrTransport).AsString())
	require.False(t, wr.StartTime.Before(pf.StartTime), "write starts within prefill")
	require.False(t, wr.EndTime.After(pf.EndTime), "write ends within prefill")
	for _, s := range []tracetest.SpanStub{ho, pf, wr} {
		require.Equal(t, codes.Unset, s.Status.Code, s.Name)
	}
}

// Untraced, a handoff sends no headers and records nothing, even to a
// prefiller that traces (it starts a trace of its own).
func TestHandoffUntracedSendsNoHeaders(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", f.fp, newExec(ps), func(c *PrefillerConfig) { c.TracerProvider = tp })
	headers := spyPrefill(t, f)

	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(5 * time.Second)})
	require.NoError(t, err)
	require.NoError(t, ds.m.Free(3))
	require.Empty(t, <-headers)
	spans := spansNamed(t, exp, 2)
	require.False(t, spans["prefill"].Parent.IsValid(), "a root span")
	require.Equal(t, spans["prefill"].SpanContext.SpanID(), spans["write"].Parent.SpanID())
}

// A refused request ends both spans as errors with the refusal's code.
func TestHandoffTracedRefusal(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.MaxAttempts = 1 })
	f.prefiller("p1", "fp-other", newExec(ps), func(c *PrefillerConfig) { c.TracerProvider = tp })

	ctx, root := tp.Tracer("test").Start(context.Background(), "request")
	_, err := ds.handoff(ctx, d, Request{ID: 4, Tokens: tokens(9), Deadline: time.Now().Add(5 * time.Second)})
	root.End()
	require.ErrorIs(t, err, ErrLayoutMismatch)
	spans := spansNamed(t, exp, 3)
	for _, name := range []string{"handoff", "prefill"} {
		s := spans[name]
		require.Equal(t, codes.Error, s.Status.Code, name)
		require.Equal(t, session.CodeLayoutMismatch.String(), attrOf(s, attrCode).AsString(), name)
	}
	require.Equal(t, spans["handoff"].SpanContext.SpanID(), spans["prefill"].Parent.SpanID())
	ds.requireInitial(t)
}

func TestHeaderCarrier(t *testing.T) {
	h := nats.Header{}
	c := headerCarrier(h)
	c.Set("Traceparent", "00-1")
	require.Equal(t, []string{"00-1"}, h["traceparent"], "lower-case on the wire")
	require.Equal(t, "00-1", c.Get("traceparent"))
	h2 := headerCarrier(nats.Header{"TraceParent": {"00-2"}})
	require.Equal(t, "00-2", h2.Get("traceparent"), "any case is read")
	require.Empty(t, h2.Get("tracestate"))
	require.ElementsMatch(t, []string{"TraceParent"}, h2.Keys())
}

// A streamed handoff's write span says how many of its bytes left layer
// by layer (handoff.streamed_bytes); one written after prefill has none.
func TestHandoffTracedStreamed(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	exp := tracetest.NewInMemoryExporter()
	preTP := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	d := f.decoder("d1", ds, nil)
	f.streamPrefiller("p1", newStreamExec(ps, 37), func(c *PrefillerConfig) {
		c.TracerProvider, c.Layerwise, c.LayerwiseMinTokens = preTP, LayerwiseAuto, 12
	})
	for _, n := range []int{20, 6} { // streamed, then under auto's threshold
		exp.Reset()
		res, err := ds.handoff(context.Background(), d, Request{ID: uint64(n), Tokens: tokens(n), Deadline: time.Now().Add(5 * time.Second)})
		require.NoError(t, err)
		require.NoError(t, ds.m.Free(uint64(n)))
		wr := spansNamed(t, exp, 2)["write"]
		got := attrOf(wr, attrStreamedBytes)
		if n < 12 {
			require.Equal(t, attribute.EMPTY, got.Type(), "a write after prefill carries no streamed bytes")
			continue
		}
		require.Positive(t, got.AsInt64())
		require.LessOrEqual(t, got.AsInt64(), int64(res.KVBytes+res.MambaBytes))
	}
}
