package service

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.opentelemetry.io/otel/trace"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/topology"
	"github.com/handoff-io/handoff/internal/ucx"
	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/transfer/wire"
	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/admin"
	"github.com/handoff-io/handoff/worker/config"
)

// Endpoints are the addresses a running worker listens on.
type Endpoints struct {
	HTTP  string // decode API (host:port), empty for prefill
	Admin string // admin HTTP, empty when disabled
	Data  string // data-plane TCP, empty in local mode
}

// Options are the seams of Run: shared collaborators in standalone mode and
// in tests.
type Options struct {
	// Logger defaults to the config's logger on stderr.
	Logger *slog.Logger
	// Registry and Metrics are shared by the workers of one process
	// (standalone); nil creates a private pair.
	Registry *prometheus.Registry
	Metrics  *worker.Metrics
	// Admin, when set, is used instead of serving a new admin endpoint (the
	// in-process prefill of standalone mode adds its checks to decode's).
	Admin *admin.Server
	// CheckPrefix prefixes the names of the worker's readiness checks (to
	// tell two workers sharing one admin endpoint apart).
	CheckPrefix string
	// Gate, when set, is the readiness gate the worker opens once it serves
	// (standalone adds both workers' gates before starting either); nil: the
	// worker adds its own first thing.
	Gate *admin.Gate
	// Ready is called once the worker serves.
	Ready func(Endpoints)
	// Abort, when it ends, cuts the drain short (the second stop signal):
	// what is left fails at once and the worker returns ErrAborted. Nil
	// never ends.
	Abort context.Context
	// TracerProvider traces the worker's requests; nil: the one the OTEL_*
	// environment configures, if any (startTracing).
	TracerProvider trace.TracerProvider
	// Stdout receives the standalone banner; nil means os.Stdout.
	Stdout io.Writer
	// Stderr receives the logs when Logger is nil; nil means os.Stderr.
	Stderr io.Writer
	// CUDA opens the CUDA driver for --memory cuda; nil means cuda.Open
	// (libcuda.so.1, or $HANDOFF_LIBCUDA). Tests pass a fake.
	CUDA func() (cuda.Driver, error)
}

