package wire

// Every control-plane message of the protocol is declared in this file, with
// the conversions of a Peer to and from an rdma.Descriptor; a grant's ticket
// and a commit's manifest travel as the rdma types themselves. Messages are
// msgpack maps with explicit short keys and a version field "v"; unknown
// keys are ignored so a later minor revision may add fields. Bulk fields
// (tokens, extents, manifests) travel as packed little-endian byte strings,
// never as msgpack arrays (packed.go): reflection over thousands of array
// items costs ~20x more. codec.go holds the Encode and Decode functions,
// msgcodec.go the hand-written codecs of the messages on every handoff's
// path.

import (
	"slices"
	"time"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/session"
)

// WireVersion is the version every message carries. A receiver refuses other
// versions with ErrBadMessage.
const WireVersion uint8 = 1

// DefaultMaxPayload is NATS's default max_payload (1 MiB). The drivers use the
// connected server's value; this is the fallback.
const DefaultMaxPayload = 1 << 20

// Sampling carries the request's sampling parameters to the prefill worker,
// which samples the first token.
type Sampling struct {
	Temperature float64 `msgpack:"t"`
	Seed        uint64  `msgpack:"s"`
	// TopP restricts the draw to the nucleus; 0 means unset (omitted, so a
	// request without it encodes as before).
	TopP float64 `msgpack:"p,omitempty"`
	// Logprobs asks for the first token's logprobs: 0 none, else 1 plus
	// the number of alternatives.
	Logprobs uint8 `msgpack:"lp,omitempty"`
}

// RegionInfo is the wire form of rdma.RegionDesc.
type RegionInfo struct {
	ID     uint32 `msgpack:"id"`
	Name   string `msgpack:"n"`
	Length uint64 `msgpack:"l"`
	// Memory and Device: a device region ("cuda") and its device's UUID;
	// empty for host memory (and then not encoded).
	Memory string `msgpack:"m,omitempty"`
	Device string `msgpack:"d,omitempty"`
}

// Peer is the wire form of an rdma.Descriptor: how to reach an agent's regions.
type Peer struct {
	Agent      string       `msgpack:"a"`
	Host       string       `msgpack:"h"`
	TCPAddr    string       `msgpack:"tcp"`
	ShmAddr    string       `msgpack:"shm"`
	Transports []string     `msgpack:"tr"`
	Regions    []RegionInfo `msgpack:"r"`
	// IPCNamespace and CUDADevices: whose CUDA IPC exports the agent can
	// open (cuda-ipc); empty without device regions (and then not encoded).
	IPCNamespace string   `msgpack:"ipc,omitempty"`
	CUDADevices  []string `msgpack:"cd,omitempty"`
	// UCXAddr is the agent's UCX worker address (ucx); empty when ucx is
	// not served (and then not encoded).
	UCXAddr []byte `msgpack:"ucx,omitempty"`
	// Incarnation is the agent's rdma.Descriptor.Incarnation: a writer
	// holding a link to a later incarnation of the agent refuses this
	// descriptor rather than let it replace the link. 0 (not encoded):
	// unknown, as from a peer that predates it.
	Incarnation uint64 `msgpack:"inc,omitempty"`
}

// PeerOf converts a descriptor to its wire form.
func PeerOf(d rdma.Descriptor) Peer {
	p := Peer{Agent: string(d.Agent), Host: d.Host, TCPAddr: d.TCPAddr, ShmAddr: d.ShmAddr, IPCNamespace: d.IPCNamespace, Incarnation: d.Incarnation}
	if len(d.CUDADevices) > 0 {
		p.CUDADevices = slices.Clone(d.CUDADevices)
	}
	if len(d.UCXAddr) > 0 {
		p.UCXAddr = slices.Clone(d.UCXAddr)
	}
	if len(d.Transports) > 0 {
		p.Transports = make([]string, len(d.Transports))
		for i, t := range d.Transports {
			p.Transports[i] = string(t)
		}
	}
	if len(d.Regions) > 0 {
		p.Regions = make([]RegionInfo, len(d.Regions))
		for i, r := range d.Regions {
			p.Regions[i] = RegionInfo{ID: uint32(r.ID), Name: r.Name, Length: r.Length, Memory: string(r.Memory), Device: r.Device}
		}
	}
	return p
}

