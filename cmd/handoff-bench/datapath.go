package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/handoff-io/handoff/internal/crc32c"
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

// receiverHandle is a running receiver seen from the writer.
type receiverHandle struct {
	in   io.WriteCloser // to the receiver
	out  io.Reader      // from the receiver
	wait func() error   // after in is closed: the receiver's exit
	// abort, when set, tells a receiver that did not exit on its own to
	// stop now; a child gets SIGTERM and, receiverKillDelay later, SIGKILL.
	abort func()
	// processes is 2 when the receiver is a child process.
	processes int
	pid       int // the child's process id; 0 in this process
}

// spawner starts a receiver for one run.
type spawner interface {
	spawn(ctx context.Context, t rdma.Transport, l layout, logger *slog.Logger) (*receiverHandle, error)
}

// goroutineSpawner runs the receiver in this process.
type goroutineSpawner struct{}

func (goroutineSpawner) spawn(ctx context.Context, t rdma.Transport, l layout, logger *slog.Logger) (*receiverHandle, error) {
	toRx, fromWriter := io.Pipe()
	fromRx, toWriter := io.Pipe()
	done := make(chan error, 1)
	ctx, abort := context.WithCancel(ctx)
	go func() {
		err := serveReceiver(ctx, receiverConfig{Transport: t, Layout: l, Logger: logger, GrantTTL: l.ttl()}, toRx, toWriter)
		_ = toRx.CloseWithError(io.ErrClosedPipe) // unblock a writer still sending
		_ = toWriter.CloseWithError(io.EOF)
		done <- err
	}()
	wait := func() error {
		defer abort()
		return <-done
	}
	return &receiverHandle{in: fromWriter, out: fromRx, wait: wait, abort: abort, processes: 1}, nil
}

// childSpawner re-executes this binary as the receiver; env is added to its
// environment.
type childSpawner struct{ env []string }

// spawn starts the receiver on a context of its own under ctx. When that ends
// (the caller's ctx, or abort) the child gets SIGTERM, on which it closes its
// engine, which removes its shm socket, and exits; SIGKILL follows only if
// it has not exited receiverKillDelay later.
func (c childSpawner) spawn(ctx context.Context, t rdma.Transport, l layout, _ *slog.Logger) (*receiverHandle, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("locate own binary: %w", err)
	}
	ctx, abort := context.WithCancel(ctx)
	cmd := exec.CommandContext(ctx, exe, "datapath", "--role=receiver",
		"--transport="+string(t),
		"--extent="+strconv.FormatUint(l.Extent, 10),
		"--grant-bytes="+strconv.FormatUint(l.grantBytes(), 10),
		"--streams="+strconv.Itoa(l.Streams),
		"--depth="+strconv.Itoa(l.Depth),
		"--tcp-lanes="+strconv.Itoa(max(l.TCPLanes, 1)),
		"--skip-crc="+strconv.FormatBool(l.SkipCRC),
		"--tls-dir="+l.TLSDir,
		"--grant-ttl="+l.ttl().String())
	cmd.Env = append(os.Environ(), c.env...)
	cmd.Stderr = os.Stderr
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = receiverKillDelay
	in, err := cmd.StdinPipe()
	if err != nil {
		abort()
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		abort()
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		abort()
		return nil, fmt.Errorf("start receiver: %w", err)
	}
	wait := func() error {
		defer abort()
		return cmd.Wait()
	}
	return &receiverHandle{in: in, out: out, wait: wait, abort: abort, processes: 2, pid: cmd.Process.Pid}, nil
}

