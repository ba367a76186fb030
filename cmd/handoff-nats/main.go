package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run dispatches the subcommand and returns the process exit code. getenv is
// injected so tests control the environment.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	var err error
	switch {
	case len(args) > 0 && args[0] == "version":
		err = runVersion(args[1:], stdout)
	case len(args) > 0 && args[0] == "healthcheck":
		err = runHealthcheck(ctx, args[1:], getenv, stdout)
	case len(args) > 0 && args[0] == "serve":
		err = runServe(ctx, args[1:], getenv, stderr)
	default:
		err = runServe(ctx, args, getenv, stderr)
	}
	if errors.Is(err, errHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, err) // every error here starts with "handoff-nats:"
		return 1
	}
	return 0
}
