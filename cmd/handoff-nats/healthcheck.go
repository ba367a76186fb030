package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/handoff-io/handoff/internal/healthcheck"
)

// errUnhealthy is returned when the probed endpoint did not answer 200.
var errUnhealthy = errors.New("handoff-nats: unhealthy")

// defaultHealthURL probes the local monitoring port. HANDOFF_NATS_HTTP_PORT is
// honoured so that the probe follows the server when both read the same env.
func defaultHealthURL(getenv func(string) string) string {
	port := defaultHTTPPort
	if p, err := strconv.Atoi(getenv("HANDOFF_NATS_HTTP_PORT")); err == nil && p > 0 {
		port = p
	}
	return fmt.Sprintf("http://127.0.0.1:%d/healthz", port)
}

// runHealthcheck GETs the URL and succeeds only on 200. It exists for images
// with no shell and no HTTP client (docker HEALTHCHECK, compose healthcheck).
func runHealthcheck(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	fs := flag.NewFlagSet("handoff-nats healthcheck", flag.ContinueOnError)
	fs.SetOutput(stdout)
	url := fs.String("url", defaultHealthURL(getenv), "URL to GET; 200 means healthy (add ?js-enabled-only=true for a liveness-style check)")
	timeout := fs.Duration("timeout", healthcheck.DefaultTimeout, "request timeout")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return errHelp
		}
		return fmt.Errorf("%w: %v", errConfig, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: healthcheck: unexpected argument %q", errConfig, fs.Arg(0))
	}
	if *timeout <= 0 {
		return fmt.Errorf("%w: healthcheck: --timeout must be positive", errConfig)
	}
	return probe(ctx, *url, *timeout, stdout)
}

func probe(ctx context.Context, url string, timeout time.Duration, out io.Writer) error {
	resp, err := healthcheck.Get(ctx, url, timeout)
	var ue *healthcheck.URLError
	switch {
	case errors.As(err, &ue):
		return fmt.Errorf("%w: healthcheck: %v", errConfig, err)
	case err != nil:
		return fmt.Errorf("%w: %v", errUnhealthy, err)
	case !resp.OK():
		return fmt.Errorf("%w: %s answered %d: %s", errUnhealthy, url, resp.StatusCode, resp.Body)
	}
	fmt.Fprintf(out, "%s\n", resp.Body)
	return nil
}