// runOnce measures one transport at one layout.
func runOnce(ctx context.Context, t rdma.Transport, l layout, dur time.Duration, logger *slog.Logger, sp spawner, progress io.Writer) (res datapathResult, err error) {
	// The receiver lives on the caller's ctx: ending this run closes its
	// control channel, which lets it exit on its own instead of being killed.
	rx, err := sp.spawn(ctx, t, l, logger)
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if err != nil {
		return res, err
	}
	var dispatch sync.WaitGroup
	// hangUp closes the control channel, which ends a healthy receiver; one
	// that has not hung up receiverGrace later (stuck, or stopped) is
	// aborted, so that reading its last words below cannot wait forever.
	var backstop *time.Timer
	hangUp := func() {
		_ = rx.in.Close()
		if backstop == nil && rx.abort != nil {
			backstop = time.AfterFunc(receiverGrace, rx.abort)
		}
	}
	defer func() {
		hangUp()
		cancel(errors.New("run over"))
		dispatch.Wait()
		// Read what the receiver still says (an error report) until it
		// hangs up, so that it never blocks writing to us.
		_, _ = io.Copy(io.Discard, rx.out)
		werr := rx.wait()
		if backstop != nil {
			backstop.Stop()
		}
		if werr != nil && err == nil {
			err = fmt.Errorf("receiver: %w", werr)
		}
	}()
	cr := newCtrlReader(rx.out)
	cw := newCtrlWriter(rx.in)
	hello, err := cr.next()
	if err != nil {
		return res, fmt.Errorf("receiver hello: %w", err)
	}
	if hello.Type != "hello" {
		return res, fmt.Errorf("receiver: expected hello, got %q %s", hello.Type, hello.Error)
	}
	peer := *hello.Descriptor
	if len(peer.Regions) != 1 || peer.Regions[0].Length != l.regionBytes() {
		return res, fmt.Errorf("receiver: descriptor has regions %+v, want one of %d bytes", peer.Regions, l.regionBytes())
	}

	tlsCfg, err := loadBenchTLS(l.TLSDir)
	if err != nil {
		return datapathResult{}, err
	}
	eng, err := rdma.New(rdma.Config{Agent: agentID("writer"), Transports: []rdma.Transport{t}, Logger: logger, TCPLanes: l.TCPLanes, SkipCRC: l.SkipCRC, TLS: tlsCfg})
	if err != nil {
		return res, err
	}
	defer eng.Close()
	src, err := eng.Register("bench-src", int64(l.sourceBytes()))
	if err != nil {
		return res, err
	}
	_, _ = rand.Read(src.Bytes())
	chosen, err := eng.Connect(ctx, peer)
	if err != nil {
		return res, err
	}
	if chosen != t {
		return res, fmt.Errorf("asked for transport %s, the engine chose %s", t, chosen)
	}

	// The dispatcher routes tickets to their stream and ends the run on a
	// receiver error or a closed channel.
	tickets := make([]chan ctrlMsg, l.Streams)
	for i := range tickets {
		tickets[i] = make(chan ctrlMsg, l.Depth) // at most Depth opens outstanding per stream
	}
	statsCh := make(chan receiverStats, 1)
	dispatch.Add(1)
	go func() {
		defer dispatch.Done()
		for {
			m, err := cr.next()
			if err != nil {
				cancel(fmt.Errorf("receiver control channel: %w", err))
				return
			}
			switch m.Type {
			case "ticket":
				if m.Stream < 0 || m.Stream >= l.Streams {
					cancel(fmt.Errorf("receiver: ticket for stream %d", m.Stream))
					return
				}
				select {
				case tickets[m.Stream] <- m:
				default:
					cancel(fmt.Errorf("receiver: unrequested ticket for stream %d", m.Stream))
					return
				}
			case "stats":
				statsCh <- *m.Stats
				return
			case "error":
				cancel(fmt.Errorf("receiver: %s", m.Error))
				return
			default:
				cancel(fmt.Errorf("receiver: unexpected %q", m.Type))
				return
			}
		}
	}()

	var (
		reqID   atomic.Uint64
		total   atomic.Uint64
		grants  atomic.Uint64
		streams sync.WaitGroup
		lats    = make([][]time.Duration, l.Streams)
		errs    = make([]error, l.Streams)
	)
	open := func(stream, slot int) error {
		return cw.send(ctrlMsg{Type: "open", Stream: stream, Slot: slot, RequestID: reqID.Add(1)})
	}
	start := time.Now()
	stopProgress := startProgress(progress, fmt.Sprintf("%s %s", t, formatSize(l.Extent)), start, &total)
	for s := range l.Streams {
		streams.Add(1)
		go func() {
			defer streams.Done()
			lats[s], errs[s] = writeStream(ctx, eng, peer, l, s, src.ID(), start.Add(dur), tickets[s], open, &total, &grants)
		}()
	}
	streams.Wait()
	elapsed := time.Since(start)
	stopProgress()
	if err := errors.Join(errs...); err != nil {
		// A failed write or send often has its reason on the receiver's
		// side: hang up, let the dispatcher read the receiver's last words,
		// and report those first.
		hangUp()
		dispatch.Wait()
		// A receiver that merely hung up (or was stopped) said nothing.
		if c := context.Cause(ctx); c != nil && !errors.Is(err, c) && !errors.Is(c, io.EOF) {
			err = fmt.Errorf("%w (%w)", c, err)
		}
		return res, err
	}
	if err := cw.send(ctrlMsg{Type: "stop"}); err != nil {
		return res, err
	}
	var st receiverStats
	statsWait := time.NewTimer(l.ttl())
	defer statsWait.Stop()
	select {
	case st = <-statsCh:
	case <-ctx.Done():
		return res, context.Cause(ctx)
	case <-statsWait.C:
		return res, fmt.Errorf("receiver sent no stats within %s of stop", l.ttl())
	}
	if st.Bytes != total.Load() || st.Committed != grants.Load() {
		return res, fmt.Errorf("receiver committed %d grants / %d bytes, writer wrote %d / %d", st.Committed, st.Bytes, grants.Load(), total.Load())
	}
	if grants.Load() == 0 {
		return res, fmt.Errorf("no grant was written within --duration %s: nothing was measured", dur)
	}
	all := slices.Concat(lats...)
	slices.Sort(all)
	res = datapathResult{
		Transport: t, ExtentBytes: l.Extent, Bytes: total.Load(), Seconds: elapsed.Seconds(),
		GBPerS: float64(total.Load()) / elapsed.Seconds() / 1e9, Streams: l.Streams, Depth: l.Depth,
		GrantBytes: l.grantBytes(), ExtentsPerGrant: l.PerGrant, Grants: grants.Load(),
		GrantP50Ms: quantileMs(all, 0.50), GrantP99Ms: quantileMs(all, 0.99), Processes: rx.processes,
		CRC: !l.SkipCRC,
	}
	if res.CRC {
		res.CRCKernel = crc32c.Kernel()
	}
	if t == rdma.TransportTCP {
		res.TCPLanes = max(l.TCPLanes, 1)
		res.TLS = l.TLSDir != ""
	}
	return res, nil
}

