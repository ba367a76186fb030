// Command handoff-bench measures handoff's data path and control plane against
// baselines measured in the same run.
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

const usage = `usage: handoff-bench <subcommand> [flags]

subcommands:
  datapath   the rdma data path (tcp, shm, inproc) against iperf3, memcpy and ucx_perftest
  control    the control overhead of a handoff against plain NATS request-replies
  topology   the GPUs and NICs this host offers the data path
  serve      load an OpenAI /v1/completions endpoint as vllm bench serve does
  compare    serve --sweep-rates reports of several setups side by side: goodput table and plot
  layerwise  time to first token with and without layer-wise streaming, against local prefill

handoff-bench <subcommand> --help lists a subcommand's flags.
`

func main() {
	os.Exit(runMain(os.Args[1:], os.Stdout, os.Stderr))
}

// runMain runs a subcommand until it is done or SIGINT or SIGTERM arrives,
// and returns the exit status. The first signal cancels the run, which then
// stops its children and exits nonzero without a report; a second one meets
// the default action and ends the process at once.
func runMain(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	context.AfterFunc(ctx, stop)
	err := run(ctx, args, stdout, stderr)
	if errors.Is(err, errChildStopped) {
		return 1 // the parent that stopped it has its own say
	}
	if ctx.Err() != nil { // only a signal ends ctx before stop below
		err = fmt.Errorf("interrupted: %w", context.Cause(ctx))
	}
	stop()
	if err != nil {
		fmt.Fprintln(stderr, "handoff-bench:", err)
		return 1
	}
	return 0
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return fmt.Errorf("no subcommand given")
	}
	switch args[0] {
	case "datapath":
		return runDatapath(ctx, args[1:])
	case "layerwise":
		return runLayerwise(ctx, args[1:], stdout, stderr)
	case "control":
		return runControl(ctx, args[1:])
	case "topology":
		return runTopology(ctx, args[1:])
	case "serve":
		return runServe(ctx, args[1:], stdout, stderr)
	case "compare":
		return runCompare(args[1:], stdout, stderr)
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	default:
		return fmt.Errorf("unknown subcommand %q (want datapath, control, topology, serve or compare; see handoff-bench --help)", args[0])
	}
}
