package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/transfer/wire"
	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/api"
	"github.com/handoff-io/handoff/worker/config"
)

// RunDecode runs a decode worker until ctx ends, then drains: readiness
// turns 503, new requests are refused with 503, in-flight requests finish
// for up to cfg.DrainTimeout (or until o.Abort ends), and everything is
// closed. It returns nil after a drain, ErrAborted after an aborted one, or
// the error that kept the worker from starting.
func RunDecode(ctx context.Context, cfg config.Config, o Options) error {
	o.fill(&cfg)
	if cfg.Standalone {
		return runStandalone(ctx, cfg, o)
	}
	log := o.Logger
	tp, stopTracing, err := startTracing(ctx, &o, worker.RoleDecode, cfg.InstanceID)
	if err != nil {
		return err
	}
	defer stopTracing()
	// Remote and auto both reach prefill workers over NATS and the data
	// path; auto may also prefill any request here.
	remote, auto := cfg.Prefill != "local", cfg.Prefill == "auto"
	adm, gate, admSrv, err := startAdmin(cfg, &o)
	if err != nil {
		return err
	}
	defer shutdownQuietly(admSrv, log)
	n, err := buildNode(cfg, log, remote, o.CUDA)
	if err != nil {
		return err
	}
	defer n.close()
	if remote {
		registerHostStats(o.Registry, worker.RoleDecode, n.host, log)
	}

	var (
		source     worker.CacheSource
		nc         *nats.Conn
		dec        *transfer.Decoder
		connected  atomic.Pointer[nats.Conn]
		registered atomic.Bool
	)
	if remote {
		adm.AddCheck("data_path", func() error { return nil }) // the listener is open once buildNode returned
		adm.AddCheck("nats", func() error {
			if c := connected.Load(); c != nil {
				return natsCheck(c)()
			}
			return errors.New("connecting")
		})
		adm.AddCheck("registered", func() error {
			if registered.Load() {
				return nil
			}
			return errors.New("not registered")
		})
		if nc, err = connectNATS(ctx, cfg.NATS, "handoff-decode/"+cfg.InstanceID, log); err != nil {
			return err
		}
		defer nc.Close()
		connected.Store(nc)
		// The decoder's registry outlives ctx (it is closed after the drain);
		// only its start (which waits for JetStream) ends with ctx.
		sctx, stopStart := startContext(ctx)
		defer stopStart()
		// With the prefix cache on, the prefill instances publish what
		// their caches hold: route each prompt to its longest state.
		var states transfer.StateIndex
		if cfg.PrefixCache == "on" && cfg.PrefillRouting == "state" {
			es, err := transfer.StartEventSubscriber(nc, transfer.EventSubscriberConfig{Namespace: cfg.Namespace, Logger: log})
			if err != nil {
				return err
			}
			defer es.Close()
			registerEventStats(o.Registry, es, log)
			states = es
		}
		if dec, err = transfer.NewDecoder(sctx, transfer.DecoderConfig{
			Instance: cfg.InstanceID, Namespace: cfg.Namespace, Fingerprint: n.fingerprint, TP: cfg.TPSize,
			DefaultTimeout: cfg.RequestTimeout, Logger: log,
			Registry: transfer.RegistryConfig{Replicas: cfg.RegistryReplicas},
			// Address a chosen prefill instance from the first attempt, so a
			// worker that dies mid-request fails it at once (and it is retried
			// elsewhere) instead of at the deadline.
			DirectFirst: true,
			// A conversation's next turn goes to the prefill instance whose
			// prefix cache holds its last one, while it has room.
			PrefixAffinity: cfg.PrefixCache == "on" && cfg.PrefillRouting != "load",
			States:         states,
		}, nc, n.data); err != nil {
			return err
		}
		defer func() {
			if err := dec.Close(); err != nil {
				log.Warn("decoder close", "err", err)
			}
		}()
		registered.Store(true)
		// With auto, a decode worker with no prefill instance prefills
		// every request itself: it is ready without one.
		if !auto {
			presence := &prefillPresence{grace: cfg.PrefillGrace}
			adm.AddCheck("prefill_instances", func() error {
				now := time.Now()
				insts := dec.Registry().Instances(wire.RolePrefill, now)
				usable, other := 0, ""
				for _, in := range insts {
					switch {
					case in.Fingerprint == n.fingerprint && !in.Draining:
						usable++
					case in.Fingerprint != n.fingerprint:
						other = in.Fingerprint
					}
				}
				err := presence.check(now, len(insts), usable)
				if err != nil && other != "" {
					// Name the mismatch: the layout covers the model and
					// its options (a draft head, the SSM dtype) and the
					// block size, and both sides must agree on them.
					err = fmt.Errorf("%w; prefill layout %s, this worker's %s (model %s: its options, ?mtp=1 and ?ssm_dtype, and --tokens-per-block must match)",
						err, other, n.fingerprint, cfg.Model)
				}
				return err
			})
		}
		registerDecoderStats(o.Registry, dec, log)
		registerDataPathStats(o.Registry, n.data, log)
		source = &transferSource{dec: dec, n: n, m: o.Metrics, timeout: cfg.RequestTimeout}
	}
	var router worker.Router
	if auto {
		router = autoRouter(cfg, dec)
	}
	var offers worker.StateOffers
	if remote && stateReturn(cfg) && cfg.Memory != "cuda" {
		offers = &stateOffers{nc: nc, cfg: cfg, fp: n.fingerprint, log: log}
	}
	sched, err := worker.NewScheduler(worker.Config{
		Role: worker.RoleDecode, AttentionDP: cfg.AttentionDP, QueueSize: cfg.QueueSize, PrefillChunkTokens: cfg.PrefillChunkTokens,
		PrefixCache: cfg.PrefixCache == "on", CheckpointInterval: cfg.StateCheckpointInterval,
		Source: source, Router: router, Offers: offers, Logger: log, Metrics: o.Metrics,
		Speculation: worker.Speculation{Method: cfg.Speculative, Tokens: cfg.SpecTokens(), Schedule: cfg.DraftLenSchedule,
			GateWindow: cfg.AcceptanceRateWindow, GateThreshold: cfg.AcceptanceRateThreshold},
	}, n.ranks)
	if err != nil {
		return err
	}
	stopLoop := runScheduler(sched, log)
	defer stopLoop()
	if remote {
		// What its caches hold (the conversations' blocks and end-of-turn
		// states, with the prefix cache) is published like a prefill
		// worker's: a routing front in front of several decode workers
		// can steer a conversation to the one holding it. Decoders route
		// prefills among prefill instances only, so they pass these by.
		stopEvents, err := startEventPublisher(nc, cfg, n, log)
		if err != nil {
			return err
		}
		defer stopEvents()
	}
	stopStates := func(context.Context) {}
	if offers != nil {
		sctx, stopStart := startContext(ctx)
		se, stop, err := startStateServer(sctx, nc, cfg, n, sched, o.Metrics, log)
		stopStart()
		if err != nil {
			return err
		}
		adm.BeforeScrape(se.syncStats)
		var once sync.Once
		stopStates = func(ctx context.Context) {
			once.Do(func() {
				offers.(*stateOffers).stop() // nothing offered that nobody serves
				stop(ctx)
			})
		}
		defer func() { // an error return: bounded, the drain had its turn otherwise
			sctx, cancel := context.WithTimeout(context.Background(), time.Second)
			stopStates(sctx)
			cancel()
		}()
	}
	adm.AddCheck("scheduler", func() error {
		if sched.Draining() {
			return errors.New("draining")
		}
		return nil
	})
	apiSrv, err := listenHTTP("http", cfg.HTTPAddr, api.New(api.Config{Model: cfg.Model, Logger: log, Metrics: o.Metrics,
		WriteTimeout: cfg.WriteTimeout, TracerProvider: tp}, sched), log)
	if err != nil {
		return fmt.Errorf("api listener: %w", err)
	}
	ep := Endpoints{HTTP: apiSrv.addr(), Data: n.dataAddr()}
	if admSrv != nil {
		ep.Admin = admSrv.addr()
	}
	// The listener accepts connections from here on (the kernel queues them
	// until Serve takes them): only now may readiness pass.
	gate.Open()
	log.Info("decode serving", "http", ep.HTTP, "admin", ep.Admin, "data", ep.Data, "prefill", cfg.Prefill,
		"max_context", sched.MaxContext())
	if o.Ready != nil {
		o.Ready(ep)
	}

	<-ctx.Done()
	log.Info("draining", "live", sched.Live(), "timeout", cfg.DrainTimeout.String())
	apiSrv.drain()
	adm.SetDraining()
	dctx, cancel := context.WithTimeout(o.Abort, cfg.DrainTimeout)
	stopStates(dctx) // states being pulled are served first
	if err := sched.Drain(dctx); err != nil {
		log.Warn("drain ended; failing the requests left", "live", sched.Live(), "aborted", o.Abort.Err() != nil)
	}
	cancel()
	// Stopping the loop fails what is left (ErrClosed), so every handler
	// answers and returns; then the API server stops.
	stopLoop()
	// The handlers answer at once now (503); an abort shortens how long
	// they get to, but does not cut them off mid-answer.
	grace := 5 * time.Second
	if o.Abort.Err() != nil {
		grace = time.Second
	}
	sctx, cancel := context.WithTimeout(context.Background(), grace)
	if err := apiSrv.shutdown(sctx); err != nil {
		log.Warn("api shutdown", "err", err)
	}
	cancel()
	log.Info("decode stopped")
	return o.aborted()
}