// writeStream is one writer: it keeps Depth grants requested and writes each
// ticket as it arrives, until the deadline. It returns the per-grant write
// latencies.
func writeStream(ctx context.Context, eng *rdma.Engine, peer rdma.Descriptor, l layout, s int, srcRegion rdma.RegionID,
	until time.Time, tickets <-chan ctrlMsg, open func(stream, slot int) error, total, grants *atomic.Uint64) ([]time.Duration, error) {
	src := l.extents(srcRegion, s)
	dst := make([][]rdma.Extent, l.Depth)
	for k := range dst {
		i, _ := l.slotIndex(s, k)
		dst[k] = l.extents(peer.Regions[0].ID, i)
	}
	lats := make([]time.Duration, 0, 4096)
	for k := range l.Depth {
		if err := open(s, k); err != nil {
			return nil, err
		}
	}
	ticketWait := time.NewTimer(l.ttl())
	defer ticketWait.Stop()
	for time.Now().Before(until) {
		var m ctrlMsg
		ticketWait.Reset(l.ttl())
		select {
		case m = <-tickets:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		case <-ticketWait.C:
			return nil, fmt.Errorf("stream %d: the receiver sent no ticket within %s", s, l.ttl())
		}
		if m.Slot < 0 || m.Slot >= l.Depth {
			return nil, fmt.Errorf("receiver: ticket for slot %d", m.Slot)
		}
		wt := m.Ticket
		t := rdma.Ticket{Agent: peer.Agent, Grant: wt.Grant, Epoch: wt.Epoch, Token: wt.Token, RequestID: wt.RequestID,
			Extents: dst[m.Slot], Bytes: wt.Bytes, Deadline: wt.Deadline}
		t0 := time.Now()
		// The grant ends at its deadline: a write the receiver has not
		// answered by then never will be.
		wctx, cancel := context.WithDeadline(ctx, wt.Deadline)
		_, err := eng.Write(wctx, peer, t, src)
		cancel()
		if err != nil {
			if ctx.Err() == nil && wctx.Err() != nil {
				return nil, fmt.Errorf("stream %d grant %d: not committed by the grant's deadline, %s after it was opened (is the receiver stuck?): %w",
					s, wt.Grant, l.ttl(), err)
			}
			return nil, fmt.Errorf("stream %d grant %d: %w", s, wt.Grant, err)
		}
		lats = append(lats, time.Since(t0))
		total.Add(wt.Bytes)
		grants.Add(1)
		if err := open(s, m.Slot); err != nil {
			return nil, err
		}
	}
	return lats, nil
}

