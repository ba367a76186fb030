package rdma

import (
	"container/heap"
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Transport names a backend. Values are lower-case, used in logs and metric labels.
type Transport string

// The transports, in order of preference.
const (
	TransportInproc  Transport = "inproc"   // both engines in one process: memcpy
	TransportCUDAIPC Transport = "cuda-ipc" // same host, device regions: the receiver copies device to device through CUDA IPC
	TransportSHM     Transport = "shm"      // same host: the writer copies into the receiver's mapped memfd
	TransportTCP     Transport = "tcp"      // anywhere: framed writes over pooled TCP connections
)

// AgentID names an engine; unique per process.
type AgentID string

// RegionID names a registered region inside one engine.
type RegionID uint32

// Extent is a byte range of a registered region (local or remote).
type Extent struct {
	Region RegionID `json:"region"`
	Offset uint64   `json:"offset"`
	Length uint64   `json:"length"`
}

// RegionDesc describes a region to peers.
type RegionDesc struct {
	ID     RegionID `json:"id"`
	Name   string   `json:"name"`
	Length uint64   `json:"length"`
	// Memory is where the region lives: "" or host, or cuda (a device
	// allocation, on the device Device names by UUID).
	Memory Memory `json:"memory,omitempty"`
	Device string `json:"device,omitempty"`
}

// Descriptor is everything a peer needs to reach this agent's regions. It is
// plain data (JSON-serialisable); the control plane carries it.
type Descriptor struct {
	Agent      AgentID      `json:"agent"`
	Host       string       `json:"host"`     // host identity (boot id); equal hosts may use shm
	TCPAddr    string       `json:"tcp_addr"` // advertised TCP address, empty when tcp is not served
	ShmAddr    string       `json:"shm_addr"` // unix control socket for shm, empty when shm is not served
	Transports []Transport  `json:"transports"`
	Regions    []RegionDesc `json:"regions"`
	// IPCNamespace and CUDADevices say whose CUDA IPC handles this agent
	// can open (cuda-ipc): processes in the same IPC namespace
	// ("ipc:[4026531839]") whose device is among the UUIDs it sees. Empty
	// for an agent without device regions.
	IPCNamespace string   `json:"ipc_ns,omitempty"`
	CUDADevices  []string `json:"cuda_devices,omitempty"`
}

// Config configures an Engine. Only Agent is required.
type Config struct {
	Agent      AgentID       // unique per process; required
	Transports []Transport   // served transports; default all three (shm only on linux)
	TCPAddr    string        // listen address, default "127.0.0.1:0"
	Advertise  string        // advertised TCP address (POD_IP:port; port 0: the listener's); default the listener's
	ShmSocket  string        // unix socket path for shm control; default a fresh path in os.TempDir()
	Host       string        // host identity; default boot id (else hostname) plus mount namespace
	GrantTTL   time.Duration // deadline of grants opened without one; default 60s
	// FenceWait bounds how long a fence (Revoke, a deadline, a commit) waits
	// for a live shm writer to end a copy in progress; past it the grant
	// fails and its destination is quarantined (Grant.Quarantined). Default
	// 100ms; a copy bracket takes well under a millisecond.
	FenceWait time.Duration
	MaxGrants int // open grants at once; default 16384
	// SkipCRC trades integrity for speed: as a writer, commits carry byte
	// counts without crc32c; as a receiver, such commits are accepted
	// (fencing and byte counts still apply). Off by default; a receiver
	// without it refuses crc-less commits with ErrManifestMismatch.
	SkipCRC bool
	// VerifySHM makes a shm receiver compute the crc32c of every committed
	// extent again, over its own memory after the fence, instead of taking
	// the sums the writer computed over the same destination bytes right
	// after copying them. A shm writer maps whole regions (same user only),
	// so this guards against a faulty writer, not a hostile one; it costs a
	// read of every byte, more than the copy itself. Off by default.
	VerifySHM bool
	// TCPLanes is how many pooled connections a tcp writer stripes one
	// large write over (equal byte ranges, at least 1 MiB each): one
	// TCP stream leaves a core idle waiting on the other side, several
	// keep both sides busy. Default 4; 1 sends every write on one
	// connection.
	TCPLanes int
	// TLS, when set, runs the tcp transport over mutual TLS (1.3): the
	// receiver asks every writer for a certificate that verifies against
	// ClientCAs, and a writer verifies the receiver's against RootCAs and
	// presents its own from Certificates, so one config built from a CA, a
	// certificate and a key serves both roles. Host names are not checked
	// (workers are reached at addresses that change with every pod): any
	// certificate the CA signed is a worker, so give that CA to workers
	// only. shm and inproc never leave the host and are unaffected. Off by
	// default.
	TLS    *tls.Config
	Logger *slog.Logger // default slog.Default()
}

func (c *Config) validate() error {
	if c.Agent == "" {
		return errors.New("rdma: Config.Agent is required")
	}
	if strings.ContainsAny(string(c.Agent), "\n\x00") || len(c.Agent) > 200 {
		return fmt.Errorf("rdma: agent id %q: at most 200 bytes, no newline or NUL", c.Agent)
	}
	if len(c.Transports) == 0 {
		c.Transports = []Transport{TransportInproc, TransportCUDAIPC, TransportSHM, TransportTCP}
		if !shmSupported {
			c.Transports = []Transport{TransportInproc, TransportCUDAIPC, TransportTCP}
		}
	}
	for _, t := range c.Transports {
		switch t {
		case TransportInproc, TransportTCP, TransportCUDAIPC:
		case TransportSHM:
			if !shmSupported {
				return fmt.Errorf("%w: transport shm needs linux", ErrUnsupported)
			}
		default:
			return fmt.Errorf("%w: transport %q", ErrUnsupported, t)
		}
	}
	if c.TCPLanes < 0 {
		return fmt.Errorf("rdma: Config.TCPLanes %d is negative", c.TCPLanes)
	}
	if c.TCPLanes == 0 {
		c.TCPLanes = defaultTCPLanes
	}
	if c.TCPAddr == "" {
		c.TCPAddr = "127.0.0.1:0"
	}
	if c.Host == "" {
		c.Host = hostIdentity()
	}
	if c.GrantTTL < 0 {
		return fmt.Errorf("rdma: Config.GrantTTL %s is negative", c.GrantTTL)
	}
	if c.FenceWait < 0 {
		return fmt.Errorf("rdma: Config.FenceWait %s is negative", c.FenceWait)
	}
	if c.FenceWait == 0 {
		c.FenceWait = 100 * time.Millisecond
	}
	if c.GrantTTL == 0 {
		c.GrantTTL = 60 * time.Second
	}
	if c.MaxGrants < 0 {
		return fmt.Errorf("rdma: Config.MaxGrants %d is negative", c.MaxGrants)
	}
	if c.MaxGrants == 0 {
		c.MaxGrants = 16384
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// hostIdentity names what shm needs two engines to share: the kernel (boot
// id) and the filesystem view (mount namespace), since the shm control socket
// is a path and the regions are passed as memfds over it. Containers on one
// host share the boot id but not their mount namespace, so they get tcp.
func hostIdentity() string {
	id, _ := os.Hostname()
	if b, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		if s := strings.TrimSpace(string(b)); s != "" {
			id = s
		}
	}
	if ns, err := os.Readlink("/proc/self/ns/mnt"); err == nil {
		id += "/" + ns
	}
	return id
}

// tombstones is how many settled grants are remembered so that late frames
// get the precise reason (revoked, committed, expired) instead of
// ErrUnknownGrant.
const tombstones = 4096

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
	served   []Transport

	quarantines sync.WaitGroup // watchQuarantine goroutines

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
}

// peerState is the writer side's connection to one peer.
type peerState struct {
	desc Descriptor
	link link
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
		}
		if err != nil {
			e.Close()
			return nil, err
		}
		e.served = append(e.served, t)
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
	d := Descriptor{Agent: e.cfg.Agent, Host: e.cfg.Host, Transports: slices.Clone(e.served)}
	if e.tcp != nil {
		d.TCPAddr = e.tcp.advertise
	}
	if e.shm != nil {
		d.ShmAddr = e.shm.path
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

// OpenGrant opens a grant over spec.Extents. The extents must lie in this
// engine's regions, be disjoint, and avoid forbidden ranges. The caller must
// not reuse the destination until the grant is Done (committed, or revoked:
// Revoke returns only when nothing can land).
func (e *Engine) OpenGrant(spec GrantSpec) (*Grant, error) {
	if spec.RequestID == 0 {
		return nil, ErrBadRequestID
	}
	if len(spec.Extents) == 0 || len(spec.Extents) > maxExtents {
		return nil, fmt.Errorf("%w: grant needs 1..%d extents, got %d", ErrOutOfRange, maxExtents, len(spec.Extents))
	}
	now := time.Now()
	deadline := spec.Deadline
	if deadline.IsZero() {
		deadline = now.Add(e.cfg.GrantTTL)
	}
	if !now.Before(deadline) {
		return nil, fmt.Errorf("%w: grant deadline %s already passed", ErrDeadline, deadline.Format(time.RFC3339Nano))
	}
	g := &Grant{
		e:      e,
		done:   make(chan struct{}),
		failed: make(chan struct{}),
		ended:  make(chan struct{}),
		slot:   -1,
		due:    -1,
	}
	if n := len(spec.Extents); n <= len(g.dstRoom) {
		g.dst, g.ext = g.dstRoom[:n], g.extRoom[:n]
	} else {
		g.dst, g.ext = make([][]byte, n), make([]extState, n)
	}
	g.quiet.L = &g.mu
	var total uint64
	e.mu.RLock()
	if e.closed {
		e.mu.RUnlock()
		return nil, ErrClosed
	}
	for i, x := range spec.Extents {
		r, ok := e.regions[x.Region]
		if !ok {
			e.mu.RUnlock()
			return nil, fmt.Errorf("%w: extent %d names unknown region %d", ErrOutOfRange, i, x.Region)
		}
		if err := r.checkExtent(x, true); err != nil {
			e.mu.RUnlock()
			return nil, fmt.Errorf("extent %d: %w", i, err)
		}
		g.dst[i] = r.slice(x)
		if r.dev != nil {
			if g.dev == nil {
				g.dev = make([]devSpan, len(spec.Extents))
			}
			g.dev[i] = devSpan{a: r.dev, off: x.Offset}
		}
		g.ext[i].seq = true
		total += x.Length
	}
	e.mu.RUnlock()
	sorted, err := checkDisjoint(spec.Extents)
	if err != nil {
		return nil, err
	}
	g.ticket = Ticket{
		Agent:     e.cfg.Agent,
		RequestID: spec.RequestID,
		Extents:   slices.Clone(spec.Extents),
		Bytes:     total,
		Deadline:  deadline,
	}
	_, _ = rand.Read(g.ticket.Token[:])

	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil, ErrClosed
	}
	if len(e.grants) >= e.cfg.MaxGrants {
		e.mu.Unlock()
		return nil, fmt.Errorf("%w: %d open", ErrTooManyGrants, len(e.grants))
	}
	if err := e.checkBusyLocked(sorted); err != nil {
		e.mu.Unlock()
		return nil, err
	}
	g.id = e.nextGrant.Add(1)
	if e.shm != nil {
		// The grant id selects the shm slot (id mod slots): skip ids whose slot is busy.
		for !e.shm.slotFree(g.id) {
			g.id = e.nextGrant.Add(1)
		}
		g.slot = e.shm.slotOf(g.id)
	}
	g.epoch = e.newEpoch()
	g.ticket.Grant, g.ticket.Epoch = g.id, g.epoch
	// The grant is due before anyone can settle it (retire removes it).
	heap.Push(&e.expiry, g)
	e.armExpiryLocked(deadline)
	e.grants[g.id] = g
	e.markBusyLocked(sorted, g.id)
	if e.shm != nil {
		e.shm.publish(g)
	}
	e.mu.Unlock()

	e.stats.grantsOpened.Add(1)
	if e.log.Enabled(context.Background(), slog.LevelDebug) { // the arguments would allocate
		e.log.Debug("rdma: grant opened", "grant", g.id, "request", spec.RequestID, "extents", len(spec.Extents), "bytes", total, "deadline", deadline)
	}
	return g, nil
}

// checkDisjoint refuses extents of one grant that overlap each other, and
// returns them sorted by region and offset (xs itself when it is one extent;
// the caller only reads the result).
func checkDisjoint(xs []Extent) ([]Extent, error) {
	if len(xs) == 1 {
		return xs, nil
	}
	s := slices.Clone(xs)
	slices.SortFunc(s, func(a, b Extent) int {
		if a.Region != b.Region {
			return int(a.Region) - int(b.Region)
		}
		switch {
		case a.Offset < b.Offset:
			return -1
		case a.Offset > b.Offset:
			return 1
		}
		return 0
	})
	for i := 1; i < len(s); i++ {
		p, c := s[i-1], s[i]
		if p.Region == c.Region && c.Offset < p.Offset+p.Length {
			return nil, fmt.Errorf("%w: extents [%d, +%d) and [%d, +%d) of region %d overlap", ErrOutOfRange, p.Offset, p.Length, c.Offset, c.Length, c.Region)
		}
	}
	return s, nil
}

// busySpan is a destination range held by an open grant.
type busySpan struct{ off, end, grant uint64 }

// checkBusyLocked refuses extents (sorted) that overlap an open grant's: a
// destination is reusable only once its grant is Done. e.mu is held.
func (e *Engine) checkBusyLocked(sorted []Extent) error {
	for i := 0; i < len(sorted); {
		r := sorted[i].Region
		busy := e.busy[r]
		j := 0
		for ; i < len(sorted) && sorted[i].Region == r; i++ {
			x := sorted[i]
			for j < len(busy) && busy[j].end <= x.Offset {
				j++
			}
			if j < len(busy) && busy[j].off < x.Offset+x.Length {
				b := busy[j]
				return fmt.Errorf("%w: [%d, +%d) of region %d overlaps [%d, %d) of open grant %d", ErrBusy, x.Offset, x.Length, r, b.off, b.end, b.grant)
			}
		}
	}
	return nil
}

// markBusyLocked merges a new grant's (sorted, checked) extents into the
// busy lists, in place from the back (a list keeps its capacity as grants
// come and go). e.mu is held.
func (e *Engine) markBusyLocked(sorted []Extent, grant uint64) {
	for start := 0; start < len(sorted); {
		r := sorted[start].Region
		end := start + 1
		for end < len(sorted) && sorted[end].Region == r {
			end++
		}
		spans := e.busy[r]
		n, k := len(spans), end-start
		spans = slices.Grow(spans, k)[:n+k]
		i, j := n-1, end-1
		for w := n + k - 1; j >= start; w-- {
			if x := sorted[j]; i >= 0 && spans[i].off >= x.Offset {
				spans[w] = spans[i]
				i--
			} else {
				spans[w] = busySpan{x.Offset, x.Offset + x.Length, grant}
				j--
			}
		}
		e.busy[r] = spans
		start = end
	}
}

// clearBusyLocked drops a settled grant's spans. e.mu is held.
func (e *Engine) clearBusyLocked(g *Grant) {
	for i, x := range g.ticket.Extents {
		if i > 0 && g.ticket.Extents[i-1].Region == x.Region {
			continue // consecutive extents of one region: filtered already
		}
		spans := e.busy[x.Region]
		kept := spans[:0]
		for _, s := range spans {
			if s.grant != g.id {
				kept = append(kept, s)
			}
		}
		clear(spans[len(kept):])
		e.busy[x.Region] = kept
	}
}

// lookupGrant finds an open or recently settled grant.
func (e *Engine) lookupGrant(id uint64) (*Grant, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if g := e.grants[id]; g != nil {
		return g, nil
	}
	if g := e.settled[id]; g != nil {
		return g, nil
	}
	if e.closed {
		return nil, ErrClosed
	}
	return nil, fmt.Errorf("%w: grant %d", ErrUnknownGrant, id)
}

// retire moves a settled grant to the tombstones and frees its shm slot.
func (e *Engine) retire(g *Grant) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.grants[g.id] != g {
		return
	}
	delete(e.grants, g.id)
	if g.due >= 0 {
		heap.Remove(&e.expiry, g.due)
	}
	e.clearBusyLocked(g)
	if e.shm != nil && g.slot >= 0 {
		e.shm.release(g)
	}
	e.settled[g.id] = g
	if len(e.ring) < tombstones {
		e.ring = append(e.ring, g.id)
	} else { // forget the oldest, in its place
		delete(e.settled, e.ring[e.ringAt])
		e.ring[e.ringAt] = g.id
		e.ringAt = (e.ringAt + 1) % tombstones
	}
}

