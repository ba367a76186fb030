package rdma

// Config: what an Engine is told at New, its defaults and its checks.

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/handoff-io/handoff/internal/ucx"
)

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
	TLS *tls.Config
	// UCX are UCX settings for the ucx transport, named without the UCX_
	// prefix ("TLS": "tcp"); the process environment (UCX_TLS=...) wins
	// over them, and they over internal/ucx's Defaults.
	UCX    map[string]string
	Logger *slog.Logger // default slog.Default()

	// incarnation is minted by validate, once per New: the engine's
	// Descriptor.Incarnation.
	incarnation uint64
}

// Supported returns an error wrapping ErrUnsupported when this build, on
// this platform, cannot serve t.
func (t Transport) Supported() error {
	switch t {
	case TransportInproc, TransportTCP, TransportCUDAIPC:
	case TransportSHM:
		if !shmSupported {
			return fmt.Errorf("%w: transport shm needs linux", ErrUnsupported)
		}
	case TransportUCX:
		if !ucxSupported {
			return fmt.Errorf("%w: transport ucx: this build has no UCX (build with -tags ucx, on linux with cgo and libucx-dev): %w", ErrUnsupported, ucx.ErrUnavailable)
		}
	default:
		return fmt.Errorf("%w: transport %q", ErrUnsupported, t)
	}
	return nil
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
		if err := t.Supported(); err != nil {
			return err
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
	c.incarnation = newIncarnation()
	return nil
}

// lastIncarnation is the last incarnation newIncarnation minted.
var lastIncarnation atomic.Uint64

// newIncarnation mints an engine's incarnation: the wall clock in unix
// nanoseconds, so that an agent restarted in another process (on this host
// or, with clocks in sync, another) gets a greater one than before; a clock
// stepped back by more than the old process's lifetime would break that,
// which NTP-synced hosts do not do. Within a process it is strictly
// increasing, whatever the clock, so engines created one after another
// under one Agent (tests, a restarted engine) are ordered too.
func newIncarnation() uint64 {
	now := uint64(max(time.Now().UnixNano(), 1))
	for {
		last := lastIncarnation.Load()
		next := max(now, last+1)
		if lastIncarnation.CompareAndSwap(last, next) {
			return next
		}
	}
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
