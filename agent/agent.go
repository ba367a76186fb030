package agent

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/transfer/wire"
)

// Config configures an Agent.
type Config struct {
	// Name names the agent to peers and in tickets; required, unique per
	// engine worker (one per GPU).
	Name string
	// Socket is the local API's unix socket path. Its directory must be
	// private (created 0700 when missing); the socket is mode 0600.
	Socket string
	// Transports, TCPAddr, Advertise and FenceWait configure the data path
	// of each registration (rdma.Config); default tcp and shm.
	Transports []rdma.Transport
	TCPAddr    string
	Advertise  string
	FenceWait  time.Duration
	// GrantTTL is the deadline of grants opened without one; default 60s.
	GrantTTL time.Duration
	// Namespace is the deployment's namespace, whose instance registry the
	// agent joins with NATS (registry.go); default "default", as the
	// workers'.
	Namespace string
	// Registry configures that registry (its Namespace is Namespace's).
	Registry transfer.RegistryConfig
	// CUDA opens the CUDA driver, the first time an engine registers a
	// pool in device memory (cuda.go); nil: cuda.Open (libcuda.so.1, or
	// $HANDOFF_LIBCUDA). Tests pass a fake.
	CUDA func() (cuda.Driver, error)
	// Registerer takes the agent's metrics (metrics.go); nil: they are
	// kept but not exported.
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

func (c *Config) validate() error {
	if c.Name == "" {
		return fmt.Errorf("%w: Config.Name is required", ErrBadRequest)
	}
	if c.Namespace == "" {
		c.Namespace = "default"
	}
	// Both name NATS subjects and the registry's keys.
	if !wire.ValidToken(c.Name) || !wire.ValidToken(c.Namespace) {
		return fmt.Errorf("%w: agent name %q and namespace %q must be 1-64 letters, digits, '-' or '_'", ErrBadRequest, c.Name, c.Namespace)
	}
	if c.Socket == "" {
		return fmt.Errorf("%w: Config.Socket is required", ErrBadRequest)
	}
	if len(c.Transports) == 0 {
		c.Transports = []rdma.Transport{rdma.TransportSHM, rdma.TransportTCP}
	}
	for _, t := range c.Transports {
		// Checked here, not first at an engine's registration: an agent
		// that cannot serve its transports must not start and say ready.
		if err := t.Supported(); err != nil {
			return err
		}
	}
	if c.GrantTTL <= 0 {
		c.GrantTTL = 60 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// Agent serves the local API of one engine worker: each connection is one
// engine process (a registration), with its own rdma.Engine over the memory
// it registered. When the connection ends (the engine exited or
// restarted), that engine's grants are revoked, its sends stopped and its
// memory unmapped; the agent goes on serving the next connection.
type Agent struct {
	cfg Config
	log *slog.Logger
	ln  *socket
	nc  *nats.Conn // nil without NATS
	m   *metrics

	gen     atomic.Uint64 // registrations so far: a registration's rdma agent id is Name#gen
	serving atomic.Bool   // Serve accepts engines (Ready)

	mu       sync.Mutex
	closed   bool
	sessions map[*session]struct{}
	latest   *session            // the last registration, which NATS describes
	files    map[string]*session // host memory's files (fileKey) by the registration holding them (claimFiles)
	freed    chan struct{}       // closed and replaced when claims are let go
	regs     uint64              // registrations so far (session.regSeq)
	wg       sync.WaitGroup

	cuda agentCUDA // the driver and devices engines' device memory is on

	// ctx is cancelled by Close: it ends the waits of sessions for writers
	// still copying into their memory (session.end).
	ctx  context.Context
	stop context.CancelFunc

	reg  *transfer.Registry // with NATS, from Serve's start to its end
	kick chan struct{}      // refreshRegistry's request to the refresher; nil without
}

// New creates the socket and, when nc is not nil, answers descriptions of
// the agent on NATS (Subject). Serve accepts connections.
func New(cfg Config, nc *nats.Conn) (*Agent, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	ln, err := listen(cfg.Socket)
	if err != nil {
		return nil, err
	}
	a := &Agent{cfg: cfg, log: cfg.Logger.With("agent", cfg.Name), ln: ln, nc: nc, m: m, sessions: make(map[*session]struct{}),
		files: make(map[string]*session), freed: make(chan struct{})}
	a.ctx, a.stop = context.WithCancel(context.Background())
	return a, nil
}

// Serve accepts engine connections until ctx ends or Close; it closes the
// agent before it returns.
func (a *Agent) Serve(ctx context.Context) error {
	defer a.Close()
	if a.nc != nil {
		unsub, err := a.subscribe()
		if err != nil {
			return err
		}
		defer unsub()
		leave, err := a.joinRegistry(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil // stopped while starting
			}
			return err
		}
		// Leave once every session ended: none refreshes the entry after.
		defer func() {
			a.Close()
			leave()
		}()
	}
	stop := context.AfterFunc(ctx, func() { a.ln.Close() })
	defer stop()
	a.log.Info("agent: listening", "socket", a.cfg.Socket)
	a.serving.Store(true)
	defer a.serving.Store(false)
	for {
		c, err := a.ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil || a.isClosed() {
				return nil
			}
			if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) || errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM) {
				// Out of descriptors or memory for now: the engines already
				// connected keep being served; try again shortly.
				a.log.Warn("agent: accept", "err", err)
				time.Sleep(50 * time.Millisecond)
				continue
			}
			return fmt.Errorf("agent: accept: %w", err)
		}
		cred, err := peerCred(c)
		if err != nil || int(cred.Uid) != os.Getuid() {
			a.log.Warn("agent: connection refused", "err", errors.Join(err, ErrPeerCred))
			c.Close()
			continue
		}
		s := a.newSession(c, int(cred.Pid))
		if s == nil {
			c.Close()
			return nil
		}
		go func() {
			defer a.wg.Done()
			s.run()
		}()
	}
}

