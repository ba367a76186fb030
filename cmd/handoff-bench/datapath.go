package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime/pprof"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/handoff-io/handoff/internal/size"
	"github.com/handoff-io/handoff/rdma"
)

const datapathUsage = `usage: handoff-bench datapath [flags]

Measures the rdma data path: a receiver opens grants on request, a writer
writes extents into them and commits, for --duration. The receiver runs in
a second process (re-executing this binary) unless --transport inproc or
--single-process. --transport and --extent take comma-separated lists; every
combination is one run. With --repeat N every figure is the median of N
measurements (the table lists each one). With one run the JSON output is one flat object
(transport, extent_bytes, bytes, seconds, gb_per_s, streams, ...); with more
it is {"runs": [...], "baselines": [...], "ratios": [...]}.

--baselines measures, in the same invocation: iperf3 single stream on
loopback, a plain Go TCP connection to a child process carrying the same
extents (tcp_raw: the tcp path without frames, grants, crc or lanes), Go
memcpy on one goroutine, and ucx_perftest tag_bw and ucp_put_bw over TCP
(UCX_TLS=tcp), and prints the ratios against them. The tcp baselines are
skipped without a tcp run. A ratio is judged against the project's target
only for runs with the settings the targets were set for (one stream, crc32c
on, default --tcp-lanes); other runs print it without one.

SIGINT or SIGTERM stops the run (its child processes included) and exits
nonzero without a report; a second one ends the process at once.

flags:
`

// datapathOptions are the parsed flags.
type datapathOptions struct {
	transports    []rdma.Transport
	extents       []uint64
	duration      time.Duration
	streams       int
	depth         int
	grantBytes    uint64
	output        string
	baselines     bool
	singleProcess bool
	verbose       bool
	cpuProfile    string
	repeat        int
	tcpLanes      int
	skipCRC       bool
	tls           bool
	tlsDir        string        // hidden: the certificates of --tls, in a child process
	role          string        // hidden: "receiver" or "rawsink" in a child process
	rawAddr       string        // hidden: where a rawsink child connects
	grantTTL      time.Duration // hidden: the deadline of each grant
}

// layout is the run's layout for one extent size, with the engine settings.
func (o datapathOptions) layout(extent uint64) (layout, error) {
	l, err := newLayout(extent, o.grantBytes, o.streams, o.depth)
	l.TCPLanes, l.SkipCRC, l.GrantTTL, l.TLSDir = o.tcpLanes, o.skipCRC, o.grantTTL, o.tlsDir
	return l, err
}

