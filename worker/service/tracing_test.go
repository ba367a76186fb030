package service

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.39.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/config"
)

// startTracedWorker is startWorker with tp as the worker's tracer provider.
func startTracedWorker(t *testing.T, cfg config.Config, tp trace.TracerProvider) Endpoints {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ready, done := make(chan Endpoints, 1), make(chan error, 1)
	var mu sync.Mutex
	var logs bytes.Buffer
	o := Options{Ready: func(ep Endpoints) { ready <- ep }, Stdout: io.Discard, Stderr: lockedWriter{&mu, &logs}, TracerProvider: tp}
	go func() {
		if cfg.Role == worker.RoleDecode {
			done <- RunDecode(ctx, cfg, o)
		} else {
			done <- RunPrefill(ctx, cfg, o)
		}
	}()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		mu.Lock()
		defer mu.Unlock()
		if t.Failed() {
			t.Logf("%s logs:\n%s", cfg.Role, logs.String())
		}
	})
	select {
	case ep := <-ready:
		return ep
	case err := <-done:
		done <- err
		t.Fatalf("%s did not start: %v", cfg.Role, err)
	case <-time.After(20 * time.Second):
		t.Fatalf("%s did not start", cfg.Role)
	}
	return Endpoints{}
}

// tracedProcess is a tracer provider standing for one worker process: its
// spans carry service.name = name.
func tracedProcess(exp sdktrace.SpanExporter, name string) *sdktrace.TracerProvider {
	return sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp),
		sdktrace.WithResource(resource.NewSchemaless(semconv.ServiceName(name))))
}

func spanAttr(s tracetest.SpanStub, k attribute.Key) attribute.Value {
	for _, kv := range s.Attributes {
		if kv.Key == k {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// One completion on a real prefill and decode pair (embedded NATS, tcp data
// path) is one trace: it continues the client's traceparent, and every
// phase across both processes hangs where it belongs.
func TestTraceAcrossPrefillAndDecode(t *testing.T) {
	ns := natstest.Run(t)
	exp := tracetest.NewInMemoryExporter()
	space := fmt.Sprintf("trace-%d", time.Now().UnixNano())
	common := []string{"--nats-url", ns.ClientURL(), "--namespace", space, "--transport", "tcp", "--max-batch-size", "2"}
	startTracedWorker(t, testConfig(t, worker.RolePrefill, common...), tracedProcess(exp, "prefill"))
	ep := startTracedWorker(t, testConfig(t, worker.RoleDecode, append(common, "--prefill", "remote")...),
		tracedProcess(exp, "decode"))

	const (
		traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
		caller  = "00f067aa0ba902b7"
	)
	req, err := http.NewRequest(http.MethodPost, "http://"+ep.HTTP+"/v1/completions", strings.NewReader(
		`{"model":"tiny-hybrid","prompt":"Hello, handoff","max_tokens":4,"temperature":0}`))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("traceparent", "00-"+traceID+"-"+caller+"-01")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, string(body))

	want := []string{
		"decode/POST /v1/completions", "decode/queue", "decode/handoff", "decode/first decode step",
		"prefill/prefill", "prefill/queue", "prefill/compute", "prefill/write",
	}
	spans := map[string]tracetest.SpanStub{}
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		clear(spans)
		for _, s := range exp.GetSpans() {
			svc, _ := s.Resource.Set().Value(semconv.ServiceNameKey)
			spans[svc.AsString()+"/"+s.Name] = s
		}
		for _, name := range want {
			if _, ok := spans[name]; !ok {
				return fmt.Errorf("no span %s yet; have %d spans", name, len(spans))
			}
		}
		return nil
	})
	require.Len(t, spans, len(want), "one span per phase")
	for name, s := range spans {
		require.Equal(t, traceID, s.SpanContext.TraceID().String(), "%s is in the client's trace", name)
	}
	parent := func(child, of string) {
		t.Helper()
		require.Equal(t, spans[of].SpanContext.SpanID(), spans[child].Parent.SpanID(), "%s under %s", child, of)
	}
	srv := spans["decode/POST /v1/completions"]
	require.Equal(t, caller, srv.Parent.SpanID().String(), "the client's span is the parent")
	require.True(t, srv.Parent.IsRemote())
	require.Equal(t, trace.SpanKindServer, srv.SpanKind)
	parent("decode/queue", "decode/POST /v1/completions")
	parent("decode/handoff", "decode/POST /v1/completions")
	parent("decode/first decode step", "decode/POST /v1/completions")
	parent("prefill/prefill", "decode/handoff") // across NATS
	require.True(t, spans["prefill/prefill"].Parent.IsRemote())
	parent("prefill/queue", "prefill/prefill")
	parent("prefill/compute", "prefill/prefill")
	parent("prefill/write", "prefill/prefill")

	// The phases in order, each within its parent.
	before := func(a, b string) {
		t.Helper()
		require.False(t, spans[a].EndTime.After(spans[b].StartTime), "%s ends before %s starts", a, b)
	}
	before("decode/queue", "decode/handoff")
	before("prefill/queue", "prefill/compute")
	before("prefill/compute", "prefill/write")
	before("decode/handoff", "decode/first decode step")
	write := spans["prefill/write"]
	require.Equal(t, "tcp", spanAttr(write, transfer.AttrTransport).AsString())
	require.Positive(t, spanAttr(write, transfer.AttrKVBytes).AsInt64())
	require.Positive(t, spanAttr(write, transfer.AttrMambaBytes).AsInt64())
	require.Equal(t, spanAttr(write, transfer.AttrKVBytes), spanAttr(spans["decode/handoff"], transfer.AttrKVBytes))
}

func TestTracesExporters(t *testing.T) {
	env := func(kv ...string) func(string) string {
		m := map[string]string{}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return func(k string) string { return m[k] }
	}
	for _, tc := range []struct {
		name string
		env  func(string) string
		n    int
		err  bool
	}{
		{"off by default", env(), 0, false},
		{"an OTLP endpoint turns it on", env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"), 1, false},
		{"a traces endpoint too", env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces"), 1, false},
		{"none", env("OTEL_TRACES_EXPORTER", "none", "OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"), 0, false},
		{"console", env("OTEL_TRACES_EXPORTER", "console"), 1, false},
		{"two", env("OTEL_TRACES_EXPORTER", "otlp, console"), 2, false},
		{"grpc", env("OTEL_TRACES_EXPORTER", "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"), 1, false},
		{"disabled", env("OTEL_SDK_DISABLED", "true", "OTEL_TRACES_EXPORTER", "console"), 0, false},
		{"unknown exporter", env("OTEL_TRACES_EXPORTER", "zipkin"), 0, true},
		{"unknown protocol", env("OTEL_TRACES_EXPORTER", "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"), 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exps, err := tracesExporters(context.Background(), tc.env, io.Discard)
			if tc.err {
				require.ErrorIs(t, err, ErrTracingConfig)
				return
			}
			require.NoError(t, err)
			require.Len(t, exps, tc.n)
			for _, e := range exps {
				require.NoError(t, e.Shutdown(context.Background()))
			}
		})
	}
}
