package service

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/handoff-io/handoff/internal/buildinfo"
	"github.com/handoff-io/handoff/internal/healthcheck"
	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/config"
)

// Main runs a worker binary of role with args (without the program name):
// "version", "healthcheck [--url URL]", or the worker itself. It returns when
// the worker stopped: ctx is cancelled by the first SIGINT/SIGTERM (the
// worker drains), abort by the second (the drain ends at once and Main
// returns ErrAborted); see NotifyStop. A nil abort never fires.
func Main(ctx, abort context.Context, role worker.Role, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 {
		switch args[0] {
		case "version":
			printVersion(stdout, role)
			return nil
		case "healthcheck":
			return runHealthcheck(ctx, role, args[1:], stdout, stderr)
		}
	}
	out := stderr
	for _, a := range args {
		if a == "-h" || a == "-help" || a == "--help" || a == "--h" {
			out = stdout
		}
	}
	cfg, err := config.Parse(role, args, os.Getenv, out)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	o := Options{Stdout: stdout, Stderr: stderr, Abort: abort}
	run := RunPrefill
	if role == worker.RoleDecode {
		run = RunDecode
	}
	err = run(ctx, cfg, o)
	if err != nil && ctx.Err() != nil && (abort == nil || abort.Err() == nil) && errors.Is(err, context.Canceled) && !errors.Is(err, ErrAborted) {
		// Stopped before it served (waiting for NATS or JetStream, say): a
		// stop asked for, not a failure, so the process exits 0 as after
		// a drain.
		fmt.Fprintf(stderr, "%s: stopped before serving: %v\n", role, err)
		return nil
	}
	return err
}

func printVersion(w io.Writer, role worker.Role) {
	fmt.Fprintf(w, "handoff %s %s", role, buildinfo.Version())
	if b := buildinfo.Build(); b != "" {
		fmt.Fprintf(w, " (%s)", b)
	}
	fmt.Fprintln(w)
}

// runHealthcheck GETs the readiness URL: nil on 200, an error otherwise. For
// images without a shell or curl.
func runHealthcheck(ctx context.Context, role worker.Role, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet(string(role)+" healthcheck", flag.ContinueOnError)
	fs.SetOutput(stderr)
	def := "http://" + config.AdminDial(role, os.Getenv) + "/readyz"
	url := fs.String("url", def, "URL to GET; healthy on 200")
	timeout := fs.Duration("timeout", healthcheck.DefaultTimeout, "request timeout")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	resp, err := healthcheck.Get(ctx, *url, *timeout)
	if err != nil {
		return fmt.Errorf("healthcheck: %w", err)
	}
	if !resp.OK() {
		return fmt.Errorf("healthcheck: %s: %s: %s", *url, resp.Status, strings.TrimSpace(string(resp.Body)))
	}
	fmt.Fprintf(stdout, "ok: %s\n", strings.TrimSpace(string(resp.Body)))
	return nil
}