// armExpiryLocked makes sure the expiry timer fires by at. e.mu is held.
func (e *Engine) armExpiryLocked(at time.Time) {
	switch {
	case e.expTimer == nil:
		e.expTimer = time.AfterFunc(time.Until(at), e.expire)
	case e.expArmed && !at.Before(e.expAt):
		return // it fires early enough, and looks again then
	default:
		e.expTimer.Reset(time.Until(at))
	}
	e.expAt, e.expArmed = at, true
}

// expire fails the grants whose deadline passed and sets the timer for the
// next one.
func (e *Engine) expire() {
	now := time.Now()
	var due []*Grant
	e.mu.Lock()
	e.expArmed = false
	for len(e.expiry) > 0 && !now.Before(e.expiry[0].ticket.Deadline) {
		due = append(due, heap.Pop(&e.expiry).(*Grant))
	}
	if len(e.expiry) > 0 && !e.closed {
		e.armExpiryLocked(e.expiry[0].ticket.Deadline)
	}
	e.mu.Unlock()
	for _, g := range due {
		g.terminate(g.deadlineErr())
	}
}

// grantHeap orders open grants by deadline (container/heap); Grant.due is a
// grant's index, -1 when it is not in the heap.
type grantHeap []*Grant

func (h grantHeap) Len() int { return len(h) }
func (h grantHeap) Less(i, j int) bool {
	return h[i].ticket.Deadline.Before(h[j].ticket.Deadline)
}
func (h grantHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].due, h[j].due = i, j
}
func (h *grantHeap) Push(x any) {
	g := x.(*Grant)
	g.due = len(*h)
	*h = append(*h, g)
}
func (h *grantHeap) Pop() any {
	old := *h
	g := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	g.due = -1
	return g
}