// Descriptor converts p back to an rdma.Descriptor.
func (p Peer) Descriptor() rdma.Descriptor {
	d := rdma.Descriptor{Agent: rdma.AgentID(p.Agent), Host: p.Host, TCPAddr: p.TCPAddr, ShmAddr: p.ShmAddr, IPCNamespace: p.IPCNamespace, Incarnation: p.Incarnation}
	if len(p.CUDADevices) > 0 {
		d.CUDADevices = slices.Clone(p.CUDADevices)
	}
	if len(p.UCXAddr) > 0 {
		d.UCXAddr = slices.Clone(p.UCXAddr)
	}
	if len(p.Transports) > 0 {
		d.Transports = make([]rdma.Transport, len(p.Transports))
		for i, t := range p.Transports {
			d.Transports[i] = rdma.Transport(t)
		}
	}
	if len(p.Regions) > 0 {
		d.Regions = make([]rdma.RegionDesc, len(p.Regions))
		for i, r := range p.Regions {
			d.Regions[i] = rdma.RegionDesc{ID: rdma.RegionID(r.ID), Name: r.Name, Length: r.Length, Memory: rdma.Memory(r.Memory), Device: r.Device}
		}
	}
	return d
}

// PrefillRequest asks a prefill worker to prefill a prompt and write its cache
// into the receiver's grant. Sent by the Decoder as a NATS request.
type PrefillRequest struct {
	V           uint8    `msgpack:"v"`
	RequestID   uint64   `msgpack:"id"`
	From        string   `msgpack:"from"` // the requesting instance id
	Attempt     uint8    `msgpack:"try"`
	Fingerprint string   `msgpack:"fp"` // layout fingerprint of the receiver's model
	Tokens      Tokens   `msgpack:"tok"`
	Sampling    Sampling `msgpack:"smp"`
	Deadline    int64    `msgpack:"dl"`   // unix nanoseconds, on the sender's clock
	Peer        Peer     `msgpack:"peer"` // the receiver's data-plane descriptor
	// Ticket is the receiver's grant, the rdma type itself: a map of the
	// keys a (agent), g (grant), e (epoch), k (token, 16 bytes), id
	// (request), x (extents, packed), b (bytes) and dl (deadline, unix
	// nanoseconds, 0 for none).
	Ticket     rdma.Ticket `msgpack:"tk"`
	KVBytes    uint64      `msgpack:"kvb"` // bytes of the ticket's leading KV extents
	MambaBytes uint64      `msgpack:"mb"`  // bytes of the ticket's trailing Mamba extent
	// Budget is the time left until Deadline when the request was sent, in
	// nanoseconds. The receiver's deadline is its own clock at receipt plus
	// Budget: two hosts' wall clocks are never compared. 0 (a sender that
	// predates it): Deadline is used as it is.
	Budget int64 `msgpack:"rem"`
	// TP is the receiver's tensor-parallel size (issue 12): the ticket's
	// extents are its TP shards' KV runs, shard after shard, then their
	// Mamba rows, each in that shard's own layout (reshard.KVShard,
	// reshard.MambaShard), and the writer reshards its own shards' bytes
	// into them. 0 (omitted) means 1.
	TP uint16 `msgpack:"tp,omitempty"`
	// Drafts is the most draft tokens the receiver verifies in its first
	// decode step (speculative decoding): the prefill worker drafts up to
	// this many on the prompt and its first token and ships them in its
	// reply (PrefillReply.Drafts), as TensorRT-LLM's context server ships
	// DisaggregatedParams.draft_tokens. 0 (omitted): none. At most
	// MaxDrafts.
	Drafts uint8 `msgpack:"nd,omitempty"`
	// Skip is how many leading KV blocks of the prompt the receiver holds
	// already (a delta handoff: its prefix cache has them, pinned for the
	// request): the ticket's KV extents cover the blocks after them only,
	// and the writer sends only those and the state row. It is always
	// fewer than the prompt's blocks, so the last token's block always
	// travels. 0 (omitted): the whole prompt.
	Skip uint32 `msgpack:"skip,omitempty"`
}

// MaxDrafts bounds PrefillRequest.Drafts and PrefillReply.Drafts: a
// verification checks a handful of drafts (handoff's workers at most 16).
const MaxDrafts = 16

