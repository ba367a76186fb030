package rdma

// The Engine and its lifecycle: New starts the served transports, Register
// adds regions, Descriptor describes them to peers, Close takes it all down.

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// Engine owns regions, grants, listeners and peer connections. It is both a
// receiver (it opens grants over its regions) and a writer (it writes its
// regions into peers' grants). All methods are safe for concurrent use.
type Engine struct {
	cfg Config
	log *slog.Logger

	nextGrant atomic.Uint64
	nextEpoch atomic.Uint64

	mu      sync.RWMutex
	closed  bool
	regions map[RegionID]*Region
	grants  map[uint64]*Grant
	settled map[uint64]*Grant
	busy    map[RegionID][]busySpan // destinations held by open grants, sorted
	ring    []uint64                // settled grant ids, a circle of up to tombstones from ringAt
	ringAt  int                     // where the next settled id goes once the ring is full
	// Open grants by deadline, and one timer for all of them: it is set for
	// the earliest deadline (or earlier) and moved only when a grant comes
	// due before it, not per grant.
	expiry   grantHeap
	expTimer *time.Timer // nil until the first grant
	expAt    time.Time   // when expTimer fires, while expArmed
	expArmed bool
	ops      sync.WaitGroup
	tcp      *tcpServer
	shm      *shmServer
	ucx      *ucxServer
	served   []Transport
	// fences are the served transports' receiving sides, which every
	// grant is opened on and fenced through (fence.go); set by New.
	fences []fence

	quarantines sync.WaitGroup      // watchQuarantine goroutines
	watched     map[*Grant]struct{} // the grants they watch (under mu)

	devs devState // device regions: visible devices, staging buffers (device.go)

	peerMu sync.Mutex
	peers  map[AgentID]*peerState

	writersMu    sync.Mutex
	writers      map[AgentID]int // live connections by writer, once past hello
	onWriterGone map[uint64]func(AgentID)
	nextWatch    uint64

	ctx    context.Context // cancelled by Close: aborts dials in progress
	cancel context.CancelFunc

	stats counters

	hooks atomic.Pointer[hooks] // test seams (hooks.go); nil outside tests
}

// New starts an engine: it binds the listeners of the served transports.
func New(cfg Config) (*Engine, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	e := &Engine{
		cfg:     cfg,
		log:     cfg.Logger.With("agent", string(cfg.Agent)),
		regions: make(map[RegionID]*Region),
		grants:  make(map[uint64]*Grant),
		watched: make(map[*Grant]struct{}),
		settled: make(map[uint64]*Grant),
		busy:    make(map[RegionID][]busySpan),
		peers:   make(map[AgentID]*peerState),
	}
	e.ctx, e.cancel = context.WithCancel(context.Background())
	// Epochs are unique per engine, never reused across grants: a shm grant
	// slot's state word names (state, epoch) unambiguously.
	e.nextEpoch.Store(uint64(time.Now().UnixNano()) &^ (1 << 63) >> 16)
	for _, t := range cfg.Transports {
		var err error
		switch t {
		case TransportTCP, TransportCUDAIPC:
			// cuda-ipc's frames travel on the tcp listener's connections.
			if e.tcp == nil {
				e.tcp, err = startTCP(e, cfg.TCPAddr, cfg.Advertise)
			}
		case TransportSHM:
			e.shm, err = startSHM(e, cfg.ShmSocket)
		case TransportUCX:
			e.ucx, err = startUCX(e)
		}
		if err != nil {
			e.Close()
			return nil, err
		}
		e.served = append(e.served, t)
	}
	// The receivers that store every byte themselves come first: a fence
	// cuts their stalled landings at once, before it waits for a writer
	// that stores on its own.
	if e.tcp != nil {
		e.fences = append(e.fences, e.tcp) // tcp and cuda-ipc
	}
	if e.serves(TransportInproc) {
		e.fences = append(e.fences, inprocRx{})
	}
	if e.ucx != nil {
		e.fences = append(e.fences, e.ucx)
	}
	if e.shm != nil {
		e.fences = append(e.fences, e.shm)
	}
	inprocRegister(e)
	e.log.Info("rdma: engine started", "transports", e.served, "tcp", e.Descriptor().TCPAddr, "shm", e.Descriptor().ShmAddr, "host", cfg.Host)
	return e, nil
}

// Agent returns the engine's agent id.
func (e *Engine) Agent() AgentID { return e.cfg.Agent }

func (e *Engine) newEpoch() uint64 { return e.nextEpoch.Add(1) }

// beginOp registers an operation that uses region memory; Close waits for it.
func (e *Engine) beginOp() error {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return ErrClosed
	}
	e.ops.Add(1)
	return nil
}

