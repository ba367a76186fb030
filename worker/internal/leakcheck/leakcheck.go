package leakcheck

import (
	"fmt"
	"net/http"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

// Main runs m and then checks, for up to 5 seconds, that no goroutine the
// tests started is still running. Use it from TestMain:
//
//	func TestMain(m *testing.M) { leakcheck.Main(m) }
func Main(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if leaked := wait(5 * time.Second); leaked != "" {
			fmt.Fprintf(os.Stderr, "leakcheck: goroutines left after the tests:\n%s\n", leaked)
			code = 1
		}
	}
	os.Exit(code)
}

func wait(d time.Duration) string {
	deadline := time.Now().Add(d)
	for {
		http.DefaultClient.CloseIdleConnections()
		if t, ok := http.DefaultTransport.(*http.Transport); ok {
			t.CloseIdleConnections()
		}
		leaked := interesting()
		if len(leaked) == 0 {
			return ""
		}
		if time.Now().After(deadline) {
			return strings.Join(leaked, "\n\n")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// interesting returns the stacks of goroutines that are not the runtime's or
// the test framework's own.
func interesting() []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		switch {
		case strings.Contains(g, "leakcheck.interesting"),
			strings.Contains(g, "testing.(*M).Run"),
			strings.Contains(g, "testing.tRunner"),
			strings.Contains(g, "runtime.goexit") && strings.Contains(g, "signal.signal_recv"),
			strings.Contains(g, "os/signal.loop"),
			strings.Contains(g, "runtime.ensureSigM"),
			strings.Contains(g, "testing.runFuzzing"),
			strings.Contains(g, "created by runtime.gc"),
			strings.Contains(g, "runtime.forcegchelper"),
			strings.Contains(g, "runtime.bgsweep"),
			strings.Contains(g, "runtime.bgscavenge"),
			strings.Contains(g, "runtime.runfinq"),
			strings.Contains(g, "runtime.unique_runtime_registerUniqueMapCleanup"),
			strings.Contains(g, "go.opencensus.io"),
			strings.TrimSpace(g) == "":
			continue
		}
		out = append(out, g)
	}
	return out
}
