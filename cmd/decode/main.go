// Command decode runs a decode worker: the OpenAI-compatible API, ADP ranks that generate from caches prefilled remotely (or locally with --prefill local). With --standalone it also runs an embedded NATS server and a prefill worker: the whole pipeline in one command.
//
// Run "decode --help" for the flags; each has an environment twin.
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
		fmt.Fprintln(os.Stderr, "decode:", err)
		os.Exit(1)
	}
}

func run(ctx, abort context.Context) error {
	return service.Main(ctx, abort, worker.RoleDecode, os.Args[1:], os.Stdout, os.Stderr)
}