// Register allocates and registers a region of size bytes. On linux the
// memory is a memfd mapped shared, so same-host peers can map it (shm).
// Register it once at start-up: the region list is part of the Descriptor.
func (e *Engine) Register(name string, size int64) (*Region, error) {
	if size <= 0 {
		return nil, fmt.Errorf("%w: region %q of %d bytes", ErrOutOfRange, name, size)
	}
	mem, fd, err := allocShared(name, size)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		freeShared(mem, fd)
		return nil, ErrClosed
	}
	r := &Region{id: RegionID(len(e.regions) + 1), name: name, mem: mem, size: uint64(size), fd: fd}
	e.regions[r.id] = r
	e.log.Info("rdma: region registered", "region", r.id, "name", name, "bytes", size, "shareable", fd >= 0)
	return r, nil
}

// Region returns a registered region by id.
func (e *Engine) Region(id RegionID) (*Region, bool) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	r, ok := e.regions[id]
	return r, ok
}

// TCPListenAddr returns the address the tcp listener is bound to: with
// Config.TCPAddr ":0", the port the kernel chose. It is empty when tcp is not
// served. Peers dial Descriptor().TCPAddr instead, the advertised address,
// which differs behind a proxy or NAT (Config.Advertise).
func (e *Engine) TCPListenAddr() string {
	if e.tcp == nil {
		return ""
	}
	return e.tcp.ln.Addr().String()
}

// Descriptor returns what a peer needs to reach this engine.
func (e *Engine) Descriptor() Descriptor {
	e.mu.RLock()
	defer e.mu.RUnlock()
	d := Descriptor{Agent: e.cfg.Agent, Host: e.cfg.Host, Incarnation: e.cfg.incarnation, Transports: slices.Clone(e.served)}
	if e.tcp != nil {
		d.TCPAddr = e.tcp.advertise
	}
	if e.shm != nil {
		d.ShmAddr = e.shm.path
	}
	if e.ucx != nil {
		d.UCXAddr = slices.Clone(e.ucx.addr)
	}
	for _, r := range e.regions {
		rd := RegionDesc{ID: r.id, Name: r.name, Length: r.size}
		if r.dev != nil {
			rd.Memory, rd.Device = MemoryCUDA, r.dev.Device().UUID().String()
		}
		d.Regions = append(d.Regions, rd)
	}
	e.devs.describe(&d)
	sort.Slice(d.Regions, func(i, j int) bool { return d.Regions[i].ID < d.Regions[j].ID })
	return d
}

// Quiesce revokes every open grant and waits until nothing can land in
// the engine's regions any more: every quarantined grant's writer left its
// copy or exited. Close ends quarantines at once, since it unmaps the
// regions; an owner whose memory outlives the engine (an engine worker
// that registered its own tensors with an agent, and may use them again
// once the agent let them go) quiesces first. ctx bounds the wait: the
// error then wraps ErrQuarantined and ctx's error, and the quarantines go
// on until they end or Close. Grants opened meanwhile are the caller's.
func (e *Engine) Quiesce(ctx context.Context) error {
	e.mu.Lock()
	open := make([]*Grant, 0, len(e.grants))
	for _, g := range e.grants {
		open = append(open, g)
	}
	e.mu.Unlock()
	for _, g := range open {
		g.terminate(fmt.Errorf("%w: grant %d (request %d): the engine quiesces", ErrRevoked, g.id, g.ticket.RequestID))
	}
	e.mu.Lock()
	watched := make([]*Grant, 0, len(e.watched))
	for g := range e.watched {
		watched = append(watched, g)
	}
	e.mu.Unlock()
	for i, g := range watched {
		select {
		case <-g.done:
		case <-ctx.Done():
			return fmt.Errorf("%w: %d grants still quarantined: %w", ErrQuarantined, len(watched)-i, ctx.Err())
		}
	}
	return nil
}

// Close revokes open grants, stops listeners and every goroutine the engine
// owns, closes peer connections, waits for in-flight operations, and unmaps
// the regions. It is idempotent.
func (e *Engine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	e.cancel()
	if e.expTimer != nil {
		e.expTimer.Stop()
	}
	open := make([]*Grant, 0, len(e.grants))
	for _, g := range e.grants {
		open = append(open, g)
	}
	e.mu.Unlock()
	inprocUnregister(e)

	for _, g := range open {
		g.terminate(fmt.Errorf("%w: grant %d: %w", ErrRevoked, g.id, ErrClosed))
	}
	e.quarantines.Wait()
	if e.tcp != nil {
		e.tcp.close()
	}
	if e.shm != nil {
		e.shm.close()
	}
	e.peerMu.Lock()
	for a, p := range e.peers {
		p.link.close()
		delete(e.peers, a)
	}
	e.peerMu.Unlock()
	if e.ucx != nil {
		// After the links: they use its worker to say goodbye.
		e.ucx.close()
	}
	e.ops.Wait()
	e.devs.close()

	e.mu.Lock()
	defer e.mu.Unlock()
	for _, r := range e.regions {
		if r.dev == nil {
			freeShared(r.mem, r.fd)
		}
		r.mem = nil
	}
	if e.shm != nil {
		e.shm.unmap()
	}
	e.log.Info("rdma: engine closed")
	return nil
}