func quantileMs(sorted []time.Duration, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := min(len(sorted)-1, int(q*float64(len(sorted))))
	return float64(sorted[i]) / 1e6
}

// startProgress prints a live rate to w every half second until the returned
// stop is called; with a nil w it does nothing.
func startProgress(w io.Writer, label string, start time.Time, bytes *atomic.Uint64) (stop func()) {
	if w == nil {
		return func() {}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(500 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				fmt.Fprint(w, "\r\033[K")
				return
			case <-tick.C:
				sec := time.Since(start).Seconds()
				fmt.Fprintf(w, "\r\033[K%s: %.1fs %.2f GB/s", label, sec, float64(bytes.Load())/sec/1e9)
			}
		}
	})
	return func() { close(done); wg.Wait() }
}

// write renders the report.
func (r report) write(w io.Writer, format string) error {
	if format == "json" {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		if len(r.Runs) == 1 {
			return enc.Encode(struct {
				datapathResult
				Baselines []baseline `json:"baselines,omitempty"`
				Ratios    []ratio    `json:"ratios,omitempty"`
			}{r.Runs[0], r.Baselines, r.Ratios})
		}
		return enc.Encode(r)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "transport\textent\tstreams\tlanes\tcrc\tprocs\tgrants\tbytes\tseconds\tGB/s\tgrant p50 ms\tgrant p99 ms\trepeats GB/s")
	for _, x := range r.Runs {
		reps := "-"
		if len(x.Repeats) > 0 {
			var b strings.Builder
			for i, v := range x.Repeats {
				if i > 0 {
					b.WriteByte(' ')
				}
				fmt.Fprintf(&b, "%.2f", v)
			}
			reps = b.String()
		}
		lanes, crc := "-", "no"
		if x.TCPLanes > 0 {
			lanes = strconv.Itoa(x.TCPLanes)
		}
		if x.CRC {
			crc = "yes"
		}
		transport := string(x.Transport)
		if x.TLS {
			transport += "+tls"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%d\t%d\t%s\t%.2f\t%.2f\t%.3f\t%.3f\t%s\n", transport, formatSize(x.ExtentBytes), x.Streams,
			lanes, crc, x.Processes, x.Grants, formatSize(x.Bytes), x.Seconds, x.GBPerS, x.GrantP50Ms, x.GrantP99Ms, reps)
	}
	for _, x := range r.Runs {
		if x.CRCKernel != "" {
			fmt.Fprintf(tw, "(crc32c: %s)\n", x.CRCKernel)
			break
		}
	}
	if len(r.Baselines) > 0 {
		fmt.Fprintln(tw, "\nbaseline\tsize\tGB/s\tstatus")
		for _, b := range r.Baselines {
			size, rate := "-", "-"
			if b.ExtentBytes > 0 {
				size = formatSize(b.ExtentBytes)
			}
			if b.Status == statusOK {
				rate = fmt.Sprintf("%.2f", b.GBPerS)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", b.Name, size, rate, b.Status)
		}
	}
	if len(r.Ratios) > 0 {
		fmt.Fprintln(tw, "\nratio\tsize\tvalue\ttarget")
		for _, x := range r.Ratios {
			target := "-"
			if x.Target > 0 {
				verdict := "met"
				if x.Value < x.Target {
					verdict = "MISSED"
				}
				target = fmt.Sprintf(">= %.2f %s", x.Target, verdict)
			}
			fmt.Fprintf(tw, "%s\t%s\t%.2f\t%s\n", x.Name, formatSize(x.ExtentBytes), x.Value, target)
		}
	}
	return tw.Flush()
}

// formatSize writes sizes the way parseSize reads them, exact where it can.
func formatSize(n uint64) string {
	for _, u := range []struct {
		shift uint
		name  string
	}{{40, "TiB"}, {30, "GiB"}, {20, "MiB"}, {10, "KiB"}} {
		if n >= 1<<u.shift {
			if n%(1<<u.shift) == 0 {
				return fmt.Sprintf("%d%s", n>>u.shift, u.name)
			}
			if u.shift >= 20 {
				return fmt.Sprintf("%.1f%s", float64(n)/float64(uint64(1)<<u.shift), u.name)
			}
		}
	}
	return fmt.Sprintf("%dB", n)
}
