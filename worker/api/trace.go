package api

import (
	"net/http"
	"strings"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// traced wraps h in a server span per request ("POST /v1/completions"),
// continuing the W3C trace context (traceparent, tracestate) the client sent.
// The response writer keeps what http.ResponseController needs (Flush,
// write deadlines) through its Unwrap.
func traced(h http.Handler, tp trace.TracerProvider) http.Handler {
	return otelhttp.NewHandler(h, "handoff-api",
		otelhttp.WithTracerProvider(tp),
		otelhttp.WithPropagators(propagation.TraceContext{}),
		otelhttp.WithSpanNameFormatter(spanName))
}

// spanName names a request's span by method and route; a path the API does
// not serve is named by its method alone, so a client cannot mint names.
func spanName(_ string, r *http.Request) string {
	switch p := r.URL.Path; {
	case p == "/v1/completions", p == "/v1/chat/completions", p == "/v1/models":
		return r.Method + " " + p
	case strings.HasPrefix(p, "/v1/models/"):
		return r.Method + " /v1/models/{id}"
	}
	return r.Method
}
