// Command decode runs a decode worker: the OpenAI-compatible API, ADP ranks that generate from caches prefilled remotely (or locally with --prefill local). With --standalone it also runs an embedded NATS server and a prefill worker: the whole pipeline in one command.
//
// Run "decode --help" for the flags; each has an environment twin.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/service"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "decode:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	return service.Main(ctx, worker.RoleDecode, os.Args[1:], os.Stdout, os.Stderr)
}
