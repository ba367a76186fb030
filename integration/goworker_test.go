//go:build integration

package integration

// Two Go rdma engines in two processes, as two workers are: the baseline of
// the agent's 64 MiB send (TestAgentMeasure). The receiving engine runs in
// a child (this test binary, TestGoReceiverProcess), which opens a grant
// when asked and answers with its ticket, and says when it has landed.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/rdma"
)

// goReceiverEnv names the child's transport, region size and extent count.
const goReceiverEnv = "HANDOFF_GO_RECEIVER"

// goWriterProcess starts a receiving engine in a child process, its
// region's size bytes in n extents (n-1 reversed, then one, as goWriter's),
// and returns a function that makes one write of them from an engine in
// this process and times its Write (the write and the commit's verdict).
func goWriterProcess(t *testing.T, tr rdma.Transport, size int64, n int) func() float64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	h := startHelper(t, "TestGoReceiverProcess", fmt.Sprintf("%s=%s %d %d", goReceiverEnv, tr, size, n))
	read := func(into any) {
		l := h.next(t, time.Minute)
		require.NoError(t, json.Unmarshal([]byte(l), into), "%q", l)
	}
	var desc rdma.Descriptor
	read(&desc)
	src, err := rdma.New(rdma.Config{Agent: rdma.AgentID(fmt.Sprintf("go-pre-proc-%d", goSeq.Add(1))), Transports: []rdma.Transport{tr}, Logger: quietLogger()})
	require.NoError(t, err)
	t.Cleanup(func() { src.Close() })
	sr, err := src.Register("kv", size)
	require.NoError(t, err)
	for i := range sr.Bytes() {
		sr.Bytes()[i] = byte(i * 7)
	}
	_, err = src.Connect(ctx, desc)
	require.NoError(t, err)
	return func() float64 {
		_, err := io.WriteString(h.stdin, "grant\n")
		require.NoError(t, err)
		var tk rdma.Ticket
		read(&tk)
		start := time.Now()
		_, err = src.Write(ctx, desc, tk, []rdma.Extent{{Region: sr.ID(), Length: uint64(size)}})
		require.NoError(t, err)
		took := time.Since(start).Seconds()
		_, err = io.WriteString(h.stdin, "wait\n")
		require.NoError(t, err)
		var landed string
		read(&landed)
		require.Equal(t, "landed", landed)
		return took
	}
}

// TestGoReceiverProcess is goWriterProcess's receiving engine when run as
// its child; otherwise it skips. It prints its descriptor, then for each
// "grant" line a ticket, and for each "wait" line "landed" once that grant
// landed and verified.
func TestGoReceiverProcess(t *testing.T) {
	spec := strings.Fields(os.Getenv(goReceiverEnv))
	if len(spec) != 3 {
		t.Skip("SKIP: a child process of TestAgentMeasure")
	}
	size, err := strconv.ParseInt(spec[1], 10, 64)
	require.NoError(t, err)
	n, err := strconv.Atoi(spec[2])
	require.NoError(t, err)
	e, err := rdma.New(rdma.Config{Agent: rdma.AgentID(fmt.Sprintf("go-dec-proc-%d", os.Getpid())), Transports: []rdma.Transport{rdma.Transport(spec[0])}, Logger: quietLogger()})
	require.NoError(t, err)
	defer e.Close()
	r, err := e.Register("kv", size)
	require.NoError(t, err)
	ext := reversedExtents(r.ID(), size, n)
	out := json.NewEncoder(helperProtocol())
	require.NoError(t, out.Encode(e.Descriptor()))
	in := bufio.NewScanner(os.Stdin)
	var g *rdma.Grant
	for req := uint64(1); in.Scan(); {
		switch in.Text() {
		case "grant":
			g, err = e.OpenGrant(rdma.GrantSpec{RequestID: req, Extents: ext})
			require.NoError(t, err)
			req++
			require.NoError(t, out.Encode(g.Ticket()))
		case "wait":
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			_, err := g.Wait(ctx)
			cancel()
			require.NoError(t, err)
			require.NoError(t, out.Encode("landed"))
		}
	}
}
