// Package buildinfo is the version and revision every handoff binary
// reports. scripts/images stamps both at link time, in this package alone:
//
//	-ldflags "-X github.com/handoff-io/handoff/internal/buildinfo.version=v0.1.0
//	          -X github.com/handoff-io/handoff/internal/buildinfo.revision=<git sha>"
package buildinfo

import (
	"runtime/debug"
	"strings"
)

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

// Build is the toolchain and the build settings a binary was built with:
// the go version, then those of vcs.revision, vcs.time, vcs.modified, GOOS
// and GOARCH the go command stamped, in its order, as
// "go1.26.8, GOARCH=amd64, GOOS=linux". It is "" for a binary without
// build information.
func Build() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	var b strings.Builder
	b.WriteString(bi.GoVersion)
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision", "vcs.time", "vcs.modified", "GOOS", "GOARCH":
			b.WriteString(", " + s.Key + "=" + s.Value)
		}
	}
	return b.String()
}
