package service

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/trace"

	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/config"
)

// RunPrefill runs a prefill worker until ctx ends, then drains: readiness
// turns 503, the NATS service stops taking requests, in-flight ones finish
// (prefill and push) for up to cfg.DrainTimeout (or until o.Abort ends),
// and everything is closed. It returns nil, ErrAborted after an aborted
// drain, or the error that kept it from starting.
func RunPrefill(ctx context.Context, cfg config.Config, o Options) error {
	o.fill(&cfg)
	log := o.Logger
	tp, stopTracing, err := startTracing(ctx, &o, worker.RolePrefill, cfg.InstanceID)
	if err != nil {
		return err
	}
	defer stopTracing()
	adm, gate, admSrv, err := startAdmin(cfg, &o)
	if err != nil {
		return err
	}
	defer shutdownQuietly(admSrv, log)
	n, err := buildNode(cfg, log, true, o.CUDA)
	if err != nil {
		return err
	}
	defer n.close()
	registerHostStats(o.Registry, worker.RolePrefill, n.host, log)
	var (
		connected  atomic.Pointer[nats.Conn]
		registered atomic.Bool
	)
	adm.AddCheck(o.CheckPrefix+"data_path", func() error { return nil })
	adm.AddCheck(o.CheckPrefix+"nats", func() error {
		if c := connected.Load(); c != nil {
			return natsCheck(c)()
		}
		return errors.New("connecting")
	})
	adm.AddCheck(o.CheckPrefix+"registered", func() error {
		if registered.Load() {
			return nil
		}
		return errors.New("not registered")
	})
	nc, err := connectNATS(ctx, cfg.NATS, "handoff-prefill/"+cfg.InstanceID, log)
	if err != nil {
		return err
	}
	defer nc.Close()
	connected.Store(nc)

	// States returned by decode workers are pulled with a decoder of
	// their own (state.go).
	var states worker.CacheSource
	if stateReturn(cfg) && cfg.Memory != "cuda" {
		sctx, stopStart := startContext(ctx)
		sdec, err := transfer.NewDecoder(sctx, transfer.DecoderConfig{
			Instance: cfg.InstanceID, Namespace: cfg.Namespace, Prefix: transfer.StatePrefix(""), Fingerprint: n.fingerprint, TP: cfg.TPSize,
			DefaultTimeout: statePullTimeout(cfg), Logger: log.With("part", "state-puller"), NoRegistry: true,
		}, nc, n.data)
		stopStart()
		if err != nil {
			return err
		}
		defer func() {
			if err := sdec.Close(); err != nil {
				log.Warn("state decoder close", "err", err)
			}
		}()
		states = &transferSource{dec: sdec, n: n, m: o.Metrics, timeout: statePullTimeout(cfg)}
	}
	sched, err := worker.NewScheduler(worker.Config{
		Role: worker.RolePrefill, AttentionDP: cfg.AttentionDP, QueueSize: cfg.QueueSize, PrefillChunkTokens: cfg.PrefillChunkTokens,
		PrefixCache: cfg.PrefixCache == "on", CheckpointInterval: cfg.StateCheckpointInterval,
		StateSource: states, Logger: log, Metrics: o.Metrics,
	}, n.ranks)
	if err != nil {
		return err
	}
	stopLoop := runScheduler(sched, log)
	defer stopLoop()
	pe := &prefillExec{sched: sched, n: n, m: o.Metrics}
	pf, err := transfer.NewPrefiller(transfer.PrefillerConfig{
		Instance: cfg.InstanceID, Namespace: cfg.Namespace, Fingerprint: n.fingerprint,
		Capacity: n.capacity, Logger: log, TracerProvider: tp,
		Registry: transfer.RegistryConfig{Replicas: cfg.RegistryReplicas}, Layerwise: layerwiseOf(cfg), LayerwiseMinTokens: cfg.LayerwiseMinTokens,
	}, nc, n.data, pe)
	if err != nil {
		return err
	}
	pe.pf = pf
	// The registry outlives ctx: it is closed by Shutdown after the drain;
	// only the start (which waits for JetStream) ends with ctx.
	sctx, stopStart := startContext(ctx)
	err = pf.Start(sctx)
	stopStart()
	if err != nil {
		return err
	}
	registered.Store(true)
	stopEvents, err := startEventPublisher(nc, cfg, n, log)
	if err != nil {
		return err
	}
	defer stopEvents()
	stopAdopting := func() {}
	if states != nil {
		ad, err := startStateAdopter(nc, cfg, n.fingerprint, sched, o.Metrics, log)
		if err != nil {
			return err
		}
		stopAdopting = ad.stop
	}
	defer func() { stopAdopting() }() // before the loop stops: adoptions end through it
	gate.Open()
	adm.BeforeScrape(pe.syncStats)
	ep := Endpoints{Data: n.dataAddr()}
	if admSrv != nil {
		ep.Admin = admSrv.addr()
	}
	log.Info("prefill serving", "admin", ep.Admin, "data", ep.Data, "namespace", cfg.Namespace)
	if o.Ready != nil {
		o.Ready(ep)
	}

	<-ctx.Done()
	log.Info("draining", "live", sched.Live(), "timeout", cfg.DrainTimeout.String())
	adm.SetDraining()
	registered.Store(false)
	dctx, cancel := context.WithTimeout(o.Abort, cfg.DrainTimeout)
	stopAdopting()
	stopAdopting = func() {}
	if err := pf.Shutdown(dctx); err != nil {
		log.Warn("prefiller shutdown", "err", err)
	}
	if dctx.Err() != nil {
		// The prefiller aborted what was left (closed: the decoders retry
		// elsewhere), so the scheduler's drain below finds nothing to say.
		log.Warn("drain ended; the prefills left were aborted", "timeout", cfg.DrainTimeout.String(), "aborted", o.Abort.Err() != nil)
	}
	if err := sched.Drain(dctx); err != nil {
		log.Warn("drain ended; failing the requests left", "live", sched.Live(), "aborted", o.Abort.Err() != nil)
	}
	cancel()
	stopLoop()
	pe.syncStats()
	log.Info("prefill stopped")
	return o.aborted()
}

