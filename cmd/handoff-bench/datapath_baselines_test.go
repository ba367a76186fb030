package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/handoff-io/handoff/internal/leakcheck"
	"github.com/handoff-io/handoff/rdma"
	"github.com/stretchr/testify/require"
)

// iperf3Report is the shape of iperf3 3.12 -J output, trimmed.
const iperf3Report = `{
	"start": {"connected": [{"socket": 5, "local_host": "127.0.0.1", "remote_port": 5201}], "version": "iperf 3.12"},
	"intervals": [{"sum": {"bytes": 2818572288, "bits_per_second": 22548563298.1}}],
	"end": {
		"sum_sent": {"seconds": 1.0, "bytes": 2818572288, "bits_per_second": 22548578304, "retransmits": 0},
		"sum_received": {"seconds": 1.0003, "bytes": 2818441216, "bits_per_second": 18000000000}
	}
}`

func TestParseIperf3JSON(t *testing.T) {
	v, err := parseIperf3JSON([]byte(iperf3Report))
	require.NoError(t, err)
	require.InDelta(t, 2.25, v, 1e-9, "18 Gbit/s received is 2.25 GB/s")

	for _, bad := range []string{
		``, `not json`, `{}`,
		`{"error": "unable to connect to server: Connection refused"}`,
		`{"end": {"sum_received": {"bits_per_second": 0}}}`,
	} {
		_, err := parseIperf3JSON([]byte(bad))
		require.Error(t, err, bad)
	}
	_, err = parseIperf3JSON([]byte(`{"error": "the server is busy running a test"}`))
	require.ErrorContains(t, err, "server is busy")
}

const ucxFull = `+--------------+--------------+------------------------------+---------------------+-----------------------+
|              |              |       overhead (usec)        |   bandwidth (MB/s)  |  message rate (msg/s) |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
[thread 0]               979      1.383  4927.648  4173.883      202.94     239.59         203         240
Final:                  2000      1.233 69132.264  5718.205       14.47     174.88          14         175
+------------------------------------------------------------------------------------------+
| API:          protocol layer                                                             |
| Message size: 1048576                                                                    |
+------------------------------------------------------------------------------------------+
`

const ucxFinalOnly = `+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
|     Test     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
                       20000      1.973    20.241    20.241      192.98     4917.00       49404       49404
`

// ucxNoPercentile is an older layout without the percentile column.
const ucxNoPercentile = `Final:                  1000   212.142   212.142     4713.96    4713.96        4714        4714
`

func TestParseUCXPerftest(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   string
		want float64
	}{
		{"full report", ucxFull, 174.88},
		{"-f", ucxFinalOnly, 4917},
		{"no percentile column", ucxNoPercentile, 4713.96},
	} {
		v, err := parseUCXPerftest([]byte(tc.in))
		require.NoError(t, err, tc.name)
		require.InDelta(t, tc.want, v, 1e-9, tc.name)
	}
	for _, bad := range []string{"", "UCX ERROR client failed. connect() failed: Connection refused\n",
		"| Message size: 1048576 |\n", "Final: 1 2 3 4 0 0 0\n"} {
		_, err := parseUCXPerftest([]byte(bad))
		require.Error(t, err, bad)
	}
}

func TestUCXIterations(t *testing.T) {
	require.Equal(t, 2861, ucxIterations(1<<20, 3*time.Second, 1e9))
	require.Equal(t, 14305, ucxIterations(1<<20, 3*time.Second, 5e9))
	require.Equal(t, 100, ucxIterations(1<<30, time.Second, 1e9))
	require.Equal(t, 100, ucxIterations(4096, time.Second, 0), "a failed probe still measures something")
	require.Equal(t, 1_000_000, ucxIterations(8, 5*time.Second, 1e9))
}

func TestBaselinesNotInstalled(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	require.Equal(t, baseline{Name: "iperf3", Status: statusNotInstalled}, iperf3Baseline(context.Background(), time.Second))
	require.Equal(t, baseline{Name: "ucx_tag_bw", ExtentBytes: 4096, Status: statusNotInstalled},
		ucxBaseline(context.Background(), "ucx_tag_bw", "tag_bw", 4096, time.Second))
}

func TestMemcpyGBPerS(t *testing.T) {
	l, err := newLayout(4096, 256<<10, 1, 3)
	require.NoError(t, err)
	v, err := memcpyGBPerS(context.Background(), l, 50*time.Millisecond)
	require.NoError(t, err)
	require.Positive(t, v)

	// An ended context ends the copying, however long it was to run.
	cause := errors.New("interrupted")
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(cause)
	_, err = memcpyGBPerS(ctx, l, time.Hour)
	require.ErrorIs(t, err, cause)
}

