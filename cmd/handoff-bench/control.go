package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/transfer/wire"
)

const controlUsage = `usage: handoff-bench control [flags]

Measures the control overhead of a handoff. In one process, against one
embedded NATS server, it runs --requests minimal handoffs (full decode and
prefill sessions: grant, request, write and commit of a 1-byte cache, reply)
and, interleaved with them, --requests raw NATS request-replies whose request
and reply have the sizes of the handoff's messages. It prints p50/p90/p99 of
both, their ratio, and the NATS messages clients published per request
(registry heartbeats are configured not to fire during the run).

flags:
`

type controlOptions struct {
	requests int
	warmup   int
	output   string
}

func parseControlFlags(args []string, stderr io.Writer) (controlOptions, error) {
	var o controlOptions
	fs := flag.NewFlagSet("control", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&o.requests, "requests", 2000, "measured handoffs (and as many raw request-replies)")
	fs.IntVar(&o.warmup, "warmup", 200, "unmeasured iterations of each before measuring")
	fs.StringVar(&o.output, "output", "table", "table or json")
	fs.Usage = func() {
		fmt.Fprint(stderr, controlUsage)
		fs.VisitAll(func(f *flag.Flag) {
			fmt.Fprintf(stderr, "  --%s (default %q)\n    \t%s\n", f.Name, f.DefValue, f.Usage)
		})
	}
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("control: unexpected arguments %q", fs.Args())
	}
	if o.requests < 1 || o.warmup < 0 {
		return o, fmt.Errorf("control: --requests must be >= 1 and --warmup >= 0")
	}
	if o.output != "table" && o.output != "json" {
		return o, fmt.Errorf("control: --output must be table or json, not %q", o.output)
	}
	return o, nil
}

// controlReport is the JSON output.
type controlReport struct {
	Requests           int     `json:"requests"`
	HandoffP50us       float64 `json:"handoff_p50_us"`
	HandoffP90us       float64 `json:"handoff_p90_us"`
	HandoffP99us       float64 `json:"handoff_p99_us"`
	NATSP50us          float64 `json:"nats_p50_us"`
	NATSP90us          float64 `json:"nats_p90_us"`
	NATSP99us          float64 `json:"nats_p99_us"`
	RatioP50           float64 `json:"ratio_p50"`
	RatioP99           float64 `json:"ratio_p99"`
	MsgsPerRequest     float64 `json:"msgs_per_request"`
	NATSMsgsPerRequest float64 `json:"nats_msgs_per_request"`
	RequestBytes       int     `json:"request_bytes"`
	ReplyBytes         int     `json:"reply_bytes"`
	PayloadBytes       uint64  `json:"payload_bytes"`
	HandoffErrors      int     `json:"handoff_errors"`
	GoalRatioP50       float64 `json:"goal_ratio_p50"`
	GoalMsgsPerRequest float64 `json:"goal_msgs_per_request"`
	NATSServerVersion  string  `json:"nats_server_version"`
}