// shmFence closes g's shm slot, waiting up to wait for a copy in progress,
// and reports whether nothing can land any more; see shm_linux.go.
func (e *Engine) shmFence(g *Grant, wait time.Duration) bool {
	if e.shm != nil && g.slot >= 0 {
		return e.shm.fence(g, wait)
	}
	return true
}

// watchQuarantine ends g's quarantine once its slot could be fenced: the
// writer's bracket ended or its process exited. Engine.Close ends it too
// (the regions are unmapped then).
func (e *Engine) watchQuarantine(g *Grant) {
	defer e.quarantines.Done()
	start, wait := time.Now(), time.Millisecond
	t := time.NewTimer(wait)
	defer t.Stop()
	for !e.shmFence(g, 0) {
		select {
		case <-t.C:
		case <-e.ctx.Done():
			e.log.Warn("rdma: engine closed with a grant quarantined", "grant", g.id, "request", g.ticket.RequestID, "for", time.Since(start))
			g.finish()
			return
		}
		wait = min(2*wait, 50*time.Millisecond)
		t.Reset(wait)
	}
	e.log.Info("rdma: grant quarantine over: its destination may be reused", "grant", g.id, "request", g.ticket.RequestID, "bytes", g.ticket.Bytes, "after", time.Since(start))
	g.finish()
}