// transferSource fetches prefilled caches through the transfer protocol.
type transferSource struct {
	dec     *transfer.Decoder
	n       *node
	m       *worker.Metrics
	timeout time.Duration
}

var (
	_ worker.CacheSource = (*transferSource)(nil)
	_ worker.Quarantine  = (*transfer.QuarantinedError)(nil) // the quarantine a transferSource's Fetch fails with
)

func (s *transferSource) Fetch(ctx context.Context, f worker.FetchRequest) (worker.FetchResult, error) {
	// The scheduler prepared the resources at admission and frees them once
	// Fetch returned: they are the handoff's destination.
	// A delta handoff's leading blocks are the rank's cache's already: the
	// destination is the rest (transfer.SkipBlocks).
	res, err := transfer.SkipBlocks(f.Resources, f.Skip)
	if err != nil {
		return worker.FetchResult{}, err
	}
	dest, err := s.n.tranks[f.Rank].Resolve(res)
	if err != nil {
		return worker.FetchResult{}, err
	}
	out, err := s.dec.Handoff(ctx, transfer.Request{
		ID: f.ID, Tokens: f.Prompt, CacheKey: f.CacheKey, Drafts: f.Drafts, Skip: f.Skip,
		Sampling: wireSampling(f.Sampling),
		Deadline: time.Now().Add(s.timeout),
		Dest:     dest, Holder: f.Holder,
	})
	if err != nil {
		return worker.FetchResult{}, classify(ctx, err)
	}
	s.n.transportInfo(s.m, out.Instance)
	fr := worker.FetchResult{
		First: out.FirstToken, Cached: out.Cached, Compute: out.Prefill, Transfer: out.Transfer,
		KVBytes: int64(out.KVBytes), MambaBytes: int64(out.MambaBytes), Drafts: out.Drafts,
		Instance: out.Instance,
	}
	if f.Logprobs {
		var lp model.Logprobs
		if err := lp.UnmarshalBinary(out.Logprobs); err != nil {
			return worker.FetchResult{}, fmt.Errorf("first token logprobs from %s: %w", out.Instance, err)
		}
		fr.FirstLogprobs = &lp
	}
	return fr, nil
}

