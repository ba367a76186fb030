package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/handoff-io/handoff/internal/leakcheck"
	"github.com/handoff-io/handoff/internal/size"
	"github.com/handoff-io/handoff/rdma"
	"github.com/stretchr/testify/require"
)

// testRoleEnv makes the test binary act as handoff-bench itself (the
// receiver child, or the whole command), so the two-process path and the
// command's signal handling run under go test.
const testRoleEnv = "HANDOFF_BENCH_TEST_ROLE"

func TestMain(m *testing.M) {
	if os.Getenv(testRoleEnv) != "" {
		os.Exit(runMain(os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

func quietLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

func TestFormatSize(t *testing.T) {
	for n, want := range map[uint64]string{0: "0B", 100: "100B", 4096: "4KiB", 4097: "4097B", 1 << 20: "1MiB",
		3 << 19: "1.5MiB", 8 << 30: "8GiB", 1 << 40: "1TiB"} {
		require.Equal(t, want, formatSize(n))
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 1000 {
		n := r.Uint64N(1 << 34)
		if s := formatSize(n); !strings.Contains(s, ".") {
			back, err := size.Parse(s)
			require.NoError(t, err)
			require.Equal(t, n, uint64(back), s)
		}
	}
}

func TestParseDatapathFlags(t *testing.T) {
	o, err := parseDatapathFlags(nil, io.Discard)
	require.NoError(t, err)
	require.Equal(t, []rdma.Transport{rdma.TransportTCP}, o.transports)
	require.Equal(t, []uint64{1 << 20}, o.extents)
	require.Equal(t, 5*time.Second, o.duration)
	require.Equal(t, 1, o.streams)
	require.Equal(t, "table", o.output)

	o, err = parseDatapathFlags([]string{"--transport", "tcp,shm,inproc,tcp", "--extent", "4KiB,1MiB", "--streams", "2",
		"--duration", "2s", "--output", "json", "--baselines"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, []rdma.Transport{"tcp", "shm", "inproc"}, o.transports)
	require.Equal(t, []uint64{4096, 1 << 20}, o.extents)
	require.True(t, o.baselines)

	for _, args := range [][]string{
		{"--transport", "udp"},
		{"--extent", "0"},
		{"--extent", "huge"},
		{"--duration", "0s"},
		{"--output", "xml"},
		{"--streams", "0"},
		{"--depth", "0"},
		{"--grant-bytes", "8GiB"},
		{"--role", "writer"},
		{"--repeat", "0"},
		{"--tcp-lanes", "0"},
		{"extra"},
		{"--streams", "64", "--depth", "16", "--grant-bytes", "1GiB"}, // 2 TiB of destination
	} {
		_, err := parseDatapathFlags(args, io.Discard)
		require.Error(t, err, "%v", args)
	}

	var help bytes.Buffer
	_, err = parseDatapathFlags([]string{"-h"}, &help)
	require.ErrorIs(t, err, flag.ErrHelp)
	require.Contains(t, help.String(), "--transport")
	require.NotContains(t, help.String(), "role", "the child's flag stays hidden")
}

func TestLayout(t *testing.T) {
	l, err := newLayout(1<<20, 8<<20, 2, 2)
	require.NoError(t, err)
	require.Equal(t, 8, l.PerGrant)
	require.Equal(t, uint64(64<<20), l.regionBytes())
	require.Equal(t, uint64(32<<20), l.sourceBytes())

	l, err = newLayout(3<<20, 1<<20, 1, 1) // grant smaller than one extent: one extent
	require.NoError(t, err)
	require.Equal(t, 1, l.PerGrant)

	_, err = l.slotIndex(1, 0)
	require.Error(t, err)
	_, err = l.slotIndex(0, -1)
	require.Error(t, err)

	// Property: every slot's extents lie inside the region, none touch or
	// overlap another (same or other slot).
	r := rand.New(rand.NewPCG(3, 4))
	for range 200 {
		extent := uint64(1+r.IntN(64)) << (r.IntN(3) * 4)
		l, err := newLayout(extent, extent*uint64(r.IntN(64)), 1+r.IntN(4), 1+r.IntN(4))
		require.NoError(t, err)
		var all []rdma.Extent
		for i := range l.slots() {
			xs := l.extents(7, i)
			require.Len(t, xs, l.PerGrant)
			all = append(all, xs...)
		}
		for i, a := range all {
			require.Equal(t, rdma.RegionID(7), a.Region)
			require.Equal(t, l.Extent, a.Length)
			require.LessOrEqual(t, a.Offset+a.Length, l.regionBytes())
			if i > 0 {
				require.Greater(t, a.Offset, all[i-1].Offset+all[i-1].Length, "a gap between extents")
			}
		}
	}
}

func TestDecodeCtrl(t *testing.T) {
	for _, line := range []string{
		``, `{`, `[]`, `{"type":"bogus"}`, `{"type":"hello"}`, `{"type":"ticket"}`, `{"type":"stats"}`,
		`{"type":"open","stream":"x"}`,
	} {
		_, err := decodeCtrl([]byte(line))
		require.Error(t, err, line)
	}
	m, err := decodeCtrl([]byte(`{"type":"open","stream":1,"slot":2,"request_id":9}`))
	require.NoError(t, err)
	require.Equal(t, ctrlMsg{Type: "open", Stream: 1, Slot: 2, RequestID: 9}, m)

	// Round trip through the writer and reader.
	var buf bytes.Buffer
	w := newCtrlWriter(&buf)
	tk := wireTicket{Grant: 5, Epoch: 6, Token: [16]byte{1, 2, 3}, RequestID: 7, Bytes: 8, Deadline: time.Unix(100, 0).UTC()}
	d := rdma.Descriptor{Agent: "a", Transports: []rdma.Transport{"tcp"}}
	in := []ctrlMsg{{Type: "hello", Descriptor: &d}, {Type: "ticket", Stream: 1, Ticket: &tk}, {Type: "stats", Stats: &receiverStats{Committed: 1, Bytes: 2}}, {Type: "stop"}}
	for _, m := range in {
		require.NoError(t, w.send(m))
	}
	r := newCtrlReader(&buf)
	for _, want := range in {
		got, err := r.next()
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	_, err = r.next()
	require.ErrorIs(t, err, io.EOF)

	// An over-long line is an error, not a hang or a silent truncation.
	_, err = newCtrlReader(strings.NewReader(strings.Repeat("x", maxCtrlLine+10) + "\n")).next()
	require.Error(t, err)
	require.NotErrorIs(t, err, io.EOF)
}

func FuzzDecodeCtrl(f *testing.F) {
	for _, s := range []string{`{"type":"open","stream":1,"slot":2,"request_id":9}`, `{"type":"stop"}`,
		`{"type":"ticket","ticket":{"grant":1,"token":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16],"deadline":"2026-01-01T00:00:00Z"}}`,
		`{"type":"hello","descriptor":{"agent":"x","regions":[{"id":1,"length":4}]}}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeCtrl(b)
		if err != nil {
			return
		}
		switch m.Type {
		case "hello":
			require.NotNil(t, m.Descriptor)
		case "ticket":
			require.NotNil(t, m.Ticket)
		case "stats":
			require.NotNil(t, m.Stats)
		case "open", "stop", "error":
		default:
			t.Fatalf("accepted type %q", m.Type)
		}
	})
}

// TestReceiverRefusesBadRequests drives serveReceiver by hand.
func TestReceiverRefusesBadRequests(t *testing.T) {
	leakcheck.Check(t)
	l, err := newLayout(4096, 16384, 1, 2)
	require.NoError(t, err)
	for _, tc := range []struct {
		name string
		send []string
		want string
	}{
		{"slot out of range", []string{`{"type":"open","stream":0,"slot":2,"request_id":1}`}, "outside"},
		{"request id 0", []string{`{"type":"open","stream":0,"slot":0}`}, "request id 0"},
		{"garbage", []string{`{nope`}, "bad message"},
		{"writer sends a ticket", []string{`{"type":"ticket","ticket":{}}`}, "unexpected"},
		{"closed before stop", nil, "closed before stop"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var in io.Reader = strings.NewReader("")
			if tc.send != nil {
				in = strings.NewReader(strings.Join(tc.send, "\n") + "\n")
			}
			var out bytes.Buffer
			cfg := receiverConfig{Transport: rdma.TransportTCP, Layout: l, Logger: quietLogger(), GrantTTL: time.Second}
			err := serveReceiver(context.Background(), cfg, in, &out)
			require.ErrorContains(t, err, tc.want)
			r := newCtrlReader(&out)
			m, err := r.next()
			require.NoError(t, err)
			require.Equal(t, "hello", m.Type)
			m, err = r.next()
			require.NoError(t, err)
			require.Equal(t, "error", m.Type)
			require.Contains(t, m.Error, tc.want)
		})
	}
}

// TestReceiverStats: grants opened and never written are revoked at stop and
// counted as unused; nothing is reported committed.
func TestReceiverStats(t *testing.T) {
	leakcheck.Check(t)
	l, err := newLayout(4096, 16384, 2, 2)
	require.NoError(t, err)
	in := strings.NewReader(`{"type":"open","stream":0,"slot":0,"request_id":1}
{"type":"open","stream":1,"slot":1,"request_id":2}
{"type":"stop"}
`)
	var out bytes.Buffer
	cfg := receiverConfig{Transport: rdma.TransportInproc, Layout: l, Logger: quietLogger(), GrantTTL: 5 * time.Second}
	require.NoError(t, serveReceiver(context.Background(), cfg, in, &out))
	r := newCtrlReader(&out)
	var types []string
	var last ctrlMsg
	for {
		m, err := r.next()
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		types = append(types, m.Type)
		last = m
		if m.Type == "ticket" {
			require.Equal(t, l.grantBytes(), m.Ticket.Bytes)
		}
	}
	require.Equal(t, []string{"hello", "ticket", "ticket", "stats"}, types)
	require.Equal(t, receiverStats{Unused: 2}, *last.Stats)
}

func runShort(t *testing.T, tr rdma.Transport, extent uint64, streams int, sp spawner) datapathResult {
	t.Helper()
	l, err := newLayout(extent, 1<<20, streams, 2)
	require.NoError(t, err)
	r, err := runOnce(context.Background(), tr, l, 300*time.Millisecond, quietLogger(), sp, nil)
	require.NoError(t, err)
	require.Equal(t, tr, r.Transport)
	require.Positive(t, r.Grants)
	require.Equal(t, r.Grants*l.grantBytes(), r.Bytes)
	require.InDelta(t, float64(r.Bytes)/r.Seconds/1e9, r.GBPerS, 1e-9)
	require.GreaterOrEqual(t, r.Seconds, 0.3)
	require.LessOrEqual(t, r.GrantP50Ms, r.GrantP99Ms)
	return r
}

func TestRunInproc(t *testing.T) {
	leakcheck.Check(t)
	r := runShort(t, rdma.TransportInproc, 4096, 2, goroutineSpawner{})
	require.Equal(t, 1, r.Processes)
	require.Equal(t, 256, r.ExtentsPerGrant)
}

func TestRunTCPSingleProcess(t *testing.T) {
	leakcheck.Check(t)
	runShort(t, rdma.TransportTCP, 64<<10, 1, goroutineSpawner{})
}

func TestRunTwoProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a child process")
	}
	leakcheck.Check(t)
	sp := childSpawner{env: []string{testRoleEnv + "=receiver"}}
	r := runShort(t, rdma.TransportTCP, 1<<20, 1, sp)
	require.Equal(t, 2, r.Processes)
}

// The engine settings reach the child receiver: a crc-less commit is
// accepted only by a receiver that skips crc too, and 4 MiB grants of 1 MiB
// extents are striped over the lanes.
func TestRunTwoProcessesSettings(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a child process")
	}
	leakcheck.Check(t)
	o, err := parseDatapathFlags([]string{"--grant-bytes", "4MiB", "--tcp-lanes", "3", "--skip-crc"}, io.Discard)
	require.NoError(t, err)
	l, err := o.layout(1 << 20)
	require.NoError(t, err)
	sp := childSpawner{env: []string{testRoleEnv + "=receiver"}}
	r, err := runOnce(context.Background(), rdma.TransportTCP, l, 300*time.Millisecond, quietLogger(), sp, nil)
	require.NoError(t, err)
	require.Positive(t, r.Grants)
	require.Equal(t, 3, r.TCPLanes)
	require.False(t, r.CRC)
}

// failingSpawner starts a receiver with a real engine that says hello, reads
// the first request, answers it with reply (nothing when empty) and hangs up.
type failingSpawner struct{ reply string }

func (f failingSpawner) spawn(ctx context.Context, t rdma.Transport, l layout, logger *slog.Logger) (*receiverHandle, error) {
	eng, err := rdma.New(rdma.Config{Agent: agentID("ghost"), Transports: []rdma.Transport{t}, Logger: logger})
	if err != nil {
		return nil, err
	}
	if _, err := eng.Register("dst", int64(l.regionBytes())); err != nil {
		eng.Close()
		return nil, err
	}
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	done := make(chan error, 1)
	go func() {
		defer eng.Close()
		d := eng.Descriptor()
		_ = newCtrlWriter(outW).send(ctrlMsg{Type: "hello", Descriptor: &d})
		_, _ = newCtrlReader(inR).next()
		if f.reply != "" {
			_, _ = io.WriteString(outW, f.reply+"\n")
		}
		_ = outW.Close()
		_ = inR.Close()
		done <- nil
	}()
	return &receiverHandle{in: inW, out: outR, wait: func() error { return <-done }, processes: 1}, nil
}

func TestRunReceiverFailures(t *testing.T) {
	leakcheck.Check(t)
	l, err := newLayout(4096, 65536, 1, 2)
	require.NoError(t, err)
	for _, tc := range []struct {
		name, reply, want string
	}{
		{"hangs up", "", "control channel"},
		{"reports an error", `{"type":"error","error":"out of memory"}`, "out of memory"},
		{"sends garbage", `{"type":"ticket"}`, "without ticket"},
		{"ticket for another stream", `{"type":"ticket","stream":5,"ticket":{}}`, "stream 5"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := runOnce(context.Background(), rdma.TransportInproc, l, 5*time.Second, quietLogger(), failingSpawner{tc.reply}, nil)
			require.ErrorContains(t, err, tc.want)
		})
	}
	// A descriptor whose region does not match the layout is refused before any write.
	bad, err := newLayout(4096, 65536, 1, 3)
	require.NoError(t, err)
	_, err = runOnce(context.Background(), rdma.TransportInproc, l, time.Second, quietLogger(), mismatchSpawner{bad}, nil)
	require.ErrorContains(t, err, "want one of")
}

// mismatchSpawner runs a real receiver with another layout.
type mismatchSpawner struct{ l layout }

func (m mismatchSpawner) spawn(ctx context.Context, t rdma.Transport, _ layout, logger *slog.Logger) (*receiverHandle, error) {
	return goroutineSpawner{}.spawn(ctx, t, m.l, logger)
}

func TestMeasureDatapathReport(t *testing.T) {
	leakcheck.Check(t)
	o, err := parseDatapathFlags([]string{"--transport", "inproc", "--extent", "4KiB,64KiB", "--duration", "200ms",
		"--grant-bytes", "256KiB", "--repeat", "3"}, io.Discard)
	require.NoError(t, err)
	rep, err := measureDatapath(context.Background(), o, quietLogger(), goroutineSpawner{}, nil)
	require.NoError(t, err)
	require.Len(t, rep.Runs, 2)
	for _, r := range rep.Runs {
		require.Len(t, r.Repeats, 3)
		sorted := slices.Clone(r.Repeats)
		slices.Sort(sorted)
		require.Equal(t, sorted[1], r.GBPerS, "the median repetition is reported")
	}

	var js bytes.Buffer
	require.NoError(t, rep.write(&js, "json"))
	var multi struct {
		Runs []map[string]any `json:"runs"`
	}
	require.NoError(t, json.Unmarshal(js.Bytes(), &multi))
	require.Len(t, multi.Runs, 2)

	js.Reset()
	single := report{Runs: rep.Runs[:1], Baselines: []baseline{{Name: "iperf3", Status: statusNotInstalled}}}
	require.NoError(t, single.write(&js, "json"))
	var flat map[string]any
	require.NoError(t, json.Unmarshal(js.Bytes(), &flat))
	for _, k := range []string{"transport", "extent_bytes", "bytes", "seconds", "gb_per_s", "streams", "baselines"} {
		require.Contains(t, flat, k)
	}
	require.Equal(t, "inproc", flat["transport"])
	require.EqualValues(t, 4096, flat["extent_bytes"])

	var tab bytes.Buffer
	require.NoError(t, rep.write(&tab, "table"))
	require.Contains(t, tab.String(), fmt.Sprintf("%.2f %.2f %.2f", rep.Runs[0].Repeats[0], rep.Runs[0].Repeats[1], rep.Runs[0].Repeats[2]))
	tab.Reset()
	require.NoError(t, single.write(&tab, "table"))
	require.Contains(t, tab.String(), "inproc")
	require.Contains(t, tab.String(), "not installed")
}

func TestHelp(t *testing.T) {
	for _, arg := range []string{"--help", "-h", "help"} {
		var out, errOut bytes.Buffer
		require.Equal(t, 0, runMain([]string{arg}, &out, &errOut), arg)
		for _, sub := range []string{"datapath", "control", "topology"} {
			require.Contains(t, out.String(), sub, arg)
		}
		require.Empty(t, errOut.String(), arg)
	}
	var out, errOut bytes.Buffer
	require.NotEqual(t, 0, runMain(nil, &out, &errOut))
	require.Contains(t, errOut.String(), "datapath")
	require.NotEqual(t, 0, runMain([]string{"bogus"}, &out, &errOut))
}

// A run that moves nothing measured nothing: an error, not a zero rate.
func TestRunTooShort(t *testing.T) {
	leakcheck.Check(t)
	l, err := newLayout(4096, 65536, 1, 2)
	require.NoError(t, err)
	_, err = runOnce(context.Background(), rdma.TransportInproc, l, time.Nanosecond, quietLogger(), goroutineSpawner{}, nil)
	require.ErrorContains(t, err, "no grant was written")
}

// cancelWriter ends a context when what is written to it contains a word.
type cancelWriter struct {
	word   string
	cancel context.CancelCauseFunc
	cause  error
}

func (c cancelWriter) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte(c.word)) {
		c.cancel(c.cause)
	}
	return len(p), nil
}

// An interruption during the baselines (here, as memcpy starts, with a
// second repetition to come) ends the measurement with the interruption and
// nothing else: no report, no failed receiver start.
func TestMeasureInterruptedInBaselines(t *testing.T) {
	leakcheck.Check(t)
	t.Setenv("PATH", t.TempDir())
	o, err := parseDatapathFlags([]string{"--transport", "inproc", "--extent", "4KiB", "--grant-bytes", "64KiB",
		"--duration", "1h", "--baselines", "--repeat", "2"}, io.Discard)
	require.NoError(t, err)
	o.duration = 100 * time.Millisecond // the runs; the baselines still take baselineTime(1h) each unless cut short
	cause := fmt.Errorf("interrupted")
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	rep, err := measureDatapath(ctx, o, quietLogger(), goroutineSpawner{}, cancelWriter{"baseline: memcpy", cancel, cause})
	require.ErrorIs(t, err, cause)
	require.Equal(t, cause.Error(), err.Error())
	require.Empty(t, rep.Runs)
}

// hookSpawner wraps a spawner: onOut runs on each read from the receiver,
// with what was read, and onAbort after the receiver's own abort.
type hookSpawner struct {
	sp      spawner
	onOut   func(rx *receiverHandle, p []byte)
	onAbort func(rx *receiverHandle)
}

type hookReader struct {
	r  io.Reader
	fn func([]byte)
}

func (h hookReader) Read(p []byte) (int, error) {
	n, err := h.r.Read(p)
	h.fn(p[:n])
	return n, err
}

func (h hookSpawner) spawn(ctx context.Context, t rdma.Transport, l layout, logger *slog.Logger) (*receiverHandle, error) {
	rx, err := h.sp.spawn(ctx, t, l, logger)
	if err != nil {
		return nil, err
	}
	if h.onOut != nil {
		rx.out = hookReader{rx.out, func(p []byte) { h.onOut(rx, p) }}
	}
	if abort := rx.abort; h.onAbort != nil {
		rx.abort = func() { abort(); h.onAbort(rx) }
	}
	return rx, nil
}

func shmSockets(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, "*.sock"))
	require.NoError(t, err)
	return m
}

// An shm run cancelled while it writes (as by a signal) stops its child
// receiver gently: the child closes its engine, which removes its socket.
func TestRunCancelledLeavesNoSocket(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a child process")
	}
	leakcheck.Check(t)
	dir := t.TempDir()
	l, err := newLayout(1<<20, 1<<20, 1, 2)
	require.NoError(t, err)
	cause := fmt.Errorf("interrupted")
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	var sockets []string
	sp := hookSpawner{
		sp: childSpawner{env: []string{testRoleEnv + "=receiver", "TMPDIR=" + dir}},
		onOut: func(_ *receiverHandle, p []byte) {
			if bytes.Contains(p, []byte(`"ticket"`)) && ctx.Err() == nil {
				sockets, _ = filepath.Glob(filepath.Join(dir, "*.sock"))
				cancel(cause)
			}
		},
	}
	_, err = runOnce(ctx, rdma.TransportSHM, l, time.Hour, quietLogger(), sp, nil)
	require.ErrorIs(t, err, cause)
	require.Len(t, sockets, 1, "the receiver's socket is where this test looks")
	require.Empty(t, shmSockets(t, dir))
}

// A receiver that stops answering (SIGSTOP once it has handed out a ticket)
// fails the run at the grant's TTL instead of holding it forever; the
// stopped child is then aborted.
func TestRunStuckReceiver(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a child process")
	}
	leakcheck.Check(t)
	dir := t.TempDir()
	l, err := newLayout(1<<20, 1<<20, 1, 2)
	require.NoError(t, err)
	l.GrantTTL = 2 * time.Second
	var stopped atomic.Bool
	sp := hookSpawner{
		sp: childSpawner{env: []string{testRoleEnv + "=receiver", "TMPDIR=" + dir}},
		onOut: func(rx *receiverHandle, p []byte) {
			if bytes.Contains(p, []byte(`"ticket"`)) && !stopped.Swap(true) {
				_ = syscall.Kill(rx.pid, syscall.SIGSTOP)
			}
		},
		// Let the aborted child run, so that it exits on SIGTERM and this
		// test also sees it clean up.
		onAbort: func(rx *receiverHandle) { _ = syscall.Kill(rx.pid, syscall.SIGCONT) },
	}
	_, err = runOnce(context.Background(), rdma.TransportSHM, l, time.Hour, quietLogger(), sp, nil)
	require.True(t, stopped.Load())
	// Two bounds of the grant's TTL race here, both right: the write's
	// deadline, or the wait for the next ticket (depth 2).
	require.Error(t, err)
	require.Regexp(t, `deadline|sent no ticket within 2s`, err.Error())
	require.Empty(t, shmSockets(t, dir))
}

// The command interrupted by SIGINT during an shm run exits nonzero, says
// it was interrupted, prints no report and leaves no socket behind.
func TestCommandInterrupted(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns processes")
	}
	exe, err := os.Executable()
	require.NoError(t, err)
	dir := t.TempDir()
	cmd := exec.Command(exe, "datapath", "--transport", "shm", "--duration", "1h", "--verbose")
	cmd.Env = append(os.Environ(), testRoleEnv+"=main", "TMPDIR="+dir)
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	// The writer logs its transport choice just before it starts writing.
	sc := bufio.NewScanner(stderr)
	var log strings.Builder
	for sc.Scan() {
		log.WriteString(sc.Text() + "\n")
		if strings.Contains(sc.Text(), "transport chosen") {
			break
		}
	}
	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	rest, _ := io.ReadAll(stderr)
	log.Write(rest)
	err = cmd.Wait()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, log.String())
	require.NotEqual(t, 0, ee.ExitCode(), log.String())
	require.Contains(t, log.String(), "handoff-bench: interrupted")
	require.Empty(t, stdout.String())
	require.Empty(t, shmSockets(t, dir))
}