// PrefillReply answers a PrefillRequest: success with the first token, or a
// refusal/failure code. Success is sent only after the commit was accepted.
type PrefillReply struct {
	V            uint8        `msgpack:"v"`
	RequestID    uint64       `msgpack:"id"`
	Instance     string       `msgpack:"inst"`
	Code         session.Code `msgpack:"code"`
	Msg          string       `msgpack:"msg"`
	FirstToken   int32        `msgpack:"tok"`
	PrefillNanos int64        `msgpack:"pf"`
	WriteNanos   int64        `msgpack:"wr"`
	// Manifest is the commit's manifest, the rdma type itself: a map of
	// b (bytes per extent) and c (their crc32c), both packed.
	Manifest rdma.Manifest `msgpack:"man"`
	// Logprobs are the first token's logprobs when the request asked, in
	// the worker's encoding (model.Logprobs.MarshalBinary); omitted when empty.
	Logprobs []byte `msgpack:"lp,omitempty"`
	// Cached is how many prompt tokens the prefill worker's prefix cache
	// served instead of computing them (OpenAI's cached_tokens); omitted
	// when 0.
	Cached uint32 `msgpack:"cached,omitempty"`
	// Drafts are the draft tokens the prefill worker proposes after the
	// first token, at most the request's Drafts (and MaxDrafts), each a
	// token id >= 0 (the receiver checks them against its vocabulary);
	// omitted when none. The receiver's first decode step verifies them.
	Drafts Tokens `msgpack:"dr,omitempty"`
	// TooLong, on a capacity refusal, says the request can never run on
	// this instance: its prompt and new tokens exceed what the pools hold
	// (not that they are busy). Omitted when false.
	TooLong bool `msgpack:"long,omitempty"`
}

// Cancel tells the worker that serves a request to stop and free it. Published
// (no reply) on the instance's cancel subject or on the namespace's.
type Cancel struct {
	V         uint8        `msgpack:"v"`
	RequestID uint64       `msgpack:"id"`
	Grant     uint64       `msgpack:"g"` // the grant of the cancelled attempt; 0 cancels any
	Code      session.Code `msgpack:"code"`
	// From is the decode instance that sent the request: request and grant
	// ids are only unique per decoder. Empty (an older sender) matches any.
	From string `msgpack:"from"`
}

// StateOffer tells a prefill instance that a decode instance holds a
// conversation's end-of-turn state: its KV blocks and a state checkpoint
// after exactly Tokens. Published (no reply) on the prefill instance's
// state offer subject; the prefill instance may pull the state with a
// handoff of its own, roles swapped, on the state prefix
// (transfer.StatePrefix), addressed to From.
type StateOffer struct {
	V           uint8  `msgpack:"v"`
	From        string `msgpack:"from"` // the decode instance holding the state
	Fingerprint string `msgpack:"fp"`   // its layout fingerprint
	Tokens      Tokens `msgpack:"tok"`  // the state is the one after all of them
}

// Capacity is an instance's advertised room.
type Capacity struct {
	Ranks      int `msgpack:"ranks"`
	Rows       int `msgpack:"rows"`
	Blocks     int `msgpack:"blocks"`
	FreeRows   int `msgpack:"frows"`
	FreeBlocks int `msgpack:"fblocks"`
	Inflight   int `msgpack:"infl"`
}

// Instance is what each worker instance publishes in the registry bucket and
// refreshes with heartbeats.
type Instance struct {
	V           uint8    `msgpack:"v"`
	ID          string   `msgpack:"id"`
	Role        Role     `msgpack:"role"`
	Fingerprint string   `msgpack:"fp"`
	Peer        Peer     `msgpack:"peer"`
	Capacity    Capacity `msgpack:"cap"`
	Updated     int64    `msgpack:"at"` // unix nanoseconds of the heartbeat
	// Draining: the instance takes no new requests (it finishes the ones it
	// holds, so it stays registered); decoders do not address it.
	Draining bool `msgpack:"drain"`
	// Service is the id of a prefill instance's NATS micro service: a
	// decoder that lost every data-path connection from it pings it
	// ($SRV.PING.<ServiceName>.<Service>) before taking it for dead. A
	// decode instance puts its reply inbox there (the subjects its
	// requests' replies go to begin with it). A process keeps one for its
	// life, so it names the incarnation: another one under the same id is
	// a restart.
	Service string `msgpack:"svc,omitempty"`
}

// Role is a worker's role in the registry.
type Role string

const (
	RolePrefill Role = "prefill"
	RoleDecode  Role = "decode"
	// RoleAgent is a handoff agent beside an engine in another language
	// (package agent): it serves the data path for that engine's caches
	// and takes part in no routing.
	RoleAgent Role = "agent"
)

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func fromUnixNano(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}