func parseDatapathFlags(args []string, stderr io.Writer) (datapathOptions, error) {
	var o datapathOptions
	fs := flag.NewFlagSet("datapath", flag.ContinueOnError)
	fs.SetOutput(stderr)
	transports := fs.String("transport", "tcp", "transports to measure: tcp, shm, inproc, ucx (comma-separated; ucx needs a build with -tags ucx)")
	extents := fs.String("extent", "1MiB", "extent sizes, e.g. 4KiB,1MiB (comma-separated)")
	grant := fs.String("grant-bytes", "8MiB", "bytes per grant (one request); rounded down to whole extents, at least one")
	fs.DurationVar(&o.duration, "duration", 5*time.Second, "measuring time per run")
	fs.IntVar(&o.streams, "streams", 1, "concurrent writers, each with its own grants")
	fs.IntVar(&o.depth, "depth", 2, "grants open per stream: the next ticket is fetched while one is written")
	fs.StringVar(&o.output, "output", "table", "table or json")
	fs.IntVar(&o.repeat, "repeat", 1, "measure everything this many times, round-robin, and report medians")
	fs.IntVar(&o.tcpLanes, "tcp-lanes", defaultTCPLanes, "tcp connections one grant's write is striped over (rdma.Config.TCPLanes; 1: one connection)")
	fs.BoolVar(&o.skipCRC, "skip-crc", false, "leave crc32c out of the manifests on both sides (rdma.Config.SkipCRC), to see what integrity costs")
	fs.BoolVar(&o.tls, "tls", false, "run the tcp transport over mutual TLS (rdma.Config.TLS) with an ephemeral CA, to see what encryption costs")
	fs.StringVar(&o.tlsDir, "tls-dir", "", "")
	fs.BoolVar(&o.baselines, "baselines", false, "also measure iperf3, a raw Go TCP socket, memcpy and ucx_perftest, and print ratios")
	fs.BoolVar(&o.singleProcess, "single-process", false, "run the receiver in this process even for tcp and shm")
	fs.BoolVar(&o.verbose, "verbose", false, "log the engines' info lines (transport choice, regions) to stderr")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of this (the writer) process to this file")
	fs.StringVar(&o.role, "role", "", "")
	fs.StringVar(&o.rawAddr, "raw-addr", "", "")
	fs.DurationVar(&o.grantTTL, "grant-ttl", grantTTL, "")
	fs.Usage = func() {
		fmt.Fprint(stderr, datapathUsage)
		fs.VisitAll(func(f *flag.Flag) {
			if f.Name == "role" || f.Name == "raw-addr" || f.Name == "grant-ttl" {
				return
			}
			fmt.Fprintf(stderr, "  --%s (default %q)\n    \t%s\n", f.Name, f.DefValue, f.Usage)
		})
	}
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("datapath: unexpected argument %q", fs.Arg(0))
	}
	for _, s := range strings.Split(*transports, ",") {
		t := rdma.Transport(strings.TrimSpace(s))
		switch t {
		case rdma.TransportTCP, rdma.TransportSHM, rdma.TransportInproc, rdma.TransportUCX:
		default:
			return o, fmt.Errorf("datapath: --transport %q: want tcp, shm, inproc or ucx", s)
		}
		if !slices.Contains(o.transports, t) {
			o.transports = append(o.transports, t)
		}
	}
	for _, s := range strings.Split(*extents, ",") {
		ns, err := size.Parse(s)
		if err != nil {
			return o, fmt.Errorf("datapath: --extent: %w", err)
		}
		n := uint64(ns)
		if n == 0 {
			return o, errors.New("datapath: --extent must be > 0")
		}
		if !slices.Contains(o.extents, n) {
			o.extents = append(o.extents, n)
		}
	}
	g, err := size.Parse(*grant)
	if err != nil {
		return o, fmt.Errorf("datapath: --grant-bytes: %w", err)
	}
	o.grantBytes = uint64(g)
	if o.duration <= 0 {
		return o, errors.New("datapath: --duration must be > 0")
	}
	if o.grantTTL <= 0 {
		return o, errors.New("datapath: --grant-ttl must be > 0")
	}
	if o.repeat < 1 || o.repeat > 100 {
		return o, fmt.Errorf("datapath: --repeat %d: want 1..100", o.repeat)
	}
	if o.output != "table" && o.output != "json" {
		return o, fmt.Errorf("datapath: --output %q: want table or json", o.output)
	}
	if o.tcpLanes < 1 || o.tcpLanes > 64 {
		return o, fmt.Errorf("datapath: --tcp-lanes %d: want 1..64", o.tcpLanes)
	}
	if o.role != "" && o.role != "receiver" && o.role != "rawsink" {
		return o, fmt.Errorf("datapath: unknown role %q", o.role)
	}
	for _, e := range o.extents {
		if _, err := o.layout(e); err != nil {
			return o, fmt.Errorf("datapath: %w", err)
		}
	}
	return o, nil
}