// shmCopied returns the bytes shm writers recorded copying into g; the slot
// is fenced.
func (e *Engine) shmCopied(g *Grant) uint64 {
	if e.shm == nil || g.slot < 0 {
		return 0
	}
	return e.shm.copied(g)
}

// TransportFor reports the transport chosen for a connected peer.
func (e *Engine) TransportFor(agent AgentID) (Transport, bool) {
	e.peerMu.Lock()
	defer e.peerMu.Unlock()
	p, ok := e.peers[agent]
	if !ok {
		return "", false
	}
	return p.link.transport(), true
}

// Connect pre-connects to a peer and returns the transport chosen. The
// choice is the first of inproc (the peer engine lives in this process), shm
// (same Host) and tcp that both engines serve and that connects; it is always
// logged, and a transport skipped because it failed to connect is logged as
// a warning with the reason. Connecting again to the same descriptor is a
// no-op; a changed descriptor replaces the old connection.
func (e *Engine) Connect(ctx context.Context, peer Descriptor) (Transport, error) {
	if err := e.beginOp(); err != nil {
		return "", err
	}
	defer e.ops.Done()
	p, err := e.peerFor(ctx, peer)
	if err != nil {
		return "", err
	}
	return p.link.transport(), nil
}

func sameEndpoint(a, b Descriptor) bool {
	return a.Agent == b.Agent && a.Host == b.Host && a.TCPAddr == b.TCPAddr && a.ShmAddr == b.ShmAddr && slices.Equal(a.Transports, b.Transports)
}