func (o *Options) fill(cfg *config.Config) {
	if o.Stdout == nil {
		o.Stdout = os.Stdout
	}
	if o.Stderr == nil {
		o.Stderr = os.Stderr
	}
	if o.Logger == nil {
		o.Logger = cfg.Logger(o.Stderr)
	}
	if o.Registry == nil {
		o.Registry = prometheus.NewRegistry()
		o.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	if o.Metrics == nil {
		o.Metrics = worker.NewMetrics(o.Registry)
	}
	if o.Abort == nil {
		o.Abort = context.Background()
	}
}

// aborted is the worker's result after its drain: ErrAborted when the
// abort context ended it.
func (o *Options) aborted() error {
	if o.Abort.Err() != nil {
		return ErrAborted
	}
	return nil
}

// node is what both roles build: the model, the ranks over their arenas and,
// in remote mode, the data-plane engine whose regions back the arenas.
type node struct {
	cfg         config.Config
	log         *slog.Logger
	exec        model.Executor
	spec        model.Spec // with the block size applied
	fingerprint string
	ranks       []*worker.Rank
	tranks      []*transfer.RankRegions // remote only
	data        *rdma.Engine            // remote only
	host        topology.Host           // remote only: GPUs and NICs, logged at start-up
	tpMore      tpShards                // remote only, --tp-size > 1
	mem         *cacheMemory            // where the pools' arenas live (--memory)
}

func buildNode(cfg config.Config, log *slog.Logger, remote bool, openCUDA func() (cuda.Driver, error)) (*node, error) {
	exec, err := model.Lookup(cfg.Model)
	if err != nil {
		return nil, err
	}
	spec := exec.Spec()
	spec.KV.TokensPerBlock = cfg.TokensPerBlock
	poolSpec, err := tpPoolSpec(cfg, exec) // one shard's shapes (--tp-size)
	if err != nil {
		return nil, err
	}
	cks := cfg.StateCheckpoints
	if cks < 0 {
		cks = worker.DefaultStateCheckpoints(cfg.MaxBatchSize, poolSpec.Mamba.RowBytes())
	}
	switch {
	case cfg.PrefixCache == "off":
		cks = 0 // off behaves exactly as before: no rows for it either
	case cfg.Role == worker.RoleDecode && cfg.Prefill == "remote" && cfg.StateReturn == "off":
		cks = 0 // it never prefills: its prefill workers keep the states
	case cfg.Memory == "cuda":
		// The CPU model cannot resume a prefill in device memory
		// (model.CopyState): rows there would be GPU memory for nothing.
		log.Warn("prefix cache off: caches in device memory cannot be resumed from a cached state yet")
		cks = 0
	}
	pp := worker.PoolParams{
		MaxBatchSize: cfg.MaxBatchSize, AttentionDP: cfg.AttentionDP,
		TokensPerBlock: cfg.TokensPerBlock, KVBlocks: cfg.KVBlocks, StateCheckpoints: cks,
	}
	if cfg.Role == worker.RoleDecode {
		// Only decode verifies drafts: it reserves a padding row per
		// reachable draft length and a scratch row per real row.
		pp.DraftTokens, pp.DraftLenSchedule, pp.AcceptanceGating = cfg.SpecTokens(), cfg.DraftLenSchedule, cfg.AcceptanceGating()
	}
	pools, err := worker.PoolConfig(poolSpec, pp)
	if err != nil {
		return nil, err
	}
	n := &node{cfg: cfg, log: log, exec: exec, spec: spec, fingerprint: spec.Fingerprint()}
	if n.mem, err = openMemory(cfg, log, openCUDA); err != nil {
		return nil, err
	}
	if remote {
		rc := rdma.Config{Agent: rdma.AgentID(cfg.InstanceID), TCPAddr: cfg.DataAddr, Advertise: cfg.DataAdvertise, TCPLanes: cfg.TCPLanes, Logger: log}
		if cfg.Transport == string(rdma.TransportUCX) && !ucx.Available {
			return nil, errors.New("--transport ucx: this build has no UCX: build with -tags ucx (linux, cgo, libucx-dev; scripts/install-ucx)")
		}
		if cfg.Transport != "auto" {
			rc.Transports = []rdma.Transport{rdma.Transport(cfg.Transport)}
			if cfg.Transport != "tcp" {
				// TCP stays available as the fallback for remote peers.
				rc.Transports = append(rc.Transports, rdma.TransportTCP)
			}
		}
		if rc.TLS, err = dataTLS(cfg); err != nil {
			return nil, err
		}
		// What this host offers the data path, in one log line; a host
		// without NVML (or a CGO_ENABLED=0 build) has no GPUs, not an error.
		dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		n.host, err = topology.DiscoverAndLog(dctx, log)
		cancel()
		if err != nil {
			log.Warn("host topology discovery failed; continuing without it", "err", err)
		}
		if n.mem.device() {
			gpuDataPath(&rc, n.host, n.mem.dev.UUID().String(), interfaceAddrs, log)
		}
		if n.data, err = rdma.New(rc); err != nil {
			n.close()
			return nil, fmt.Errorf("data plane: %w", err)
		}
		if addr := n.data.TCPListenAddr(); addr != "" {
			logListening(log, "data", addr, "advertise", n.dataAddr())
		}
	}
	for i := 0; i < cfg.DPSize; i++ {
		m, err := hybrid.New(pools)
		if err != nil {
			n.close()
			return nil, err
		}
		var kvArena, mArena []byte
		var kvDev, mDev *cuda.Arena // nil: host memory
		if n.mem.device() {
			// The pools live in device memory; the model computes over host
			// copies of each request's bytes, moved per step.
			if kvDev, mDev, err = n.mem.arenas(pools.KV.ArenaBytes(), pools.Mamba.ArenaBytes()); err != nil {
				n.close()
				return nil, err
			}
		}
		if remote {
			kvr, err := n.mem.register(n.data, fmt.Sprintf("rank%d-kv", i), kvDev, pools.KV.ArenaBytes())
			if err != nil {
				n.close()
				return nil, fmt.Errorf("register kv arena: %w", err)
			}
			mr, err := n.mem.register(n.data, fmt.Sprintf("rank%d-mamba", i), mDev, pools.Mamba.ArenaBytes())
			if err != nil {
				n.close()
				return nil, fmt.Errorf("register mamba arena: %w", err)
			}
			tr, err := n.rankRegions(i, m, kvr, mr)
			if err != nil {
				n.close()
				return nil, err
			}
			n.tranks = append(n.tranks, tr)
			kvArena, mArena = kvr.Bytes(), mr.Bytes()
		}
		if kvArena == nil { // local, or device memory: host arenas (copies) for the model
			kvArena, mArena = make([]byte, pools.KV.ArenaBytes()), make([]byte, pools.Mamba.ArenaBytes())
		}
		rexec, err := n.tpExec(i, n.exec, m)
		if err != nil {
			n.close()
			return nil, err
		}
		if kvDev != nil {
			// Around the whole group: shard 0's bytes move here, the
			// other shards' in the group (model.ShardPools).
			rexec = model.OnDevice(rexec, kvDev, mDev)
		}
		r, err := worker.NewRank(i, m, rexec, kvArena, mArena)
		if err != nil {
			n.close()
			return nil, err
		}
		n.ranks = append(n.ranks, r)
	}
	log.Info("ranks ready", "model", spec.Name, "fingerprint", n.fingerprint, "dp_size", cfg.DPSize, "tp_size", cfg.TPSize,
		"attention_dp", cfg.AttentionDP, "max_batch_size", cfg.MaxBatchSize, "kv_blocks", pools.KV.Blocks,
		"tokens_per_block", pools.KV.TokensPerBlock, "kv_arena_bytes", pools.KV.ArenaBytes(),
		"mamba_rows", pools.Mamba.TotalRows(), "mamba_arena_bytes", pools.Mamba.ArenaBytes(),
		"prefix_cache", cfg.PrefixCache, "state_checkpoints", pools.Mamba.CheckpointRows)
	if cks > 0 && !model.Chunked(n.ranks[0].Executor()) {
		log.Warn("prefix cache off: this executor cannot resume a prefill from a cached state")
	}
	return n, nil
}

// capacity is the node's room, for the instance registry.
func (n *node) capacity() wire.Capacity {
	c := wire.Capacity{Ranks: len(n.ranks)}
	for _, r := range n.ranks {
		rows, blocks := r.Manager().Capacity()
		s := r.Manager().Stats()
		c.Rows += rows
		c.Blocks += blocks
		c.FreeRows += s.RowsFree
		c.FreeBlocks += s.BlocksFree - s.BlocksHeadroom
	}
	return c
}

func (n *node) dataAddr() string {
	if n.data == nil {
		return ""
	}
	return n.data.Descriptor().TCPAddr
}

func (n *node) close() {
	if n.data != nil {
		if err := n.data.Close(); err != nil {
			n.log.Warn("data plane close", "err", err)
		}
	}
	n.mem.close(n.log) // after the data plane: it lands in the arenas
}

// transportInfo sets handoff_transport_info for the transport used with
// agent (known to the writing side), else for the configured transport when
// it is not "auto".
func (n *node) transportInfo(m *worker.Metrics, agent string) {
	if n.data == nil {
		return
	}
	if t, ok := n.data.TransportFor(rdma.AgentID(agent)); ok && agent != "" {
		m.TransportInfo.WithLabelValues(string(t)).Set(1)
		return
	}
	if n.cfg.Transport != "auto" {
		m.TransportInfo.WithLabelValues(n.cfg.Transport).Set(1)
	}
}

// readTimeout bounds reading one request, body included, so a client that
// stalls mid-request does not hold its connection and handler forever.
// Responses (SSE streams included) are not bounded.
var readTimeout = time.Minute

// logListening logs the address a listener is bound to, the port the kernel
// chose for ":0" included: one "listening" line at info for each of the
// worker's listeners, named after its flag ("http" for --http-addr, "admin",
// "data"), as soon as it is open (before the worker serves). The
// integration tests learn their workers' ports from these lines.
func logListening(log *slog.Logger, listener, addr string, attrs ...any) {
	log.Info("listening", append([]any{"listener", listener, "addr", addr}, attrs...)...)
}

// httpServer serves h on a listener it opens now, so the address is known
// (and a busy port fails the start) before Serve.
type httpServer struct {
	srv  *http.Server
	ln   net.Listener
	done chan error
}

// listenHTTP opens the listener named name (logListening) on addr and
// serves h on it.
func listenHTTP(name, addr string, h http.Handler, log *slog.Logger) (*httpServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	logListening(log, name, ln.Addr().String())
	s := &httpServer{
		srv: &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: readTimeout, IdleTimeout: 2 * time.Minute,
			ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)},
		ln: ln, done: make(chan error, 1),
	}
	go func() { s.done <- s.srv.Serve(ln) }()
	return s, nil
}