// wireSampling is the transfer form of a request's sampling.
func wireSampling(s worker.Sampling) wire.Sampling {
	w := wire.Sampling{Temperature: s.Temperature, Seed: s.Seed}
	if s.TopP > 0 && s.TopP < 1 {
		w.TopP = s.TopP
	}
	if s.Logprobs {
		w.Logprobs = uint8(1 + s.TopLogprobs)
	}
	return w
}

// samplingOf is the worker form of a request's wire sampling.
func samplingOf(w wire.Sampling) worker.Sampling {
	s := worker.Sampling{Temperature: w.Temperature, TopP: w.TopP, Seed: w.Seed}
	if w.Logprobs > 0 {
		s.Logprobs, s.TopLogprobs = true, int(w.Logprobs)-1
	}
	return s
}

// classify wraps a handoff error with the worker's transfer classes.
func classify(ctx context.Context, err error) error {
	switch {
	case errors.Is(err, transfer.ErrTooLong):
		// Every prefill worker that answered has smaller pools than this
		// decode worker: the client's request, not the fleet's state.
		return fmt.Errorf("%w: %w", worker.ErrTooLong, err)
	case errors.Is(err, transfer.ErrNoPrefillWorker), errors.Is(err, transfer.ErrCapacityRefused),
		errors.Is(err, transfer.ErrLayoutMismatch), errors.Is(err, transfer.ErrPayloadTooLarge),
		errors.Is(err, transfer.ErrDummyRequest):
		return fmt.Errorf("%w: %w", worker.ErrTransferRefused, err)
	case errors.Is(err, transfer.ErrPeerFailed), errors.Is(err, transfer.ErrPrefillFailed),
		errors.Is(err, transfer.ErrIntegrity), errors.Is(err, transfer.ErrBadMessage):
		// The remote prefill did not deliver: its worker died or failed
		// mid-way, its executor failed (prefill_failed, final: the
		// session does not retry it), its bytes disagree with its reply,
		// or its messages could not be read. The fleet's failure, not
		// this server's: 503, and with --prefill auto a local prefill,
		// which overwrites whatever bytes it left (the grant is revoked).
		return fmt.Errorf("%w: %w", worker.ErrTransferFailed, err)
	case errors.Is(err, transfer.ErrTimeout):
		return fmt.Errorf("%w: %w", worker.ErrTransferTimeout, err)
	case ctx.Err() != nil:
		return fmt.Errorf("%w: %w", ctx.Err(), err)
	}
	return err
}