func (e *Engine) peerFor(ctx context.Context, peer Descriptor) (*peerState, error) {
	if peer.Agent == "" {
		return nil, fmt.Errorf("%w: descriptor without agent", ErrNoTransport)
	}
	// A replaced link is closed after peerMu is released: closing waits for
	// the link's own reconnects, which must not stall every other peer.
	var stale link
	e.peerMu.Lock()
	if p, ok := e.peers[peer.Agent]; ok {
		if sameEndpoint(p.desc, peer) {
			e.peerMu.Unlock()
			return p, nil
		}
		e.log.Info("rdma: peer descriptor changed, reconnecting", "peer", string(peer.Agent))
		delete(e.peers, peer.Agent)
		stale = p.link
	}
	e.peerMu.Unlock()
	if stale != nil {
		stale.close()
	}

	// Dial without the lock; Close cancels a dial in progress.
	dctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(e.ctx, cancel)
	defer stop()
	l, err := e.dial(dctx, peer)
	if err != nil {
		if e.ctx.Err() != nil {
			return nil, ErrClosed
		}
		return nil, err
	}
	e.peerMu.Lock()
	if e.ctx.Err() != nil {
		e.peerMu.Unlock()
		l.close()
		return nil, ErrClosed
	}
	old, ok := e.peers[peer.Agent]
	if ok && sameEndpoint(old.desc, peer) { // a concurrent dial won
		e.peerMu.Unlock()
		l.close()
		return old, nil
	}
	p := &peerState{desc: peer, link: l}
	e.peers[peer.Agent] = p
	e.peerMu.Unlock()
	if ok {
		old.link.close()
	}
	return p, nil
}

