// Package leakcheck fails tests that leave goroutines behind. It is the one
// leak checker of this module's tests, built on go.uber.org/goleak:
//
//   - Main, from TestMain, checks the whole test binary once every test has
//     run: no goroutine may outlive the tests.
//   - Check, first thing in a test, checks that no goroutine the test started
//     outlives it. Tests that call it must not run in parallel with others.
//
// Both wait up to 5 seconds for goroutines to end before they fail, closing
// idle HTTP keep-alive connections of the default clients on the way: a
// goroutine that is only slow to wind down on a loaded machine is not a leak.
package leakcheck

import (
	"fmt"
	"net/http"
	"os"
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
