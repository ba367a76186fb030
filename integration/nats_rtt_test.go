//go:build integration

package integration

// A NATS request-reply round trip between processes, the baseline of the
// agent's small-send latency (TestAgentMeasure): the requester, the
// responder and the nats-server each run in a process of their own, as two
// engine workers on one host and their NATS server do. This test binary
// plays all three (TestNATSPeerProcess, run as a child).

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
)

// The child's role and arguments, from the parent.
const (
	natsPeerEnv = "HANDOFF_NATS_PEER"     // server, echo or ask
	natsPeerArg = "HANDOFF_NATS_PEER_ARG" // server: the port; echo: the URL; ask: the URL, count and gap
)

// natsRTTSubject is what the responder answers.
const natsRTTSubject = "measure.echo"

// natsRoundTrips starts a nats-server and an echo responder in processes of
// their own and returns, for each gap, n request-reply round trips of 64
// bytes that a third process timed (after 50 unmeasured ones), each gap
// after the one before it ended, sorted. Spacing moves a round trip on a
// small machine as much as anything measured: processes that slept wake
// slower than busy ones, so a figure compared with it must be taken with
// the same gaps.
func natsRoundTrips(t *testing.T, n int, gaps ...time.Duration) [][]time.Duration {
	t.Helper()
	port := reservePort(t)
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)
	natsPeer(t, "server", strconv.Itoa(port))
	natsPeer(t, "echo", url)
	var all [][]time.Duration
	for _, gap := range gaps {
		out := natsPeer(t, "ask", url, strconv.Itoa(n), gap.String())
		var ns []int64
		require.NoError(t, json.Unmarshal([]byte(out), &ns), "the requester's output: %q", out)
		require.Len(t, ns, n)
		d := make([]time.Duration, n)
		for i, v := range ns {
			d[i] = time.Duration(v)
		}
		slices.Sort(d)
		all = append(all, d)
	}
	return all
}

// natsPeer runs this test binary as a NATS peer process (startHelper). For
// server and echo it returns once the child said it is ready (it stops
// with the test); for ask, what the child answered.
func natsPeer(t *testing.T, role string, args ...string) string {
	t.Helper()
	h := startHelper(t, "TestNATSPeerProcess", natsPeerEnv+"="+role, natsPeerArg+"="+strings.Join(args, " "))
	if role == "ask" {
		return h.next(t, 2*time.Minute)
	}
	require.Equal(t, "ready", h.next(t, 30*time.Second), "nats %s process", role)
	return ""
}

// TestNATSPeerProcess is a NATS peer for natsRoundTrips when run as its
// child; otherwise it skips.
func TestNATSPeerProcess(t *testing.T) {
	role := os.Getenv(natsPeerEnv)
	if role == "" {
		t.Skip("SKIP: a child process of TestAgentMeasure")
	}
	args := strings.Fields(os.Getenv(natsPeerArg))
	proto := helperProtocol()
	untilStdinCloses := func() {
		fmt.Fprintln(proto, "ready")
		_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	}
	switch role {
	case "server":
		port, err := strconv.Atoi(args[0])
		require.NoError(t, err)
		opts := natstest.Options(t.TempDir())
		opts.Port = port
		opts.JetStream = false
		srv, err := natstest.Start(opts)
		require.NoError(t, err)
		defer natstest.Stop(srv)
		untilStdinCloses()
	case "echo":
		nc, err := nats.Connect(args[0])
		require.NoError(t, err)
		defer nc.Close()
		_, err = nc.Subscribe(natsRTTSubject, func(m *nats.Msg) { _ = m.Respond(m.Data) })
		require.NoError(t, err)
		require.NoError(t, nc.Flush()) // the server knows the subscription before anyone asks
		untilStdinCloses()
	case "ask":
		n, err := strconv.Atoi(args[1])
		require.NoError(t, err)
		gap, err := time.ParseDuration(args[2])
		require.NoError(t, err)
		nc, err := nats.Connect(args[0])
		require.NoError(t, err)
		defer nc.Close()
		msg := make([]byte, 64)
		ns := make([]int64, 0, n)
		for i := range 50 + n {
			time.Sleep(gap)
			start := time.Now()
			_, err := nc.Request(natsRTTSubject, msg, 5*time.Second)
			require.NoError(t, err)
			if i >= 50 {
				ns = append(ns, int64(time.Since(start)))
			}
		}
		b, err := json.Marshal(ns)
		require.NoError(t, err)
		fmt.Fprintln(proto, string(b))
	default:
		t.Fatalf("unknown role %q", role)
	}
}