func (e *Engine) serves(t Transport) bool { return slices.Contains(e.served, t) }

// dial chooses and connects a transport to peer.
func (e *Engine) dial(ctx context.Context, peer Descriptor) (link, error) {
	type candidate struct {
		t      Transport
		reason string
		dial   func() (link, error)
	}
	var cands []candidate
	both := func(t Transport) bool { return e.serves(t) && slices.Contains(peer.Transports, t) }
	if both(TransportInproc) {
		if rx := inprocLookup(peer); rx != nil {
			cands = append(cands, candidate{TransportInproc, "peer engine is in this process", func() (link, error) { return &inprocLink{tx: e, rx: rx}, nil }})
		}
	}
	if both(TransportCUDAIPC) && peer.TCPAddr != "" {
		if ok, reason := e.ipcReach(peer); ok {
			cands = append(cands, candidate{TransportCUDAIPC, reason, func() (link, error) { return dialIPC(ctx, e, peer) }})
		}
	}
	// shm maps memfds: device memory on either side goes by cuda-ipc or tcp.
	if both(TransportSHM) && peer.Host == e.cfg.Host && peer.ShmAddr != "" && !e.devs.any() && !hasDeviceRegions(peer) {
		cands = append(cands, candidate{TransportSHM, "peer is on this host", func() (link, error) { return dialSHM(ctx, e, peer) }})
	}
	if both(TransportTCP) && peer.TCPAddr != "" {
		reason := "peer is on another host"
		if peer.Host == e.cfg.Host {
			reason = "same host, shm not served by both"
			if e.devs.any() || hasDeviceRegions(peer) {
				reason = "same host, device memory, cuda-ipc not usable"
			}
		}
		cands = append(cands, candidate{TransportTCP, reason, func() (link, error) { return dialTCP(ctx, e, peer) }})
	}
	var errs []error
	for _, c := range cands {
		l, err := c.dial()
		if err != nil {
			e.log.Warn("rdma: transport unavailable, trying the next", "peer", string(peer.Agent), "transport", string(c.t), "err", err)
			errs = append(errs, fmt.Errorf("%s: %w", c.t, err))
			continue
		}
		e.log.Info("rdma: transport chosen", "peer", string(peer.Agent), "transport", string(c.t), "reason", c.reason, "skipped", len(errs))
		return l, nil
	}
	if len(errs) == 0 {
		return nil, fmt.Errorf("%w: with %s (we serve %v, it serves %v)", ErrNoTransport, peer.Agent, e.served, peer.Transports)
	}
	return nil, fmt.Errorf("%w: with %s: %w", ErrNoTransport, peer.Agent, errors.Join(errs...))
}

