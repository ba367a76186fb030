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

// goReceiverEnv names the child's transport, destination size, extent
// count and destination count.
const goReceiverEnv = "HANDOFF_GO_RECEIVER"

// goWriterProcess starts a receiving engine in a child process, whose
// region holds slots destinations of size bytes, each in n extents (n-1
// reversed, then one, as goWriter's), and returns a function that writes
// size bytes k times (k at most slots) from an engine in this process and
// times each Write (the write and the commit's verdict): the child opens k
// grants first, one per destination, the writes follow each other gap
// apart (as the agents' small sends in a batch do), then the child waits
// for all k.
func goWriterProcess(t *testing.T, tr rdma.Transport, size int64, n, slots int) func(k int, gap time.Duration) []float64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	h := startHelper(t, "TestGoReceiverProcess", fmt.Sprintf("%s=%s %d %d %d", goReceiverEnv, tr, size, n, slots))
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
	return func(k int, gap time.Duration) []float64 {
		_, err := fmt.Fprintf(h.stdin, "grant %d\n", k)
		require.NoError(t, err)
		var tks []rdma.Ticket
		read(&tks)
		require.Len(t, tks, k)
		require.LessOrEqual(t, k, slots)
		took := make([]float64, 0, k)
		for _, tk := range tks {
			time.Sleep(gap)
			start := time.Now()
			_, err = src.Write(ctx, desc, tk, []rdma.Extent{{Region: sr.ID(), Length: uint64(size)}})
			require.NoError(t, err)
			took = append(took, time.Since(start).Seconds())
		}
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
// "grant k" line k tickets (a JSON array), and for each "wait" line
// "landed" once the grants open landed and verified.
func TestGoReceiverProcess(t *testing.T) {
	spec := strings.Fields(os.Getenv(goReceiverEnv))
	if len(spec) != 4 {
		t.Skip("SKIP: a child process of TestAgentMeasure")
	}
	size, err := strconv.ParseInt(spec[1], 10, 64)
	require.NoError(t, err)
	n, err := strconv.Atoi(spec[2])
	require.NoError(t, err)
	slots, err := strconv.Atoi(spec[3])
	require.NoError(t, err)
	e, err := rdma.New(rdma.Config{Agent: rdma.AgentID(fmt.Sprintf("go-dec-proc-%d", os.Getpid())), Transports: []rdma.Transport{rdma.Transport(spec[0])}, Logger: quietLogger()})
	require.NoError(t, err)
	defer e.Close()
	r, err := e.Register("kv", size*int64(slots))
	require.NoError(t, err)
	dests := make([][]rdma.Extent, slots)
	for i := range dests {
		dests[i] = reversedExtents(r.ID(), size, n)
		for j := range dests[i] {
			dests[i][j].Offset += uint64(i) * uint64(size)
		}
	}
	out := json.NewEncoder(helperProtocol())
	require.NoError(t, out.Encode(e.Descriptor()))
	in := bufio.NewScanner(os.Stdin)
	var open []*rdma.Grant
	for req := uint64(1); in.Scan(); {
		switch f := strings.Fields(in.Text()); f[0] {
		case "grant":
			k, err := strconv.Atoi(f[1])
			require.NoError(t, err)
			var tks []rdma.Ticket
			for i := range k {
				g, err := e.OpenGrant(rdma.GrantSpec{RequestID: req, Extents: dests[i]})
				require.NoError(t, err)
				req++
				open = append(open, g)
				tks = append(tks, g.Ticket())
			}
			require.NoError(t, out.Encode(tks))
		case "wait":
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			for _, g := range open {
				_, err := g.Wait(ctx)
				require.NoError(t, err)
			}
			cancel()
			open = nil
			require.NoError(t, out.Encode("landed"))
		}
	}
}
