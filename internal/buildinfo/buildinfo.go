// Package buildinfo is the version and revision every handoff binary
// reports. scripts/images stamps both at link time, in this package alone:
//
//	-ldflags "-X github.com/handoff-io/handoff/internal/buildinfo.version=v0.1.0
//	          -X github.com/handoff-io/handoff/internal/buildinfo.revision=<git sha>"
package buildinfo

import "runtime/debug"

// Set at link time; see the package doc.
var (
	version  = ""
	revision = ""
)

// Version is the link-time version, else the main module's version as the
// go command stamped it, else "dev".
func Version() string {
	if version != "" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}

// Revision is the link-time revision, else the VCS revision stamped by the
// go command, else "unknown".
func Revision() string {
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