// piece is one contiguous copy: src lands at offset off of destination extent ext.
type piece struct {
	ext uint32
	off uint64
	src []byte
	// apart: the piece is summed into crc, on its own, and joined into the
	// manifest afterwards (an extent that lanes of a striped tcp write share).
	apart bool
	crc   uint32
	// dev is the source in device memory, dn bytes of it; src is nil then.
	dev devSpan
	dn  uint64
}

// writeOp is one Write as the backends see it.
type writeOp struct {
	t        *Ticket // &tk
	tk       Ticket
	pieces   []piece
	manifest *Manifest // &mf: Bytes set; CRC filled by the backend through sum
	mf       Manifest
	noCRC    bool // SkipCRC: the manifest carries byte counts only
	dev      bool // some piece's source is in device memory (device.go)
	// n is the bytes of pieces: the ticket's for Write, a part of them for
	// one write of a Stream.
	n uint64
	// partial: one write of a Stream. Its pieces land (and are known to
	// have landed when write returns) but nothing is committed; every
	// piece is summed apart, and the Stream joins the sums at its commit.
	partial bool
}

// sum folds src, the next bytes of piece p, into its crc (crcFor). Pieces
// of one extent are summed in order unless apart.
func (op *writeOp) sum(p *piece, src []byte) {
	if !op.noCRC {
		sum := op.crcFor(p)
		*sum = crc32Update(*sum, src)
	}
}

// commitFlags returns the commit frame's flags.
func (op *writeOp) commitFlags() uint8 {
	if op.noCRC {
		return flagNoCRC
	}
	return 0
}

var opPool = sync.Pool{New: func() any { return new(writeOp) }}

