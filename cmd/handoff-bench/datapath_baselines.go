package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/handoff-io/handoff/rdma"
)

const (
	statusOK           = "ok"
	statusNotInstalled = "not installed"
	statusNoTCPRun     = "skipped: no tcp run" // the tcp baselines compare with tcp runs only
)

// baseline is one reference figure measured on this machine in this run.
type baseline struct {
	Name        string  `json:"name"` // iperf3, tcp_raw, memcpy, ucx_tag_bw, ucx_put_bw
	ExtentBytes uint64  `json:"extent_bytes,omitempty"`
	GBPerS      float64 `json:"gb_per_s,omitempty"`
	Status      string  `json:"status"` // ok, not installed, or what went wrong
	Command     string  `json:"command,omitempty"`
}

// ratio compares a run with a baseline, or an extent size with the largest
// one measured for the same transport.
type ratio struct {
	Name        string  `json:"name"`
	ExtentBytes uint64  `json:"extent_bytes"`
	Value       float64 `json:"value"`
	Target      float64 `json:"target,omitempty"` // the project's goal, where it has one
}

// baselineTime bounds each baseline measurement.
func baselineTime(d time.Duration) time.Duration { return min(max(d, time.Second), 5*time.Second) }

// measureBaselines measures the baselines in a fixed order (the same entries
// every repetition). The tcp ones are skipped when no tcp run is measured.
// It stops early when ctx ends; the caller then discards what it returns.
func measureBaselines(ctx context.Context, o datapathOptions, progress io.Writer) []baseline {
	dur := baselineTime(o.duration)
	note := func(s string) {
		if progress != nil {
			fmt.Fprintf(progress, "\r\033[Kbaseline: %s", s)
		}
	}
	defer note("")
	tcp := slices.Contains(o.transports, rdma.TransportTCP)
	var out []baseline
	steps := []func() baseline{func() baseline {
		if !tcp {
			return baseline{Name: "iperf3", Status: statusNoTCPRun}
		}
		note("iperf3")
		return iperf3Baseline(ctx, dur)
	}}
	for _, e := range o.extents {
		steps = append(steps, func() baseline {
			if !tcp {
				return baseline{Name: "tcp_raw", ExtentBytes: e, Status: statusNoTCPRun}
			}
			note("tcp_raw " + formatSize(e))
			l, _ := newLayout(e, o.grantBytes, 1, o.depth)
			return rawTCPBaseline(ctx, l, dur)
		})
	}
	for _, e := range o.extents {
		steps = append(steps, func() baseline {
			note("memcpy " + formatSize(e))
			l, _ := newLayout(e, o.grantBytes, 1, o.depth)
			const cmd = "Go copy(), one goroutine, the extents and memory footprint of one stream"
			v, err := memcpyGBPerS(ctx, l, dur)
			if err != nil {
				return failed("memcpy", e, cmd, err)
			}
			return baseline{Name: "memcpy", ExtentBytes: e, GBPerS: v, Status: statusOK, Command: cmd}
		})
	}
	for _, test := range []struct{ name, ucx string }{{"ucx_tag_bw", "tag_bw"}, {"ucx_put_bw", "ucp_put_bw"}} {
		for _, e := range o.extents {
			steps = append(steps, func() baseline {
				if !tcp {
					return baseline{Name: test.name, ExtentBytes: e, Status: statusNoTCPRun}
				}
				note(test.name + " " + formatSize(e))
				return ucxBaseline(ctx, test.name, test.ucx, e, dur)
			})
		}
	}
	for _, step := range steps {
		if ctx.Err() != nil {
			break
		}
		out = append(out, step())
	}
	return out
}

// medianBaselines folds repeated baseline measurements: per entry, the
// median rate of the repetitions that succeeded; the first failure's status
// when none did.
func medianBaselines(reps [][]baseline) []baseline {
	if len(reps) == 0 {
		return nil
	}
	out := slices.Clone(reps[0])
	for i := range out {
		var rates []float64
		for _, rep := range reps {
			if i < len(rep) && rep[i].Status == statusOK {
				rates = append(rates, rep[i].GBPerS)
			}
		}
		if len(rates) == 0 {
			continue
		}
		slices.Sort(rates)
		out[i].GBPerS, out[i].Status = rates[(len(rates)-1)/2], statusOK
	}
	return out
}