// registerDecoderStats exports the decoder's retry count: handoffs retried on
// another prefill instance (a refusal, no responders, or the instance died:
// its registry entry expired or its data-path connections closed).
func registerDecoderStats(reg prometheus.Registerer, dec *transfer.Decoder, log *slog.Logger) {
	c := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name:        "handoff_retries_total",
		Help:        "Handoff attempts retried on another prefill instance (refused, no responders, instance died).",
		ConstLabels: prometheus.Labels{"role": string(worker.RoleDecode)},
	}, func() float64 { return float64(dec.Stats().Retries) })
	if err := reg.Register(c); err != nil {
		log.Warn("metrics: handoff_retries_total not registered", "err", err)
	}
	for by, f := range map[string]func(transfer.DecoderStats) uint64{
		"state":    func(s transfer.DecoderStats) uint64 { return s.ByState },
		"affinity": func(s transfer.DecoderStats) uint64 { return s.ByAffinity },
	} {
		c := prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "handoff_prefill_routed_total",
			Help:        "Handoffs whose first attempt went to a prefill instance for the state it holds (by=state, from its cache events) or by prefix affinity (by=affinity); the rest went by load.",
			ConstLabels: prometheus.Labels{"role": string(worker.RoleDecode), "by": by},
		}, func() float64 { return float64(f(dec.Stats())) })
		if err := reg.Register(c); err != nil {
			log.Warn("metrics: handoff_prefill_routed_total not registered", "err", err)
		}
	}
}

// registerEventStats exposes what the decoder's cache-event subscriber
// applied, dropped and resynchronised.
func registerEventStats(reg prometheus.Registerer, es *transfer.EventSubscriber, log *slog.Logger) {
	for result, f := range map[string]func(transfer.EventStats) uint64{
		"applied":   func(s transfer.EventStats) uint64 { return s.Applied },
		"stale":     func(s transfer.EventStats) uint64 { return s.Stale },
		"malformed": func(s transfer.EventStats) uint64 { return s.Malformed },
		"gap":       func(s transfer.EventStats) uint64 { return s.Gaps },
	} {
		c := prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "handoff_cache_event_batches_total",
			Help:        "Cache event batches from prefill instances, by what the router's index did with them (gap: out of order or over bounds, a snapshot is asked for).",
			ConstLabels: prometheus.Labels{"role": string(worker.RoleDecode), "result": result},
		}, func() float64 { return float64(f(es.Stats())) })
		if err := reg.Register(c); err != nil {
			log.Warn("metrics: handoff_cache_event_batches_total not registered", "err", err)
		}
	}
	for result, f := range map[string]func(transfer.EventStats) uint64{
		"ok":     func(s transfer.EventStats) uint64 { return s.Syncs },
		"failed": func(s transfer.EventStats) uint64 { return s.SyncFailures },
	} {
		c := prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "handoff_cache_event_syncs_total",
			Help:        "Snapshots the router asked prefill instances for, to resynchronise a cache event stream.",
			ConstLabels: prometheus.Labels{"role": string(worker.RoleDecode), "result": result},
		}, func() float64 { return float64(f(es.Stats())) })
		if err := reg.Register(c); err != nil {
			log.Warn("metrics: handoff_cache_event_syncs_total not registered", "err", err)
		}
	}
}
