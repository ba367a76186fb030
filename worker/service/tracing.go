package service

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.39.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/handoff-io/handoff/internal/buildinfo"
	"github.com/handoff-io/handoff/worker"
)

// ErrTracingConfig is returned for OTEL_* settings the workers cannot honour.
var ErrTracingConfig = errors.New("service: tracing configuration")

// tracingShutdown bounds the flush of the spans still batched at exit.
const tracingShutdown = 5 * time.Second

// startTracing returns the tracer provider of a worker of role: o's when set
// (tests, or a host process), else one built from the standard OpenTelemetry
// environment, or nil when that asks for no exporter. Tracing is off unless
// OTEL_TRACES_EXPORTER names one (otlp, console; "none" is off) or, with it
// unset, OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is
// set; OTEL_SDK_DISABLED=true turns it off whatever else is set. The OTLP
// exporter speaks http/protobuf unless OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL
// says grpc, and takes its endpoint, headers, TLS and timeout from the
// OTEL_EXPORTER_OTLP_* variables; the sampler comes from OTEL_TRACES_SAMPLER
// (default parentbased_always_on), the batching from OTEL_BSP_*, and the
// resource from OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES over the
// defaults service.name=handoff-<role> and service.instance.id. stop flushes
// and shuts down a provider built here; it is a no-op otherwise.
func startTracing(ctx context.Context, o *Options, role worker.Role, instance string) (tp trace.TracerProvider, stop func(), err error) {
	stop = func() {}
	if o.TracerProvider != nil {
		return o.TracerProvider, stop, nil
	}
	exps, err := tracesExporters(ctx, os.Getenv, o.Stdout)
	if err != nil || len(exps) == 0 {
		return nil, stop, err
	}
	res, err := resource.New(ctx,
		resource.WithTelemetrySDK(),
		resource.WithAttributes(semconv.ServiceName("handoff-"+string(role)), semconv.ServiceInstanceID(instance),
			semconv.ServiceVersion(buildinfo.Version())),
		resource.WithFromEnv(), // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win
	)
	if err != nil {
		return nil, stop, fmt.Errorf("%w: resource: %w", ErrTracingConfig, err)
	}
	opts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res)}
	for _, e := range exps {
		opts = append(opts, sdktrace.WithBatcher(e))
	}
	sdk := sdktrace.NewTracerProvider(opts...)
	log := o.Logger
	log.Info("tracing on", "exporters", len(exps))
	return sdk, func() {
		ctx, cancel := context.WithTimeout(context.Background(), tracingShutdown)
		defer cancel()
		if err := sdk.Shutdown(ctx); err != nil {
			log.Warn("tracing shutdown", "err", err)
		}
	}, nil
}

// tracesExporters builds the span exporters the environment (getenv) asks
// for; none when tracing is off. Console output goes to stdout.
func tracesExporters(ctx context.Context, getenv func(string) string, stdout io.Writer) ([]sdktrace.SpanExporter, error) {
	if strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true") {
		return nil, nil
	}
	names := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER"))
	if names == "" {
		if getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" {
			return nil, nil // off by default
		}
		names = "otlp"
	}
	var exps []sdktrace.SpanExporter
	for name := range strings.SplitSeq(names, ",") {
		var (
			exp sdktrace.SpanExporter
			err error
		)
		switch name = strings.TrimSpace(name); name {
		case "none":
			continue
		case "otlp":
			exp, err = otlpExporter(ctx, getenv)
		case "console":
			exp, err = stdouttrace.New(stdouttrace.WithWriter(stdout))
		default:
			err = fmt.Errorf("%w: OTEL_TRACES_EXPORTER %q: want otlp, console or none", ErrTracingConfig, name)
		}
		if err != nil {
			for _, e := range exps {
				_ = e.Shutdown(ctx)
			}
			return nil, err
		}
		exps = append(exps, exp)
	}
	return exps, nil
}

// otlpExporter is the OTLP span exporter of the protocol the environment
// names (http/protobuf by default). Both clients read the rest of their
// OTEL_EXPORTER_OTLP_* settings themselves.
func otlpExporter(ctx context.Context, getenv func(string) string) (sdktrace.SpanExporter, error) {
	proto := getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if proto == "" {
		proto = getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	switch strings.TrimSpace(proto) {
	case "", "http/protobuf":
		return otlptracehttp.New(ctx)
	case "grpc":
		return otlptracegrpc.New(ctx)
	default:
		return nil, fmt.Errorf("%w: OTLP protocol %q: want http/protobuf or grpc", ErrTracingConfig, proto)
	}
}