func runControl(ctx context.Context, args []string) error {
	o, err := parseControlFlags(args, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	rep, err := measureControl(ctx, o)
	if err != nil {
		return err
	}
	return printControl(os.Stdout, o.output, rep)
}

// controlExec admits everything and "prefills" a fixed 1-byte source.
type controlExec struct{ src transfer.CacheExtents }

func (x controlExec) Admit(transfer.Job) (transfer.AdmittedJob, error) {
	return controlLease(x), nil
}

type controlLease struct{ src transfer.CacheExtents }

func (l controlLease) Prefill(context.Context) (transfer.Prefilled, error) {
	return transfer.Prefilled{FirstToken: 1, Source: l.src}, nil
}
func (controlLease) Release() {}

func measureControl(ctx context.Context, o controlOptions) (controlReport, error) {
	dir, err := os.MkdirTemp("", "handoff-bench-control-")
	if err != nil {
		return controlReport{}, err
	}
	defer os.RemoveAll(dir)
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true, JetStream: true, StoreDir: dir})
	if err != nil {
		return controlReport{}, fmt.Errorf("control: nats server: %w", err)
	}
	go srv.Start()
	defer func() { srv.Shutdown(); srv.WaitForShutdown() }()
	if !srv.ReadyForConnections(10 * time.Second) {
		return controlReport{}, errors.New("control: nats server not ready")
	}
	connect := func() (*nats.Conn, error) { return nats.Connect(srv.ClientURL()) }
	decNC, err := connect()
	if err != nil {
		return controlReport{}, err
	}
	defer decNC.Close()
	preNC, err := connect()
	if err != nil {
		return controlReport{}, err
	}
	defer preNC.Close()

	quiet := slog.New(slog.DiscardHandler)
	newEngine := func(agent string) (*rdma.Engine, *rdma.Region, error) {
		e, err := rdma.New(rdma.Config{Agent: rdma.AgentID(agent), Transports: []rdma.Transport{rdma.TransportInproc}, Logger: quiet})
		if err != nil {
			return nil, nil, err
		}
		r, err := e.Register("state", 4096)
		if err != nil {
			e.Close()
			return nil, nil, err
		}
		return e, r, nil
	}
	decEng, decReg, err := newEngine("bench-decode")
	if err != nil {
		return controlReport{}, err
	}
	defer decEng.Close()
	preEng, preReg, err := newEngine("bench-prefill")
	if err != nil {
		return controlReport{}, err
	}
	defer preEng.Close()

	const ns, fp = "bench", "bench-layout"
	// Heartbeats every 3 minutes: none fires during a run of normal length,
	// so the message count is the protocol's.
	regCfg := transfer.RegistryConfig{TTL: 10 * time.Minute, Heartbeat: 3 * time.Minute}
	pre, err := transfer.NewPrefiller(transfer.PrefillerConfig{Instance: "prefill-0", Namespace: ns, Fingerprint: fp,
		Registry: regCfg, Logger: quiet}, preNC, preEng,
		controlExec{src: transfer.CacheExtents{Mamba: rdma.Extent{Region: preReg.ID(), Offset: 0, Length: 1}}})
	if err != nil {
		return controlReport{}, err
	}
	if err := pre.Start(ctx); err != nil {
		return controlReport{}, err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = pre.Shutdown(sctx)
	}()
	dec, err := transfer.NewDecoder(ctx, transfer.DecoderConfig{Instance: "decode-0", Namespace: ns, Fingerprint: fp,
		Registry: regCfg, Logger: quiet}, decNC, decEng)
	if err != nil {
		return controlReport{}, err
	}
	defer dec.Close()
	// One fixed destination for every request: the bench measures the
	// protocol, not the pools.
	dest := transfer.CacheExtents{Mamba: rdma.Extent{Region: decReg.ID(), Offset: 0, Length: 1}}

	// The raw baseline: same connections' roles, same message sizes.
	prompt := []int32{1, 2, 3, 4, 5, 6, 7, 8}
	reqBytes, repBytes, err := controlMessageSizes(decEng, prompt, fp)
	if err != nil {
		return controlReport{}, err
	}
	rawReq, rawRep := make([]byte, reqBytes), make([]byte, repBytes)
	const rawSubj = "bench.raw"
	sub, err := preNC.Subscribe(rawSubj, func(m *nats.Msg) { _ = m.Respond(rawRep) })
	if err != nil {
		return controlReport{}, err
	}
	defer sub.Unsubscribe()
	if err := preNC.Flush(); err != nil {
		return controlReport{}, err
	}

	var id uint64
	handoff := func() (time.Duration, error) {
		id++
		start := time.Now()
		_, err := dec.Handoff(ctx, transfer.Request{ID: id, Tokens: prompt, Dest: dest, Deadline: start.Add(10 * time.Second)})
		return time.Since(start), err
	}
	raw := func() (time.Duration, error) {
		start := time.Now()
		_, err := decNC.Request(rawSubj, rawReq, 10*time.Second)
		return time.Since(start), err
	}
	for range o.warmup {
		if _, err := handoff(); err != nil {
			return controlReport{}, fmt.Errorf("control: warm-up handoff: %w", err)
		}
		if _, err := raw(); err != nil {
			return controlReport{}, fmt.Errorf("control: warm-up request: %w", err)
		}
	}

	// Handoffs alone first, to count their messages, then interleaved with
	// raw requests for the latency comparison.
	countN := min(o.requests, 500)
	before := settledInMsgs(srv)
	for range countN {
		if _, err := handoff(); err != nil {
			return controlReport{}, fmt.Errorf("control: handoff: %w", err)
		}
	}
	after := settledInMsgs(srv)
	handoffMsgs := float64(after-before) / float64(countN)
	before = after
	for range countN {
		if _, err := raw(); err != nil {
			return controlReport{}, fmt.Errorf("control: request: %w", err)
		}
	}
	rawMsgs := float64(settledInMsgs(srv)-before) / float64(countN)

	hs := make([]time.Duration, 0, o.requests)
	rs := make([]time.Duration, 0, o.requests)
	errs := 0
	for i := range o.requests {
		if err := ctx.Err(); err != nil {
			return controlReport{}, err
		}
		// Alternate which goes first, so neither always follows the other.
		for k := range 2 {
			if (i+k)%2 == 0 {
				d, err := handoff()
				if err != nil {
					errs++
					continue
				}
				hs = append(hs, d)
			} else {
				d, err := raw()
				if err != nil {
					return controlReport{}, fmt.Errorf("control: request: %w", err)
				}
				rs = append(rs, d)
			}
		}
	}
	if len(hs) == 0 {
		return controlReport{}, errors.New("control: every handoff failed")
	}
	rep := controlReport{
		Requests:     o.requests,
		HandoffP50us: controlPercentile(hs, 50), HandoffP90us: controlPercentile(hs, 90), HandoffP99us: controlPercentile(hs, 99),
		NATSP50us: controlPercentile(rs, 50), NATSP90us: controlPercentile(rs, 90), NATSP99us: controlPercentile(rs, 99),
		MsgsPerRequest: handoffMsgs, NATSMsgsPerRequest: rawMsgs,
		RequestBytes: reqBytes, ReplyBytes: repBytes, PayloadBytes: 1, HandoffErrors: errs,
		GoalRatioP50: 1.5, GoalMsgsPerRequest: 2, NATSServerVersion: server.VERSION,
	}
	rep.RatioP50 = rep.HandoffP50us / rep.NATSP50us
	rep.RatioP99 = rep.HandoffP99us / rep.NATSP99us
	return rep, nil
}

