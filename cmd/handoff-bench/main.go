// Command handoff-bench measures handoff's data path and control plane against
// baselines measured in the same run.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "handoff-bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return fmt.Errorf("usage: handoff-bench datapath|control|topology [flags]")
	}
	switch args[0] {
	case "datapath":
		return runDatapath(ctx, args[1:])
	case "control":
		return runControl(ctx, args[1:])
	case "topology":
		return runTopology(ctx, args[1:])
	default:
		return fmt.Errorf("unknown subcommand %q (want datapath, control or topology)", args[0])
	}
}
