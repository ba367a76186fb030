// Command cuda-check verifies handoff's CUDA data paths on a machine with
// an NVIDIA driver and prints one JSON report (see package cudacheck).
// scripts/gpu-check runs it. It needs no CUDA toolkit and no cgo.
//
//	cuda-check [--device 0|GPU-uuid] [--size-mib 256] [--repeat 20] [--lib libcuda.so.1]
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudacheck"
)

func main() {
	cudacheck.Child()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "cuda-check:", err)
		os.Exit(1)
	}
}

var errFailed = errors.New("some checks failed (see errors in the report)")

func run(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("cuda-check", flag.ContinueOnError)
	defLib := cuda.Library
	if p := os.Getenv(cuda.LibraryEnv); p != "" {
		defLib = p
	}
	lib := fs.String("lib", defLib, "the CUDA driver library to load (default $"+cuda.LibraryEnv+" or "+cuda.Library+")")
	dev := fs.String("device", "0", "device ordinal or UUID")
	size := fs.Uint64("size-mib", 256, "buffer size in MiB")
	repeat := fs.Int("repeat", 20, "copies per measurement")
	if err := fs.Parse(args); err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	rep, err := cudacheck.Run(ctx, cudacheck.Config{Library: *lib, Device: *dev, Size: *size << 20, Repeat: *repeat, Self: []string{self}})
	if err != nil {
		return err
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(rep); err != nil {
		return err
	}
	if !rep.OK {
		return errFailed
	}
	return nil
}
