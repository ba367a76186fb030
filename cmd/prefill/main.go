// Command prefill runs a prefill worker: it takes prefill requests from NATS, runs the prompt on one of its ADP ranks and pushes the KV blocks and Mamba row into the decode worker's memory over the data path.
//
// Run "prefill --help" for the flags; each has an environment twin.
package main

import (
	"context"
	"fmt"
	"os"
	"syscall"

	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/service"
)

func main() {
	// The first signal drains; a second ends the drain at once (exit 1).
	ctx, abort, stop := service.NotifyStop(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, abort)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "prefill:", err)
		os.Exit(1)
	}
}

func run(ctx, abort context.Context) error {
	return service.Main(ctx, abort, worker.RolePrefill, os.Args[1:], os.Stdout, os.Stderr)
}