// memcpyGBPerS copies the extents of one stream's grants, the same extents
// from the same source into its Depth destination slots in turn (the memory
// a run touches), on one goroutine for about dur, or until ctx ends (an
// error then).
func memcpyGBPerS(ctx context.Context, l layout, dur time.Duration) (float64, error) {
	src := make([]byte, l.span())
	dst := make([]byte, uint64(l.Depth)*l.span())
	for i := range src {
		src[i] = byte(i * 7)
	}
	xs := l.extents(0, 0)
	var n uint64
	start := time.Now()
	for slot := 0; time.Since(start) < dur; slot = (slot + 1) % l.Depth {
		if err := ctx.Err(); err != nil {
			return 0, context.Cause(ctx)
		}
		d := dst[uint64(slot)*l.span():]
		for _, x := range xs {
			copy(d[x.Offset:x.Offset+x.Length], src[x.Offset:x.Offset+x.Length])
		}
		n += l.grantBytes()
	}
	return float64(n) / time.Since(start).Seconds() / 1e9, nil
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// failed is a baseline that went wrong; its status is one line (a table
// row), whatever err's text is.
func failed(name string, extent uint64, cmd string, err error) baseline {
	msg := strings.Join(strings.FieldsFunc(err.Error(), func(r rune) bool { return r == '\n' || r == '\r' }), "; ")
	return baseline{Name: name, ExtentBytes: extent, Status: "failed: " + msg, Command: cmd}
}

// iperf3Baseline runs a one-off iperf3 server and a single-stream client on
// loopback.
func iperf3Baseline(ctx context.Context, dur time.Duration) baseline {
	const name = "iperf3"
	if _, err := exec.LookPath("iperf3"); err != nil {
		return baseline{Name: name, Status: statusNotInstalled}
	}
	port, err := freePort()
	if err != nil {
		return failed(name, 0, "", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 2*dur+20*time.Second)
	defer cancel()
	p := strconv.Itoa(port)
	secs := strconv.Itoa(max(1, int(dur.Round(time.Second).Seconds())))
	clientCmd := "iperf3 -c 127.0.0.1 -p " + p + " -t " + secs + " -J"
	srv := exec.CommandContext(ctx, "iperf3", "-s", "-1", "-p", p, "--forceflush")
	stdout, err := srv.StdoutPipe()
	if err != nil {
		return failed(name, 0, clientCmd, err)
	}
	srv.Stderr = io.Discard
	if err := srv.Start(); err != nil {
		return failed(name, 0, clientCmd, err)
	}
	defer func() {
		_ = srv.Process.Kill()
		_ = srv.Wait()
	}()
	// The server announces itself before it accepts; a probe connection
	// would use up the one-off session.
	ready := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		found := false
		for sc.Scan() {
			if !found && strings.Contains(sc.Text(), "listening") {
				found = true
				ready <- true
			}
		}
		if !found {
			ready <- false
		}
	}()
	select {
	case ok := <-ready:
		if !ok {
			return failed(name, 0, clientCmd, errors.New("server exited before listening"))
		}
	case <-time.After(10 * time.Second):
		return failed(name, 0, clientCmd, errors.New("server did not start listening"))
	case <-ctx.Done():
		return failed(name, 0, clientCmd, context.Cause(ctx))
	}
	out, err := exec.CommandContext(ctx, "iperf3", "-c", "127.0.0.1", "-p", p, "-t", secs, "-J").Output()
	gbps, perr := parseIperf3JSON(out)
	if perr != nil {
		if err != nil {
			// The report says why when there is one; the exit status and
			// stderr when there is not.
			var ee *exec.ExitError
			if errors.As(err, &ee) && len(bytes.TrimSpace(ee.Stderr)) > 0 {
				err = fmt.Errorf("%w: %s", err, lastLine(ee.Stderr))
			}
			perr = fmt.Errorf("client: %v; %v", err, perr)
		}
		return failed(name, 0, clientCmd, perr)
	}
	return baseline{Name: name, GBPerS: gbps, Status: statusOK, Command: clientCmd}
}

// parseIperf3JSON returns the received rate of an iperf3 -J client report in
// GB/s (1e9 bytes).
func parseIperf3JSON(b []byte) (float64, error) {
	var r struct {
		Error string `json:"error"`
		End   struct {
			SumReceived struct {
				BitsPerSecond float64 `json:"bits_per_second"`
			} `json:"sum_received"`
		} `json:"end"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return 0, fmt.Errorf("iperf3 report: %w", err)
	}
	if r.Error != "" {
		return 0, fmt.Errorf("iperf3: %s", r.Error)
	}
	if r.End.SumReceived.BitsPerSecond <= 0 {
		return 0, errors.New("iperf3 report: no end.sum_received.bits_per_second")
	}
	return r.End.SumReceived.BitsPerSecond / 8 / 1e9, nil
}

// ucxIterations sizes a ucx_perftest run to about dur at rate bytes/s.
func ucxIterations(size uint64, dur time.Duration, rate float64) int {
	n := int(dur.Seconds() * rate / float64(size))
	return min(max(n, 100), 1_000_000)
}

// ucxBaseline runs ucx_perftest over TCP on loopback: a server and a client
// process, as in UCX_TLS=tcp ucx_perftest 127.0.0.1 -t tag_bw -s SIZE. A
// short probe run first sizes the measured run to about dur.
func ucxBaseline(ctx context.Context, name, test string, size uint64, dur time.Duration) baseline {
	if _, err := exec.LookPath("ucx_perftest"); err != nil {
		return baseline{Name: name, ExtentBytes: size, Status: statusNotInstalled}
	}
	probe, cmdline, err := runUCXPerftest(ctx, test, size, ucxIterations(size, dur/20, 1e9), dur)
	if err != nil {
		return failed(name, size, cmdline, fmt.Errorf("probe: %w", err))
	}
	mibps, cmdline, err := runUCXPerftest(ctx, test, size, ucxIterations(size, dur, probe*(1<<20)), dur)
	if err != nil {
		return failed(name, size, cmdline, err)
	}
	return baseline{Name: name, ExtentBytes: size, GBPerS: mibps * (1 << 20) / 1e9, Status: statusOK, Command: cmdline}
}

// runUCXPerftest runs one ucx_perftest server and client pair for n
// iterations and returns the client's overall bandwidth in MiB/s.
func runUCXPerftest(ctx context.Context, test string, size uint64, n int, dur time.Duration) (float64, string, error) {
	port, err := freePort()
	if err != nil {
		return 0, "", err
	}
	p, s := strconv.Itoa(port), strconv.FormatUint(size, 10)
	args := []string{"127.0.0.1", "-p", p, "-t", test, "-s", s, "-n", strconv.Itoa(n), "-w", strconv.Itoa(max(10, n/10)), "-f"}
	cmdline := "UCX_TLS=tcp ucx_perftest " + strings.Join(args, " ")
	parent := ctx
	ctx, cancel := context.WithTimeout(ctx, 6*dur+30*time.Second)
	defer cancel()
	env := append(os.Environ(), "UCX_TLS=tcp")
	srv := exec.CommandContext(ctx, "ucx_perftest", "-p", p)
	srv.Env = env
	srv.Stdout, srv.Stderr = io.Discard, io.Discard
	if err := srv.Start(); err != nil {
		return 0, cmdline, err
	}
	defer func() {
		_ = srv.Process.Kill()
		_ = srv.Wait()
	}()
	// The server binds its port some time after it starts: retry a client
	// that was refused (a refused connect never reaches the server).
	var out []byte
	for attempt := 0; ; attempt++ {
		c := exec.CommandContext(ctx, "ucx_perftest", args...)
		c.Env = env
		var buf bytes.Buffer
		c.Stdout, c.Stderr = &buf, &buf
		err = c.Run()
		out = buf.Bytes()
		if err == nil || !bytes.Contains(out, []byte("Connection refused")) || attempt >= 50 || ctx.Err() != nil {
			break
		}
		select {
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
		}
	}
	if parent.Err() != nil {
		return 0, cmdline, context.Cause(parent)
	}
	if ctx.Err() != nil {
		return 0, cmdline, fmt.Errorf("no result within %s", 6*dur+30*time.Second)
	}
	if err != nil {
		return 0, cmdline, fmt.Errorf("%w: %s", err, lastLine(out))
	}
	mibps, err := parseUCXPerftest(out)
	return mibps, cmdline, err
}

func lastLine(b []byte) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return lines[len(lines)-1]
}

// parseUCXPerftest returns the overall bandwidth of ucx_perftest's final
// report line, in MiB/s (ucx_perftest's "MB/s" are MiB). It accepts the
// full report ("Final:" line) and -f output (a bare line of numbers). The
// bandwidth is the third field from the end: ... bw avg, bw overall, msg
// rate avg, msg rate overall.
func parseUCXPerftest(b []byte) (float64, error) {
	var last []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 0 && f[0] == "Final:" {
			f = f[1:]
		}
		if len(f) < 5 {
			continue
		}
		numeric := true
		for _, x := range f {
			if _, err := strconv.ParseFloat(x, 64); err != nil {
				numeric = false
				break
			}
		}
		if numeric {
			last = f
		}
	}
	if last == nil {
		return 0, errors.New("ucx_perftest: no result line in its output")
	}
	v, _ := strconv.ParseFloat(last[len(last)-3], 64)
	if v <= 0 {
		return 0, fmt.Errorf("ucx_perftest: bandwidth %q", last[len(last)-3])
	}
	return v, nil
}

// Targets the project set for itself on the 2-core development machine.
const (
	targetTCPvsIperf3 = 1.2
	targetTCPvsUCXTag = 1.0
	targetSHMvsMemcpy = 0.7
	targetSmallVsMiB  = 0.5
)

// targetConfig reports whether a run has the settings the targets were set
// for: one stream, crc32c on and, for tcp, the default lanes. Other runs get
// their ratios without a target.
func targetConfig(r datapathResult) bool {
	return r.Streams == 1 && r.CRC && (r.Transport != rdma.TransportTCP || r.TCPLanes == defaultTCPLanes)
}

// computeRatios compares runs with the baselines, and each transport's
// extent sizes with the largest one measured for it. Targets attach at the
// sizes the project set them for (1 MiB; 4 KiB vs 1 MiB), and only to runs
// with the settings they were set for (targetConfig).
func computeRatios(runs []datapathResult, bs []baseline) []ratio {
	find := func(name string, extent uint64) (float64, bool) {
		for _, b := range bs {
			if b.Name == name && b.Status == statusOK && (extent == 0 || b.ExtentBytes == extent) && b.GBPerS > 0 {
				return b.GBPerS, true
			}
		}
		return 0, false
	}
	var r datapathResult // the run being compared
	target := func(t float64, extent uint64) float64 {
		if extent == 1<<20 && targetConfig(r) {
			return t
		}
		return 0
	}
	var out []ratio
	largest := map[rdma.Transport]datapathResult{}
	for _, r := range runs {
		if cur, ok := largest[r.Transport]; !ok || r.ExtentBytes > cur.ExtentBytes {
			largest[r.Transport] = r
		}
	}
	for _, r = range runs {
		switch r.Transport {
		case rdma.TransportTCP:
			if v, ok := find("iperf3", 0); ok {
				out = append(out, ratio{Name: "tcp/iperf3", ExtentBytes: r.ExtentBytes, Value: r.GBPerS / v, Target: target(targetTCPvsIperf3, r.ExtentBytes)})
			}
			if v, ok := find("tcp_raw", r.ExtentBytes); ok {
				out = append(out, ratio{Name: "tcp/tcp_raw", ExtentBytes: r.ExtentBytes, Value: r.GBPerS / v})
			}
			if v, ok := find("ucx_tag_bw", r.ExtentBytes); ok {
				out = append(out, ratio{Name: "tcp/ucx_tag_bw", ExtentBytes: r.ExtentBytes, Value: r.GBPerS / v, Target: target(targetTCPvsUCXTag, r.ExtentBytes)})
			}
			if v, ok := find("ucx_put_bw", r.ExtentBytes); ok {
				out = append(out, ratio{Name: "tcp/ucx_put_bw", ExtentBytes: r.ExtentBytes, Value: r.GBPerS / v})
			}
		case rdma.TransportSHM:
			if v, ok := find("memcpy", r.ExtentBytes); ok {
				out = append(out, ratio{Name: "shm/memcpy", ExtentBytes: r.ExtentBytes, Value: r.GBPerS / v, Target: target(targetSHMvsMemcpy, r.ExtentBytes)})
			}
		case rdma.TransportInproc:
			if v, ok := find("memcpy", r.ExtentBytes); ok {
				out = append(out, ratio{Name: "inproc/memcpy", ExtentBytes: r.ExtentBytes, Value: r.GBPerS / v})
			}
		}
		if big := largest[r.Transport]; big.ExtentBytes > r.ExtentBytes && big.GBPerS > 0 {
			var tgt float64
			if r.ExtentBytes == 4<<10 && big.ExtentBytes == 1<<20 && targetConfig(r) && targetConfig(big) {
				tgt = targetSmallVsMiB
			}
			out = append(out, ratio{Name: fmt.Sprintf("%s %s-vs-%s", r.Transport, formatSize(r.ExtentBytes), formatSize(big.ExtentBytes)),
				ExtentBytes: r.ExtentBytes, Value: r.GBPerS / big.GBPerS, Target: tgt})
		}
	}
	return out
}
