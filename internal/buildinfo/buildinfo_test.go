package buildinfo

import (
	"runtime"
	"strings"
	"testing"
)

func TestLinkTimeWins(t *testing.T) {
	v, r := version, revision
	t.Cleanup(func() { version, revision = v, r })

	version, revision = "", ""
	if Version() == "" || Revision() == "" {
		t.Fatalf("unstamped: version %q, revision %q; want a fallback", Version(), Revision())
	}
	version, revision = "v1.2.3", "abc123"
	if got := Version(); got != "v1.2.3" {
		t.Errorf("Version() = %q, want the link-time v1.2.3", got)
	}
	if got := Revision(); got != "abc123" {
		t.Errorf("Revision() = %q, want the link-time abc123", got)
	}
}

func TestBuild(t *testing.T) {
	b := Build()
	if !strings.HasPrefix(b, runtime.Version()) || !strings.Contains(b, "GOOS="+runtime.GOOS) {
		t.Fatalf("Build() = %q, want the go version first and GOOS among the settings", b)
	}
}
