package leakcheck

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// recorder is a testing.TB that records Errorf instead of failing.
type recorder struct {
	testing.TB
	cleanups []func()
	errs     []string
}

func (r *recorder) Helper()                   {}
func (r *recorder) Name() string              { return "recorded" }
func (r *recorder) Cleanup(f func())          { r.cleanups = append(r.cleanups, f) }
func (r *recorder) Errorf(f string, a ...any) { r.errs = append(r.errs, fmt.Sprintf(f, a...)) }

func (r *recorder) finish() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
}

func TestCheckPassesWhenGoroutinesEnd(t *testing.T) {
	r := &recorder{TB: t}
	Check(r)
	done := make(chan struct{})
	go func() { time.Sleep(50 * time.Millisecond); close(done) }()
	r.finish()
	<-done
	if len(r.errs) != 0 {
		t.Fatalf("errors for a goroutine that ended: %v", r.errs)
	}
}

func TestCheckReportsALeak(t *testing.T) {
	if testing.Short() {
		t.Skip("waits the whole grace period")
	}
	stop := make(chan struct{})
	defer close(stop)
	running := make(chan struct{})
	go func() { close(running); <-stop }() // running before Check: not the test's
	<-running
	r := &recorder{TB: t}
	Check(r)
	go func() { <-stop }()
	r.finish()
	if len(r.errs) != 1 || !strings.Contains(r.errs[0], "goroutines left after recorded") {
		t.Fatalf("want one leak report, got %v", r.errs)
	}
	if n := strings.Count(r.errs[0], "Goroutine "); n != 1 {
		t.Fatalf("want the one goroutine started after Check, got %d:\n%s", n, r.errs[0])
	}
}

func TestCheckFDs(t *testing.T) {
	if openFDs() == nil {
		t.Skip("no /proc/self/fd")
	}
	r := &recorder{TB: t}
	CheckFDs(r)
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	go func(f *os.File) { time.Sleep(50 * time.Millisecond); f.Close() }(f)
	r.finish()
	if len(r.errs) != 0 {
		t.Fatalf("errors for a descriptor that was closed: %v", r.errs)
	}

	if testing.Short() {
		return // the leak case waits the whole grace period
	}
	r = &recorder{TB: t}
	CheckFDs(r)
	f, err = os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r.finish()
	if len(r.errs) != 1 || !strings.Contains(r.errs[0], "file descriptors open after recorded") || !strings.Contains(r.errs[0], os.DevNull) {
		t.Fatalf("want one leak report naming %s, got %v", os.DevNull, r.errs)
	}
}
