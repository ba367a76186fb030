package main

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"

	"github.com/nats-io/nats-server/v2/server"
)

// Set at link time by scripts/images:
//
//	-ldflags "-X main.version=v0.1.0 -X main.revision=<git sha>"
var (
	version  = ""
	revision = ""
)

// buildVersion is the link-time version, else the module version, else "dev".
func buildVersion() string {
	if version != "" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}

// buildRevision is the link-time revision, else the VCS revision stamped by
// the go command, else "unknown".
func buildRevision() string {
	if revision != "" {
		return revision
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" {
				return s.Value
			}
		}
	}
	return "unknown"
}

func runVersion(args []string, w io.Writer) error {
	if len(args) > 0 {
		return fmt.Errorf("%w: version takes no arguments", errConfig)
	}
	_, err := fmt.Fprintf(w, "handoff-nats %s\nrevision %s\nnats-server %s\ngo %s %s/%s\n",
		buildVersion(), buildRevision(), server.VERSION, runtime.Version(), runtime.GOOS, runtime.GOARCH)
	return err
}