func TestComputeRatios(t *testing.T) {
	tcp := datapathResult{Transport: rdma.TransportTCP, Streams: 1, TCPLanes: defaultTCPLanes, CRC: true}
	runs := []datapathResult{
		tcp, tcp,
		{Transport: rdma.TransportSHM, ExtentBytes: 1 << 20, GBPerS: 10, Streams: 1, CRC: true},
		{Transport: rdma.TransportInproc, ExtentBytes: 64 << 10, GBPerS: 8, Streams: 1, CRC: true},
	}
	runs[0].ExtentBytes, runs[0].GBPerS = 4<<10, 1.5
	runs[1].ExtentBytes, runs[1].GBPerS = 1<<20, 3
	bs := []baseline{
		{Name: "iperf3", GBPerS: 2, Status: statusOK},
		{Name: "tcp_raw", ExtentBytes: 1 << 20, GBPerS: 2.5, Status: statusOK},
		{Name: "tcp_raw", ExtentBytes: 4 << 10, Status: "failed: raw sink did not connect"},
		{Name: "memcpy", ExtentBytes: 1 << 20, GBPerS: 20, Status: statusOK},
		{Name: "memcpy", ExtentBytes: 64 << 10, GBPerS: 16, Status: statusOK},
		{Name: "ucx_tag_bw", ExtentBytes: 1 << 20, GBPerS: 5, Status: statusOK},
		{Name: "ucx_tag_bw", ExtentBytes: 4 << 10, Status: "failed: timeout"},
		{Name: "ucx_put_bw", ExtentBytes: 1 << 20, Status: statusNotInstalled},
	}
	require.Equal(t, []ratio{
		{Name: "tcp/iperf3", ExtentBytes: 4 << 10, Value: 0.75},
		{Name: "tcp 4KiB-vs-1MiB", ExtentBytes: 4 << 10, Value: 0.5, Target: targetSmallVsMiB},
		{Name: "tcp/iperf3", ExtentBytes: 1 << 20, Value: 1.5, Target: targetTCPvsIperf3},
		{Name: "tcp/tcp_raw", ExtentBytes: 1 << 20, Value: 1.2},
		{Name: "tcp/ucx_tag_bw", ExtentBytes: 1 << 20, Value: 0.6, Target: targetTCPvsUCXTag},
		{Name: "shm/memcpy", ExtentBytes: 1 << 20, Value: 0.5, Target: targetSHMvsMemcpy},
		{Name: "inproc/memcpy", ExtentBytes: 64 << 10, Value: 0.5},
	}, computeRatios(runs, bs))
	require.Equal(t, []ratio{{Name: "tcp 4KiB-vs-1MiB", ExtentBytes: 4 << 10, Value: 0.5, Target: targetSmallVsMiB}},
		computeRatios(runs, nil), "without baselines only the size ratio remains")

	// Settings other than those the targets were set for give the ratios
	// without targets.
	for name, change := range map[string]func(*datapathResult){
		"streams": func(r *datapathResult) { r.Streams = 4 },
		"lanes":   func(r *datapathResult) { r.TCPLanes = 2 },
		"crc":     func(r *datapathResult) { r.CRC = false },
	} {
		other := slices.Clone(runs)
		for i := range other {
			change(&other[i])
		}
		want := computeRatios(runs, bs)
		for i, r := range computeRatios(other, bs) {
			if name == "lanes" && !strings.HasPrefix(r.Name, "tcp") {
				require.Equal(t, want[i], r, "lanes are tcp's")
				continue
			}
			require.Zero(t, r.Target, "%s with other %s", r.Name, name)
		}
	}
	// A size ratio needs both runs in the target's settings.
	other := slices.Clone(runs)
	other[1].Streams = 2
	for _, r := range computeRatios(other, nil) {
		require.Zero(t, r.Target, r.Name)
	}
}

func TestMedians(t *testing.T) {
	runs := []datapathResult{{GBPerS: 3, Grants: 3}, {GBPerS: 1, Grants: 1}, {GBPerS: 2, Grants: 2}, {GBPerS: 4, Grants: 4}}
	m := medianRun(runs)
	require.Equal(t, uint64(2), m.Grants, "lower middle of four")
	require.Equal(t, []float64{3, 1, 2, 4}, m.Repeats, "in measurement order")
	require.Nil(t, medianRun(runs[:1]).Repeats)

	reps := [][]baseline{
		{{Name: "iperf3", GBPerS: 2, Status: statusOK}, {Name: "ucx_tag_bw", Status: "failed: x"}, {Name: "ucx_put_bw", Status: statusNotInstalled}},
		{{Name: "iperf3", GBPerS: 3, Status: statusOK}, {Name: "ucx_tag_bw", GBPerS: 5, Status: statusOK}, {Name: "ucx_put_bw", Status: statusNotInstalled}},
		{{Name: "iperf3", GBPerS: 1, Status: statusOK}, {Name: "ucx_tag_bw", GBPerS: 7, Status: statusOK}, {Name: "ucx_put_bw", Status: statusNotInstalled}},
	}
	require.Equal(t, []baseline{
		{Name: "iperf3", GBPerS: 2, Status: statusOK},
		{Name: "ucx_tag_bw", GBPerS: 5, Status: statusOK},
		{Name: "ucx_put_bw", Status: statusNotInstalled},
	}, medianBaselines(reps))
	require.Nil(t, medianBaselines(nil))
}

