package rdma

// The package's vocabulary: transports, agents, regions, extents, the
// Descriptor a peer needs, and a grant's spec, Ticket and Manifest. Most
// of it is plain data that the control plane carries.

import "time"

// Transport names a backend. Values are lower-case, used in logs and metric labels.
type Transport string

// The transports, in order of preference.
const (
	TransportInproc  Transport = "inproc"   // both engines in one process: memcpy
	TransportCUDAIPC Transport = "cuda-ipc" // same host, device regions: the receiver copies device to device through CUDA IPC
	TransportSHM     Transport = "shm"      // same host: the writer copies into the receiver's mapped memfd
	TransportTCP     Transport = "tcp"      // anywhere: framed writes over pooled TCP connections
	// TransportUCX: UCX active messages, the receiver pulling each one
	// (tcp, cma; verbs where UCX has it). Opt-in: only in builds with
	// -tags ucx (internal/ucx), never in the default Transports.
	TransportUCX Transport = "ucx"
)

// AgentID names an engine; unique per process.
type AgentID string

// MaxExtents bounds the extents of one grant (a Ticket's); it keeps a
// commit payload (12 bytes per extent) under 12 MiB.
const MaxExtents = 1 << 20

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
	// UCXAddr is the UCX worker address writers connect to (ucx); empty
	// when ucx is not served.
	UCXAddr []byte `json:"ucx_addr,omitempty"`
	// Incarnation tells apart the engines that have carried one Agent over
	// time (a worker restarted under its stable instance id): the wall
	// clock, in unix nanoseconds, when the engine was created, so a later
	// engine's is greater. A writer never lets a descriptor of an older
	// incarnation replace its link to a newer one (ErrStaleDescriptor). 0
	// is unknown (a descriptor from a peer, or through a wire form, that
	// predates the field): such a descriptor is never judged stale.
	Incarnation uint64 `json:"incarnation,omitempty"`
}

// GrantSpec describes a grant to open on the receiver.
type GrantSpec struct {
	RequestID uint64    // never 0
	Extents   []Extent  // destination runs in this engine's regions; disjoint
	Deadline  time.Time // zero: now + Config.GrantTTL
}

// Ticket is what the writer needs to write into a grant. It is plain data
// (JSON-serialisable) and travels to the writer on the control plane.
type Ticket struct {
	Agent     AgentID   `json:"agent"`
	Grant     uint64    `json:"grant"`
	Epoch     uint64    `json:"epoch"`
	Token     [16]byte  `json:"token"`
	RequestID uint64    `json:"request_id"`
	Extents   []Extent  `json:"extents"`
	Bytes     uint64    `json:"bytes"`
	Deadline  time.Time `json:"deadline"`
}

// Manifest is what a commit carries: bytes and crc32c (Castagnoli) per
// destination extent, in ticket order.
type Manifest struct {
	Bytes []uint64 `json:"bytes"`
	CRC   []uint32 `json:"crc"`
}