// Write copies the concatenation of src (local extents) into the
// concatenation of the ticket's extents (same total length), then commits
// with a manifest, and returns once the receiver accepted or refused the
// commit: one round trip per request. Source extents may be split at the
// destination's extent boundaries and vice versa. The source memory must not
// change until Write returns. A refusal by the receiver is a *RemoteError
// wrapping the sentinel (ErrRevoked, ErrStaleEpoch, ErrManifestMismatch, ...).
func (e *Engine) Write(ctx context.Context, peer Descriptor, t Ticket, src []Extent) (Manifest, error) {
	if err := e.beginOp(); err != nil {
		return Manifest{}, err
	}
	defer e.ops.Done()
	if t.Agent != peer.Agent {
		return Manifest{}, fmt.Errorf("%w: ticket is for %q, descriptor for %q", ErrWrongPeer, t.Agent, peer.Agent)
	}
	if len(t.Extents) == 0 || len(t.Extents) > maxExtents {
		return Manifest{}, fmt.Errorf("%w: ticket has %d extents", ErrOutOfRange, len(t.Extents))
	}
	if !t.Deadline.IsZero() && !time.Now().Before(t.Deadline) {
		return Manifest{}, fmt.Errorf("%w: grant %d expired at %s", ErrDeadline, t.Grant, t.Deadline.Format(time.RFC3339Nano))
	}
	m := Manifest{Bytes: make([]uint64, len(t.Extents)), CRC: make([]uint32, len(t.Extents))}
	var total uint64
	for i, x := range t.Extents {
		if x.Length == 0 || x.Length > maxDataLen {
			return Manifest{}, fmt.Errorf("%w: ticket extent %d of %d bytes", ErrOutOfRange, i, x.Length)
		}
		m.Bytes[i] = x.Length
		total += x.Length
	}
	if total != t.Bytes {
		return Manifest{}, fmt.Errorf("%w: ticket extents sum to %d bytes, ticket says %d", ErrOutOfRange, total, t.Bytes)
	}
	op := opPool.Get().(*writeOp)
	defer func() {
		clear(op.pieces)
		op.pieces, op.t, op.tk, op.manifest, op.mf, op.noCRC, op.n, op.partial = op.pieces[:0], nil, Ticket{}, nil, Manifest{}, false, 0, false
		op.dev = false
		opPool.Put(op)
	}()
	op.tk, op.mf = t, m // in the pooled op, so that neither escapes; mf shares m's arrays
	op.t, op.manifest, op.noCRC, op.n = &op.tk, &op.mf, e.cfg.SkipCRC, total
	if err := e.split(op, src, total); err != nil {
		return Manifest{}, err
	}
	p, err := e.peerFor(ctx, peer)
	if err != nil {
		return Manifest{}, err
	}
	if op.dev && p.link.transport() == TransportSHM {
		return Manifest{}, fmt.Errorf("%w: a device source over shm (register device regions before connecting)", ErrUnsupported)
	}
	if err := p.link.write(ctx, op); err != nil {
		e.stats.writesFailed.Add(1)
		return Manifest{}, err
	}
	e.stats.writes.Add(1)
	e.stats.bytesWritten.Add(total)
	return m, nil
}

// split cuts the source extents into pieces at destination extent boundaries.
func (e *Engine) split(op *writeOp, src []Extent, total uint64) error {
	e.mu.RLock()
	defer e.mu.RUnlock()
	var have uint64
	dst := op.t.Extents
	di, doff := 0, uint64(0)
	for i, s := range src {
		r, ok := e.regions[s.Region]
		if !ok {
			return fmt.Errorf("%w: source extent %d names unknown local region %d", ErrOutOfRange, i, s.Region)
		}
		if err := r.checkExtent(s, false); err != nil {
			return fmt.Errorf("source extent %d: %w", i, err)
		}
		have += s.Length
		if have > total {
			return fmt.Errorf("%w: source extents hold more than the ticket's %d bytes", ErrOutOfRange, total)
		}
		if r.dev != nil {
			splitDevice(op, r.dev, s, &di, &doff)
			continue
		}
		b := r.slice(s)
		for len(b) > 0 {
			n := min(uint64(len(b)), dst[di].Length-doff)
			op.pieces = append(op.pieces, piece{ext: uint32(di), off: doff, src: b[:n:n]})
			b = b[n:]
			doff += n
			if doff == dst[di].Length {
				di, doff = di+1, 0
			}
		}
	}
	if have != total {
		return fmt.Errorf("%w: source extents hold %d bytes, ticket %d", ErrOutOfRange, have, total)
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
