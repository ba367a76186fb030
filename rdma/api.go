package rdma

// API CONTRACT (to be implemented; exported names are fixed, bodies are not;
// add to it freely, but do not rename or remove without telling the lead).

import (
	"context"
	"errors"
	"log/slog"
	"time"
)

var (
	ErrClosed           = errors.New("rdma: engine closed")
	ErrUnknownGrant     = errors.New("rdma: unknown grant")
	ErrBadToken         = errors.New("rdma: bad grant token")
	ErrStaleEpoch       = errors.New("rdma: stale grant epoch")
	ErrOutOfRange       = errors.New("rdma: extent out of range")
	ErrForbidden        = errors.New("rdma: extent overlaps a forbidden range")
	ErrRevoked          = errors.New("rdma: grant revoked")
	ErrDeadline         = errors.New("rdma: grant deadline exceeded")
	ErrManifestMismatch = errors.New("rdma: commit manifest mismatch")
	ErrMalformedFrame   = errors.New("rdma: malformed frame")
	ErrPeerClosed       = errors.New("rdma: peer closed")
	ErrNoTransport      = errors.New("rdma: no common transport")
	ErrUnsupported      = errors.New("rdma: unsupported")
	ErrBadRequestID     = errors.New("rdma: request id 0 cannot be granted")
)

// Transport names a backend. Values are lower-case, used in logs and metric labels.
type Transport string

const (
	TransportInproc Transport = "inproc"
	TransportTCP    Transport = "tcp"
	TransportSHM    Transport = "shm"
)

type AgentID string
type RegionID uint32

// Extent is a byte range of a registered region (local or remote).
type Extent struct {
	Region RegionID
	Offset uint64
	Length uint64
}

type RegionDesc struct {
	ID     RegionID
	Name   string
	Length uint64
}

// Descriptor is everything a peer needs to reach this agent's regions. It is
// plain data; transfer/ encodes it on the wire.
type Descriptor struct {
	Agent      AgentID
	Host       string // host identity (boot id); equal hosts may use shm
	TCPAddr    string
	ShmAddr    string // control socket for shm
	Transports []Transport
	Regions    []RegionDesc
}

type Config struct {
	Agent      AgentID     // unique per process; required
	Transports []Transport // served transports; default all three
	TCPAddr    string      // listen address, default "127.0.0.1:0"
	Advertise  string      // advertised TCP address (POD_IP:port); default the listener's
	Logger     *slog.Logger
}

// Engine owns regions, grants, listeners and peer connections.
type Engine struct{}

func New(cfg Config) (*Engine, error)                               { panic("unimplemented") }
func (e *Engine) Register(name string, size int64) (*Region, error) { panic("unimplemented") }
func (e *Engine) Descriptor() Descriptor                            { panic("unimplemented") }
func (e *Engine) Close() error                                      { panic("unimplemented") }

// Region is registered memory. Bytes is valid until Engine.Close.
type Region struct{}

func (r *Region) ID() RegionID                 { panic("unimplemented") }
func (r *Region) Bytes() []byte                { panic("unimplemented") }
func (r *Region) Len() int64                   { panic("unimplemented") }
func (r *Region) Forbid(offset, length uint64) { panic("unimplemented") } // never grantable (reserved rows)

// ----- receiver side -----

type GrantSpec struct {
	RequestID uint64 // never 0
	Extents   []Extent
	Deadline  time.Time
}

// Ticket is what the writer needs to write into a grant. Plain data.
type Ticket struct {
	Agent     AgentID
	Grant     uint64
	Epoch     uint64
	Token     [16]byte
	RequestID uint64
	Extents   []Extent
	Bytes     uint64
	Deadline  time.Time
}

// Manifest is what a commit carries: bytes and crc32c (Castagnoli) per destination extent.
type Manifest struct {
	Bytes []uint64
	CRC   []uint32
}

type Grant struct{}

func (e *Engine) OpenGrant(spec GrantSpec) (*Grant, error)  { panic("unimplemented") }
func (g *Grant) Ticket() Ticket                             { panic("unimplemented") }
func (g *Grant) Wait(ctx context.Context) (Manifest, error) { panic("unimplemented") }
func (g *Grant) Revoke()                                    { panic("unimplemented") } // idempotent; on return no further byte lands
func (g *Grant) Done() <-chan struct{}                      { panic("unimplemented") }

// ----- writer side -----

// Connect pre-connects to a peer and returns the transport chosen (always logged).
func (e *Engine) Connect(ctx context.Context, peer Descriptor) (Transport, error) {
	panic("unimplemented")
}

// Write copies the concatenation of src (local extents) into the concatenation of the
// ticket's extents (same total length), then commits with a manifest, and returns once
// the receiver accepted or refused the commit.
func (e *Engine) Write(ctx context.Context, peer Descriptor, t Ticket, src []Extent) (Manifest, error) {
	panic("unimplemented")
}