// Ready returns nil while Serve accepts engines (with NATS, once the agent
// joined the registry) and its NATS connection, if any, is up: the
// readiness of an agent's process.
func (a *Agent) Ready() error {
	switch {
	case !a.serving.Load():
		return errors.New("agent: not serving")
	case a.nc != nil && !a.nc.IsConnected():
		return fmt.Errorf("agent: NATS is %s", a.nc.Status())
	}
	return nil
}

func (a *Agent) isClosed() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.closed
}

func (a *Agent) newSession(c *net.UnixConn, pid int) *session {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil
	}
	s := &session{a: a, c: c, fc: newFDConn(c), pid: pid, grants: map[uint64]*grantGroup{}, sends: map[uint64]*send{}, running: map[*send]struct{}{}}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.log = a.log.With("engine_pid", pid)
	a.sessions[s] = struct{}{}
	a.wg.Add(1)
	a.m.engines.Inc()
	return s
}

func (a *Agent) endSession(s *session) {
	a.m.engines.Dec()
	a.mu.Lock()
	delete(a.sessions, s)
	a.mu.Unlock()
}

// leaving takes an ending session off what NATS describes: the latest
// other registration still connected is described instead, or none (peers
// see no fingerprint).
func (a *Agent) leaving(s *session) {
	a.mu.Lock()
	was := a.latest == s
	if was {
		a.latest = nil
		for o := range a.sessions {
			if o != s && o.regSeq > 0 && o.ctx.Err() == nil && (a.latest == nil || o.regSeq > a.latest.regSeq) {
				a.latest = o
			}
		}
	}
	a.mu.Unlock()
	if was {
		a.refreshRegistry()
	}
}

func (a *Agent) registered(s *session) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.regs++
	s.regSeq = a.regs
	a.latest = s
}

// Close stops accepting, ends every connection (revoking its grants,
// unmapping its memory) and waits for them. It is idempotent.
func (a *Agent) Close() error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		a.wg.Wait()
		return nil
	}
	a.closed = true
	a.stop()
	ss := make([]*session, 0, len(a.sessions))
	for s := range a.sessions {
		ss = append(ss, s)
	}
	a.mu.Unlock()
	a.ln.Close()
	for _, s := range ss {
		// Its reader ends; its end may still tell the engine that its
		// memory is not safe yet (EvQuarantined), then closes it.
		_ = s.c.CloseRead()
	}
	a.wg.Wait()
	if err := a.cuda.close(); err != nil {
		a.log.Warn("agent: closing CUDA devices", "err", err)
	}
	a.ln.remove()
	return nil
}

// session is one engine connection. Its reader goroutine (run) decodes
// requests and answers them in order; sends run on goroutines of their own,
// which the session owns and waits for when it ends. Replies and events
// share the connection under wmu.
type session struct {
	a   *Agent
	c   *net.UnixConn
	fc  *fdConn
	pid int
	log *slog.Logger

	ctx    context.Context // cancelled when the session ends: stops sends
	cancel context.CancelFunc
	wg     sync.WaitGroup // grant watchers and sends
	regSeq uint64         // its registration's place among the agent's (under Agent.mu); 0: none

	wmu sync.Mutex
	w   *bufio.Writer

	// replied is closed once the reply to the request being handled is
	// written (afterReply); run's goroutine alone touches the field.
	replied chan struct{}

	mu       sync.Mutex
	eng      *rdma.Engine // nil until register
	pools    *pools
	bufs     []*rdma.Region // by buffer: the KV pool's and the Mamba pool's, or Request.Buffers
	arenas   []*cuda.Arena  // device memory the engine shared (OpenIPC), closed after eng
	grants   map[uint64]*grantGroup
	sends    map[uint64]*send   // by id, until committed or cancelled
	running  map[*send]struct{} // until their goroutines end
	nextSend uint64
}