// The raw socket baseline runs its sink as a child process (this test
// binary, through TestMain) and checks that every byte sent was read.
func TestRawTCPBaseline(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a child process")
	}
	leakcheck.Check(t)
	t.Setenv(testRoleEnv, "receiver")
	l, err := newLayout(64<<10, 1<<20, 1, 2)
	require.NoError(t, err)
	b := rawTCPBaseline(context.Background(), l, 200*time.Millisecond)
	require.Equal(t, statusOK, b.Status, b.Command)
	require.Equal(t, "tcp_raw", b.Name)
	require.Equal(t, uint64(64<<10), b.ExtentBytes)
	require.Positive(t, b.GBPerS)
}

// The sink counts what it read up to the end of the stream, a partial
// extent included, so a short stream does not pass for a whole one.
func TestServeRawSinkCounts(t *testing.T) {
	leakcheck.Check(t)
	l, err := newLayout(4<<10, 16<<10, 1, 2)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	var out bytes.Buffer
	done := make(chan error, 1)
	go func() { done <- serveRawSink(context.Background(), ln.Addr().String(), l, &out) }()
	c, err := ln.Accept()
	require.NoError(t, err)
	const sent = 10*4<<10 + 1000 // two grants and a half extent over
	_, err = c.Write(make([]byte, sent))
	require.NoError(t, err)
	require.NoError(t, c.Close())
	require.NoError(t, <-done)
	require.Equal(t, fmt.Sprintln(sent), out.String())
}

// A failed iperf3 (here a stand-in that announces itself, then fails as a
// client with a few lines on stderr and no report) has a one-line status.
func TestIperf3FailureStatusOneLine(t *testing.T) {
	dir := t.TempDir()
	script := `#!/bin/sh
case " $* " in
*" -s "*) echo "Server listening on 5201"; exec sleep 60 ;;
esac
printf 'iperf3: error - unable to connect\nsecond line\n' >&2
exit 1
`
	require.NoError(t, os.WriteFile(filepath.Join(dir, "iperf3"), []byte(script), 0o755))
	t.Setenv("PATH", dir+string(os.PathListSeparator)+os.Getenv("PATH"))
	b := iperf3Baseline(context.Background(), time.Second)
	require.True(t, strings.HasPrefix(b.Status, "failed: "), b.Status)
	require.NotContains(t, b.Status, "\n")
	require.Contains(t, b.Status, "exit status 1")

	var tab bytes.Buffer
	require.NoError(t, report{Baselines: []baseline{b, failed("x", 0, "", errors.Join(errors.New("a"), errors.New("b")))}}.write(&tab, "table"))
	_, rows, ok := strings.Cut(tab.String(), "\nbaseline")
	require.True(t, ok, tab.String())
	lines := strings.Split(strings.TrimSpace(rows), "\n")
	require.Len(t, lines, 3, "a header and one line per baseline:\n%s", tab.String())
	require.True(t, strings.HasPrefix(lines[1], "iperf3 "), lines[1])
	require.True(t, strings.HasPrefix(lines[2], "x "), lines[2])
}

// Without a tcp run the tcp baselines are not measured, and say so.
func TestBaselinesSkippedWithoutTCP(t *testing.T) {
	t.Setenv("PATH", t.TempDir()) // were they run, they would say "not installed"
	o, err := parseDatapathFlags([]string{"--transport", "shm,inproc", "--extent", "4KiB", "--grant-bytes", "64KiB", "--duration", "1ms"}, io.Discard)
	require.NoError(t, err)
	got := map[string]string{}
	for _, b := range measureBaselines(context.Background(), o, nil) {
		got[b.Name] = b.Status
	}
	require.Equal(t, map[string]string{"iperf3": statusNoTCPRun, "tcp_raw": statusNoTCPRun, "memcpy": statusOK,
		"ucx_tag_bw": statusNoTCPRun, "ucx_put_bw": statusNoTCPRun}, got)
}
