package main

import (
	"fmt"
	"io"
	"runtime"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/handoff-io/handoff/internal/buildinfo"
)

func runVersion(args []string, w io.Writer) error {
	if len(args) > 0 {
		return fmt.Errorf("%w: version takes no arguments", errConfig)
	}
	_, err := fmt.Fprintf(w, "handoff-nats %s\nrevision %s\nnats-server %s\ngo %s %s/%s\n",
		buildinfo.Version(), buildinfo.Revision(), server.VERSION, runtime.Version(), runtime.GOOS, runtime.GOARCH)
	return err
}