func (s *session) run() {
	s.w = bufio.NewWriter(s.c)
	defer s.end()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.sweepSends()
	}()
	r := bufio.NewReaderSize(s.fc, 64<<10)
	for {
		b, err := readFrame(r)
		if err != nil {
			if !errors.Is(err, net.ErrClosed) && !errors.Is(err, io.EOF) {
				s.log.Info("agent: engine connection ended", "err", err)
			}
			return
		}
		q, err := decodeRequest(b)
		if err != nil {
			s.a.m.request(q.Op, err)
			s.fc.closeFDs() // any it passed were its own
			// A frame that names its id is answered, and the session goes
			// on (the frame was read whole); without one, no call of the
			// engine's can take the answer, and the session ends.
			id := requestID(b)
			if s.reply(Reply{Re: id, Code: Code(err), Msg: err.Error()}) != nil || id == 0 {
				return
			}
			continue
		}
		rep, err := s.handle(q)
		if errors.Is(err, errDeferred) {
			s.replyWritten()
			continue // its goroutine answers, and counts it
		}
		s.a.m.request(q.Op, err)
		if err != nil {
			rep = Reply{Code: Code(err), Msg: err.Error()}
		}
		rep.Re = q.ID
		err = s.reply(rep)
		s.replyWritten()
		if err != nil {
			return
		}
	}
}

// afterReply is closed once the reply to the request being handled has
// been written (or could not be): a goroutine the request starts waits for
// it before it writes an event, so that an engine never reads of a grant
// or send before the reply that named it.
func (s *session) afterReply() <-chan struct{} {
	if s.replied == nil {
		s.replied = make(chan struct{})
	}
	return s.replied
}

func (s *session) replyWritten() {
	if s.replied != nil {
		close(s.replied)
		s.replied = nil
	}
}

// reply writes one reply or event.
func (s *session) reply(r Reply) error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	err := writeFrame(s.w, r)
	if errors.Is(err, ErrFrameTooLarge) && r.Re != 0 {
		// Nothing was written: the request gets the error instead, and the
		// connection goes on.
		err = writeFrame(s.w, Reply{Re: r.Re, Code: Code(err), Msg: err.Error()})
	}
	if err != nil {
		return err
	}
	return s.w.Flush()
}

// end ends the session once its connection did: it stops the sends,
// revokes the grants and waits until nothing can land in the engine's
// memory any more (a shm writer frozen inside a copy into a revoked grant
// still stores into it when it wakes: rdma.Engine.Quiesce), then unmaps it.
// The connection closes last, so that an engine that closed its side
// (Client.Close) learns by its end that its memory is its own again.
func (s *session) end() {
	s.cancel()
	s.a.leaving(s)
	s.mu.Lock()
	eng := s.eng
	s.mu.Unlock()
	if eng != nil {
		start := time.Now()
		if err := eng.Quiesce(s.a.ctx); err != nil {
			// The agent is stopping: the engine that is still there
			// learns that its memory is not safe to use yet.
			s.log.Warn("agent: closing while writers may still copy into the engine's memory", "err", err)
			_ = s.c.SetWriteDeadline(time.Now().Add(time.Second))
			_ = s.reply(Reply{Ev: EvQuarantined, Code: Code(err), Msg: err.Error()})
		} else if d := time.Since(start); d > time.Second {
			s.log.Info("agent: the engine's revoked grants were quarantined: its memory is let go now", "after", d)
		}
		eng.Close()
	}
	// Events of the sends and grants that ended are not read any more (the
	// engine left or is closing): their goroutines must not wait for it.
	_ = s.c.SetWriteDeadline(time.Now())
	s.wg.Wait()
	s.closeArenas()
	s.fc.closeFDs()
	s.a.endSession(s)
	s.a.releaseFiles(s)
	s.c.Close()
	s.log.Info("agent: engine session ended")
}

func (s *session) handle(q Request) (Reply, error) {
	switch q.Op {
	case OpHello:
		if q.Version < 1 || q.Version > Version {
			return Reply{}, fmt.Errorf("%w: local API version %d, this agent speaks 1 to %d", ErrBadRequest, q.Version, Version)
		}
		return Reply{Agent: s.a.cfg.Name, Version: Version}, nil
	case OpRegister:
		rep, err := s.register(q)
		if err == nil {
			s.a.registered(s) // after register let go of s.mu: Agent.mu comes first
			s.a.refreshRegistry()
		}
		return rep, err
	case OpPeers:
		return s.a.peers(), nil
	case OpGrant:
		return s.grant(q)
	case OpRevoke:
		return s.revoke(q)
	case OpSend, OpOpenSend:
		return s.openSend(q)
	case OpSendLayer, OpCommit, OpCancel:
		return s.sendOp(q)
	case OpOffer:
		return s.offer(q)
	}
	return Reply{}, fmt.Errorf("%w: unknown op %q", ErrBadRequest, q.Op)
}