func (s *httpServer) addr() string { return s.ln.Addr().String() }

// drain closes each connection once its request is answered (idle ones
// now): a draining worker's refusals then send clients that pool
// connections to another replica instead of back to it.
func (s *httpServer) drain() { s.srv.SetKeepAlivesEnabled(false) }

// shutdown stops the server gracefully until ctx ends, then closes it, and
// waits for its goroutine.
func (s *httpServer) shutdown(ctx context.Context) error {
	err := s.srv.Shutdown(ctx)
	if err != nil {
		err = errors.Join(err, s.srv.Close())
	}
	if serr := <-s.done; !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	return err
}

// startAdmin serves the admin endpoints unless o.Admin is shared or the
// address is empty, and returns the worker's closed readiness gate (o.Gate,
// else one named "serving" with o.CheckPrefix, added before the endpoint
// listens): /readyz is 503 until the worker opens it.
func startAdmin(cfg config.Config, o *Options) (*admin.Server, *admin.Gate, *httpServer, error) {
	a := o.Admin
	if a == nil {
		a = admin.New(o.Registry)
	}
	gate := o.Gate
	if gate == nil {
		gate = a.AddGate(o.CheckPrefix + "serving")
	}
	if o.Admin != nil || cfg.AdminAddr == "" {
		return a, gate, nil, nil
	}
	s, err := listenHTTP("admin", cfg.AdminAddr, a.Handler(), o.Logger)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("admin listener: %w", err)
	}
	return a, gate, s, nil
}

// runScheduler runs sched's loop on a goroutine; the returned stop cancels
// it and waits.
func runScheduler(sched *worker.Scheduler, log *slog.Logger) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := sched.Run(ctx); err != nil {
			log.Error("scheduler loop", "err", err)
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

// shutdownQuietly stops an optional server, logging a failure.
func shutdownQuietly(s *httpServer, log *slog.Logger) {
	if s == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := s.shutdown(ctx); err != nil {
		log.Warn("admin shutdown", "err", err)
	}
}

// dataTLS loads the tcp data path's mutual TLS from cfg's files (nil: off).
func dataTLS(cfg config.Config) (*tls.Config, error) {
	t := cfg.DataTLS
	if t.CA == "" {
		return nil, nil
	}
	cert, err := tls.LoadX509KeyPair(t.Cert, t.Key)
	if err != nil {
		return nil, fmt.Errorf("data plane tls: %w", err)
	}
	pem, err := os.ReadFile(t.CA)
	if err != nil {
		return nil, fmt.Errorf("data plane tls: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("data plane tls: no certificate in %s", t.CA)
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, ClientCAs: pool}, nil
}