// controlMessageSizes encodes a handoff's request and reply as the protocol
// would for this prompt, to size the raw baseline's messages.
func controlMessageSizes(decEng *rdma.Engine, prompt []int32, fp string) (int, int, error) {
	req := wire.PrefillRequest{
		RequestID: 1 << 40, From: "decode-0", Attempt: 1, Fingerprint: fp, Tokens: prompt,
		Deadline: time.Now().UnixNano(), Peer: wire.PeerOf(decEng.Descriptor()),
		Ticket: rdma.Ticket{Agent: "bench-decode", Grant: 1 << 40, Epoch: 1 << 50, RequestID: 1 << 40,
			Extents: []rdma.Extent{{Region: 1, Offset: 0, Length: 1}}, Bytes: 1, Deadline: time.Now()},
		MambaBytes: 1,
	}
	rb, err := wire.EncodePrefillRequest(req, 0)
	if err != nil {
		return 0, 0, err
	}
	pb, err := wire.EncodePrefillReply(wire.PrefillReply{RequestID: 1 << 40, Instance: "prefill-0", FirstToken: 1,
		PrefillNanos: 1 << 20, WriteNanos: 1 << 20,
		Manifest: rdma.Manifest{Bytes: []uint64{1}, CRC: []uint32{1 << 31}}}, 0)
	if err != nil {
		return 0, 0, err
	}
	return len(rb), len(pb), nil
}

// settledInMsgs returns the server's message count once it stopped moving:
// the server adds a read's messages to it after delivering them, so the last
// reply of a run can arrive before it is counted.
func settledInMsgs(s *server.Server) int64 {
	n := serverInMsgs(s)
	for range 100 {
		time.Sleep(time.Millisecond)
		m := serverInMsgs(s)
		if m == n {
			break
		}
		n = m
	}
	return n
}

func serverInMsgs(s *server.Server) int64 {
	v, err := s.Varz(nil)
	if err != nil {
		return 0
	}
	return v.InMsgs
}

// controlPercentile returns the p-th percentile (nearest rank) in microseconds.
func controlPercentile(ds []time.Duration, p float64) float64 {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(p/100*float64(len(s))+0.5) - 1
	i = max(0, min(i, len(s)-1))
	return float64(s[i].Nanoseconds()) / 1e3
}

func printControl(w io.Writer, format string, r controlReport) error {
	if format == "json" {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(r)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "\tp50 µs\tp90 µs\tp99 µs\tmsgs/req\t\n")
	fmt.Fprintf(tw, "handoff\t%.1f\t%.1f\t%.1f\t%.2f\t\n", r.HandoffP50us, r.HandoffP90us, r.HandoffP99us, r.MsgsPerRequest)
	fmt.Fprintf(tw, "nats request-reply\t%.1f\t%.1f\t%.1f\t%.2f\t\n", r.NATSP50us, r.NATSP90us, r.NATSP99us, r.NATSMsgsPerRequest)
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "ratio p50 %.2f (goal <= %.1f), p99 %.2f; %d requests, request %d B, reply %d B, payload %d B, nats-server %s",
		r.RatioP50, r.GoalRatioP50, r.RatioP99, r.Requests, r.RequestBytes, r.ReplyBytes, r.PayloadBytes, r.NATSServerVersion)
	if r.HandoffErrors > 0 {
		fmt.Fprintf(w, "; %d handoffs failed", r.HandoffErrors)
	}
	fmt.Fprintln(w)
	return nil
}