// prefillExec implements transfer.PrefillExecutor over the prefill scheduler.
type prefillExec struct {
	sched *worker.Scheduler
	n     *node
	m     *worker.Metrics
	pf    *transfer.Prefiller
	// state: a decode worker's state server (state.go): jobs are served
	// from its cache (worker.PrefillJob.FromCache), bytes counted as
	// returned states.
	state bool

	mu   sync.Mutex
	last transfer.PrefillerStats
}

var _ transfer.PrefillExecutor = (*prefillExec)(nil)

// Admit queues the job on the scheduler without waiting; a full queue, a
// draining scheduler or a prompt this worker's pools cannot hold is a capacity
// refusal, which the decoder may retry on another worker.
func (p *prefillExec) Admit(job transfer.Job) (transfer.AdmittedJob, error) {
	// The receiver's shards must be reachable from ours: a TP size the
	// model does not split over is refused by name before any byte moves.
	if _, err := p.n.tranks[0].Resharder(job.TP); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	if !job.Deadline.IsZero() {
		cancel()
		ctx, cancel = context.WithDeadline(context.Background(), job.Deadline)
	}
	if job.Span != nil {
		// The scheduler records the job's queue and compute under it.
		ctx = trace.ContextWithSpan(ctx, job.Span)
	}
	parts := &partSink{n: p.n, to: job.TP}
	partsFn := parts.part
	if p.state {
		partsFn = nil // a state from the cache is written whole
	}
	pend, err := p.sched.SubmitPrefill(ctx, worker.PrefillJob{
		Prompt: job.Tokens, Sampling: samplingOf(job.Sampling),
		LogID: fmt.Sprintf("%s-%d", job.From, job.RequestID),
		Parts: partsFn, Drafts: job.Drafts, FromCache: p.state,
	})
	if err != nil {
		cancel()
		if errors.Is(err, worker.ErrTooLong) {
			// Never to run here; another worker's pools may be larger.
			return nil, fmt.Errorf("%w: %w: %w", transfer.ErrCapacityRefused, transfer.ErrTooLong, err)
		}
		if errors.Is(err, worker.ErrQueueFull) || errors.Is(err, worker.ErrDraining) || errors.Is(err, worker.ErrClosed) {
			return nil, fmt.Errorf("%w: %w", transfer.ErrCapacityRefused, err)
		}
		return nil, err
	}
	return &prefillLease{p: p, pend: pend, cancel: cancel, parts: parts, from: job.From, to: job.TP, skip: job.Skip}, nil
}

