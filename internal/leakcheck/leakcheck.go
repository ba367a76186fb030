// Package leakcheck fails tests that leave goroutines behind. It is the one
// leak checker of this module's tests, built on go.uber.org/goleak:
//
//   - Main, from TestMain, checks the whole test binary once every test has
//     run: no goroutine may outlive the tests.
//   - Check, first thing in a test, checks that no goroutine the test started
//     outlives it. Tests that call it must not run in parallel with others.
//   - CheckFDs, likewise, checks that the test leaves no more file
//     descriptors open than it found (connections, listeners, memfds).
//
// All wait up to 5 seconds for goroutines and descriptors to go before they
// fail, closing idle HTTP keep-alive connections of the default clients on
// the way: a goroutine that is only slow to wind down on a loaded machine is
// not a leak.
package leakcheck

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// grace is how long a check waits for goroutines to end.
const grace = 5 * time.Second

// Main runs m and then, if every test passed, fails the binary when a
// goroutine is still running. Use it from TestMain:
//
//	func TestMain(m *testing.M) { leakcheck.Main(m) }
func Main(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if err := find(); err != nil {
			fmt.Fprintf(os.Stderr, "leakcheck: goroutines left after the tests: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// Check fails t if a goroutine that was not running when Check was called is
// still running once the test and its other cleanups are done. Call it first
// in the test, so that its cleanup runs last.
func Check(t testing.TB) {
	t.Helper()
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		if err := find(before); err != nil {
			t.Errorf("leakcheck: goroutines left after %s: %v", t.Name(), err)
		}
	})
}

// CheckFDs fails t if, once the test and its other cleanups are done, the
// process has more file descriptors open than when CheckFDs was called; the
// report names the descriptors that were not open then. It checks nothing
// where /proc/self/fd cannot be read. Call it first in the test, like Check,
// and not in tests that run in parallel with others.
func CheckFDs(t testing.TB) {
	t.Helper()
	before := openFDs()
	if before == nil {
		return
	}
	t.Cleanup(func() {
		deadline := time.Now().Add(grace)
		for {
			closeIdle()
			now := openFDs()
			if len(now) <= len(before) {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("leakcheck: %d file descriptors open after %s, %d before; new: %s",
					len(now), t.Name(), len(before), newFDs(before, now))
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	})
}

var netpollWarm sync.Once

// openFDs maps each open descriptor of this process to what it refers to,
// or returns nil where that is unknown. The runtime's network poller opens
// descriptors of its own on first use and keeps them: they are opened before
// the first count, so that they are never taken for a test's.
func openFDs() map[string]string {
	netpollWarm.Do(func() {
		if ln, err := net.Listen("tcp", "127.0.0.1:0"); err == nil {
			ln.Close()
		}
	})
	const dir = "/proc/self/fd"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	fds := make(map[string]string, len(ents))
	for _, e := range ents {
		target, _ := os.Readlink(filepath.Join(dir, e.Name()))
		fds[e.Name()] = target
	}
	return fds
}

// newFDs lists the descriptors of now that before did not have, as
// "fd -> target", leaving out the one openFDs read the list through.
func newFDs(before, now map[string]string) string {
	self := fmt.Sprintf("/proc/%d/fd", os.Getpid())
	var l []string
	for fd, target := range now {
		if old, ok := before[fd]; (!ok || old != target) && target != self {
			l = append(l, fd+" -> "+target)
		}
	}
	slices.Sort(l)
	return strings.Join(l, ", ")
}

// find waits up to grace for the goroutines opts do not ignore to end, and
// returns goleak's report of those that did not. goleak itself ignores the
// testing package's and os/signal's goroutines.
func find(opts ...goleak.Option) error {
	deadline := time.Now().Add(grace)
	for {
		closeIdle()
		err := goleak.Find(opts...) // retries for about half a second itself
		if err == nil || time.Now().After(deadline) {
			return err
		}
	}
}

func closeIdle() {
	http.DefaultClient.CloseIdleConnections()
	if t, ok := http.DefaultTransport.(*http.Transport); ok {
		t.CloseIdleConnections()
	}
}