func runDatapath(ctx context.Context, args []string) error {
	o, err := parseDatapathFlags(args, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	logger := benchLogger(o.verbose)
	if o.role == "receiver" {
		l, err := o.layout(o.extents[0])
		if err != nil {
			return err
		}
		return childErr(ctx, serveReceiver(ctx, receiverConfig{Transport: o.transports[0], Layout: l, Logger: logger, GrantTTL: l.ttl()}, os.Stdin, os.Stdout))
	}
	if o.role == "rawsink" {
		l, err := o.layout(o.extents[0])
		if err != nil {
			return err
		}
		return childErr(ctx, serveRawSink(ctx, o.rawAddr, l, os.Stdout))
	}
	if o.tls && o.tlsDir == "" {
		dir, err := os.MkdirTemp("", "handoff-bench-tls-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		if err := writeBenchTLS(dir); err != nil {
			return fmt.Errorf("datapath: --tls: %w", err)
		}
		o.tlsDir = dir
	}
	if o.cpuProfile != "" {
		f, err := os.Create(o.cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	rep, err := measureDatapath(ctx, o, logger, childSpawner{}, progressOut())
	if err != nil {
		return err
	}
	return rep.write(os.Stdout, o.output)
}

// errChildStopped is a child role's error when a signal (its parent's
// SIGTERM, or the terminal's SIGINT) stopped it: it exits nonzero and
// quietly, the parent tells what happened.
var errChildStopped = errors.New("stopped by a signal")

func childErr(ctx context.Context, err error) error {
	if err != nil && ctx.Err() != nil {
		return errChildStopped
	}
	return err
}

// grantTTL bounds every grant of the bench, and so every write and every
// wait for the receiver: a stuck peer fails the run.
const grantTTL = 30 * time.Second

// defaultTCPLanes is --tcp-lanes' default, the setting the ratio targets
// were set for.
const defaultTCPLanes = 4

// receiverGrace is how long a receiver has to exit on its own once its run
// is over before it is stopped (SIGTERM, then SIGKILL after
// receiverKillDelay).
const (
	receiverGrace     = 3 * time.Second
	receiverKillDelay = 5 * time.Second
)

func benchLogger(verbose bool) *slog.Logger {
	lvl := slog.LevelWarn
	if verbose {
		lvl = slog.LevelInfo
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
}

// progressOut is stderr when it is a terminal, else nil (no progress).
func progressOut() io.Writer {
	fi, err := os.Stderr.Stat()
	if err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		return nil
	}
	return os.Stderr
}

var agentSeq atomic.Uint64

func agentID(role string) rdma.AgentID {
	return rdma.AgentID(fmt.Sprintf("bench-%s-%d-%d", role, os.Getpid(), agentSeq.Add(1)))
}

// datapathResult is one run.
type datapathResult struct {
	Transport       rdma.Transport `json:"transport"`
	ExtentBytes     uint64         `json:"extent_bytes"`
	Bytes           uint64         `json:"bytes"`
	Seconds         float64        `json:"seconds"`
	GBPerS          float64        `json:"gb_per_s"`
	Streams         int            `json:"streams"`
	Depth           int            `json:"depth"`
	GrantBytes      uint64         `json:"grant_bytes"`
	ExtentsPerGrant int            `json:"extents_per_grant"`
	Grants          uint64         `json:"grants"`
	GrantP50Ms      float64        `json:"grant_p50_ms"`
	GrantP99Ms      float64        `json:"grant_p99_ms"`
	Processes       int            `json:"processes"`
	TCPLanes        int            `json:"tcp_lanes,omitempty"`     // tcp only
	TLS             bool           `json:"tls,omitempty"`           // tcp over mutual TLS (--tls)
	CRC             bool           `json:"crc32c"`                  // manifests carried crc32c
	CRCKernel       string         `json:"crc32c_kernel,omitempty"` // the writer's crc32c implementation
	// Repeats holds each repetition's gb_per_s with --repeat > 1; the
	// other fields are those of the median one.
	Repeats []float64 `json:"gb_per_s_repeats,omitempty"`
}

// report is everything one invocation measured.
type report struct {
	Runs      []datapathResult `json:"runs"`
	Baselines []baseline       `json:"baselines,omitempty"`
	Ratios    []ratio          `json:"ratios,omitempty"`
}

func measureDatapath(ctx context.Context, o datapathOptions, logger *slog.Logger, sp spawner, progress io.Writer) (report, error) {
	repeat := max(o.repeat, 1)
	n := len(o.transports) * len(o.extents)
	samples := make([][]datapathResult, n)
	var baseSamples [][]baseline
	// Repetitions go round the whole matrix, baselines included, so that
	// noise from other work on the machine spreads over all of them alike.
	// An interrupted invocation reports nothing but the interruption (the
	// context's cause): what was measured is incomplete, and what failed
	// failed because it was cut short.
	for range repeat {
		i := 0
		for _, t := range o.transports {
			for _, e := range o.extents {
				l, err := o.layout(e)
				if err != nil {
					return report{}, err
				}
				s := sp
				if t == rdma.TransportInproc || o.singleProcess {
					s = goroutineSpawner{}
				}
				if ctx.Err() != nil {
					return report{}, context.Cause(ctx)
				}
				r, err := runOnce(ctx, t, l, o.duration, logger, s, progress)
				if ctx.Err() != nil {
					return report{}, context.Cause(ctx)
				}
				if err != nil {
					return report{}, fmt.Errorf("datapath %s %s: %w", t, formatSize(e), err)
				}
				samples[i] = append(samples[i], r)
				i++
			}
		}
		if o.baselines {
			bs := measureBaselines(ctx, o, progress)
			if ctx.Err() != nil {
				return report{}, context.Cause(ctx)
			}
			baseSamples = append(baseSamples, bs)
		}
	}
	var rep report
	for _, runs := range samples {
		rep.Runs = append(rep.Runs, medianRun(runs))
	}
	if o.baselines {
		rep.Baselines = medianBaselines(baseSamples)
		rep.Ratios = computeRatios(rep.Runs, rep.Baselines)
	}
	return rep, nil
}

// medianRun returns the run with the median rate (the lower middle one for
// an even count), with every repetition's rate attached when there are
// several.
func medianRun(runs []datapathResult) datapathResult {
	sorted := slices.Clone(runs)
	slices.SortFunc(sorted, func(a, b datapathResult) int { return cmpFloat(a.GBPerS, b.GBPerS) })
	m := sorted[(len(sorted)-1)/2]
	if len(runs) > 1 {
		m.Repeats = nil
		for _, r := range runs {
			m.Repeats = append(m.Repeats, r.GBPerS)
		}
	}
	return m
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