// syncStats folds the prefiller's cumulative counters into the transfer
// metric of the prefill role.
func (p *prefillExec) syncStats() {
	if p.pf == nil {
		return
	}
	// The snapshot is taken under the lock: syncs run on many goroutines
	// (each release, each scrape), and one that read its snapshot before
	// another synced a newer one would set p.last back and count the
	// difference twice.
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.pf.Stats()
	if p.state {
		role := string(worker.RoleDecode)
		if s.Served > p.last.Served {
			p.m.StateReturns.WithLabelValues(role, "served").Add(float64(s.Served - p.last.Served))
		}
		if f, lf := s.Failed+s.Cancelled, p.last.Failed+p.last.Cancelled; f > lf {
			p.m.StateReturns.WithLabelValues(role, "failed").Add(float64(f - lf))
		}
		if s.KVBytes > p.last.KVBytes {
			p.m.StateReturnBytes.WithLabelValues(role, "kv").Add(float64(s.KVBytes - p.last.KVBytes))
		}
		if s.MambaBytes > p.last.MambaBytes {
			p.m.StateReturnBytes.WithLabelValues(role, "mamba").Add(float64(s.MambaBytes - p.last.MambaBytes))
		}
		p.last = s
		return
	}
	role := string(worker.RolePrefill)
	add := func(result string, now, before uint64) {
		if now > before {
			p.m.Transfers.WithLabelValues(role, result).Add(float64(now - before))
		}
	}
	add(worker.TransferOK, s.Served, p.last.Served)
	add(worker.TransferRefused, s.Refused, p.last.Refused)
	add(worker.TransferFailed, s.Failed, p.last.Failed)
	add(worker.TransferCancelled, s.Cancelled, p.last.Cancelled)
	if s.KVBytes > p.last.KVBytes {
		p.m.TransferBytes.WithLabelValues(role, "kv").Add(float64(s.KVBytes - p.last.KVBytes))
	}
	if s.MambaBytes > p.last.MambaBytes {
		p.m.TransferBytes.WithLabelValues(role, "mamba").Add(float64(s.MambaBytes - p.last.MambaBytes))
	}
	if s.StreamedBytes > p.last.StreamedBytes {
		p.m.StreamedBytes.WithLabelValues(role).Add(float64(s.StreamedBytes - p.last.StreamedBytes))
	}
	p.last = s
}

type prefillLease struct {
	p      *prefillExec
	pend   *worker.PendingPrefill
	cancel context.CancelFunc
	parts  *partSink // where prefill's finished parts go (layer-wise)
	from   string
	to     int // the receiver's TP size
	skip   int // leading KV blocks the receiver holds (a delta handoff)

	lease     *worker.Lease
	pushStart time.Time
}

func (l *prefillLease) Prefill(ctx context.Context) (transfer.Prefilled, error) {
	lease, err := l.pend.Wait(ctx)
	if err != nil {
		// The job keeps its blocks and row until Release abandons it: the
		// layer-wise stream may still read what its parts named, and the
		// prefiller releases only once that stream stopped.
		if errors.Is(err, worker.ErrNotCached) {
			// A state asked for is no longer in the cache: a refusal (the
			// scheduler counts it), not a failure.
			err = fmt.Errorf("%w: %w", transfer.ErrCapacityRefused, err)
		}
		return transfer.Prefilled{}, err
	}
	l.lease = lease
	l.pushStart = time.Now()
	res, err := transfer.SkipBlocks(lease.Resources, l.skip)
	if err != nil {
		return transfer.Prefilled{}, err
	}
	src, err := l.p.n.tranks[lease.Rank].Source(res, l.to)
	if err != nil {
		return transfer.Prefilled{}, err
	}
	out := transfer.Prefilled{FirstToken: lease.First, Cached: lease.Cached, Source: src, Drafts: lease.Drafts}
	if lease.FirstLogprobs != nil {
		if out.Logprobs, err = lease.FirstLogprobs.MarshalBinary(); err != nil {
			return transfer.Prefilled{}, err
		}
	}
	return out, nil
}

// Release lets go of the job (transfer calls it once, after every read of
// its blocks and row, the stream's included): the scheduler frees them
// only now.
func (l *prefillLease) Release() {
	if l.lease != nil && l.p.state {
		l.lease.Release()
	} else if l.lease != nil {
		role := string(worker.RolePrefill)
		// Bytes are counted from the prefiller's stats: only served handoffs.
		l.p.m.TransferDuration.WithLabelValues(role).Observe(time.Since(l.pushStart).Seconds())
		l.lease.Release()
	} else {
		l.pend.Abandon()
	}
	l.cancel()
	l.p.n.transportInfo(l.p.m, l.from)
	l.p.syncStats()
}
