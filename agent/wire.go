package agent

// The local API's messages and framing (the ticket's encoding is in
// ticket.go). Each message is a msgpack map in a frame: a 4-byte
// big-endian length, then the map. The engine sends requests (Op, ID); the
// agent answers each with one reply (Re = the request's ID, Err when it
// failed) and sends events (Ev) whenever a grant or a send ends. No IO here
// but io.Reader/io.Writer.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/internal/msgpackcheck"
)

// Version is the local API's version, sent in hello. 2 added planes,
// the KV order and registration by buffers (Plane, KVLayout.Order,
// Request.Buffers): an agent of version 1 would ignore them and place
// bytes as if blocks lay back to back, so a client that uses them says 2,
// which such an agent refuses by name. 3 added the conv order
// (MambaLayout.ConvOrder), which an older agent would ignore alike. This
// agent serves clients of every version up to its own.
const Version = 3

// MaxFrame bounds a frame: a ticket over thousands of blocks fits many times.
const MaxFrame = 16 << 20

// The ops of requests.
const (
	OpHello     = "hello"      // -> Reply.Agent, Reply.Version
	OpRegister  = "register"   // Layout, KVBytes, MambaBytes (or Buffers), the fds by SCM_RIGHTS (kv first; host memory and VMM allocations) -> Fingerprint, AgentID
	OpGrant     = "grant"      // RequestID, Blocks, Row, DeadlineMS -> Grant, Ticket; later an event
	OpRevoke    = "revoke"     // Grant -> {}; nothing lands after the reply
	OpSend      = "send"       // Ticket, Blocks, Row -> Send; later an event (with Wait: no event, the reply comes once it ended)
	OpOpenSend  = "open_send"  // Ticket, Blocks, Row -> Send: a layer-by-layer send
	OpSendLayer = "send_layer" // Send, Kind ("kv"|"mamba"), Layer -> {} once queued
	OpCommit    = "commit"     // Send -> {} once queued: sends what is missing, commits; later an event
	OpCancel    = "cancel"     // Send -> {}: gives a send up; its event says so
	OpOffer     = "offer"      // Ticket, To -> {} once agent To handed it to its engine (NATS), as an EvTicket
	OpPeers     = "peers"      // -> Peers: the other agents of the namespace's registry (NATS)
)

// The kinds of events.
const (
	EvGrantDone   = "grant_done"   // the grant's bytes all landed, verified
	EvGrantFailed = "grant_failed" // revoked, deadline, refused commit: Code, Msg
	EvSendDone    = "send_done"    // the receiver accepted the commit
	EvSendFailed  = "send_failed"  // Code, Msg
	EvTicket      = "ticket"       // Ticket, RequestID, Agent: a ticket another agent offered (OpOffer)
	// EvQuarantined, the last event of a connection the agent ends while
	// stopping: a writer may still store into the engine's memory (a
	// revoked grant's shm writer frozen mid-copy), which is not safe to
	// use yet. Code, Msg.
	EvQuarantined = "quarantined"
)

// Request is what an engine sends.
type Request struct {
	Op         string    `msgpack:"op"`
	ID         uint64    `msgpack:"id"`
	Version    int       `msgpack:"v,omitempty"`
	Layout     *Layout   `msgpack:"layout,omitempty"`
	KVBytes    int64     `msgpack:"kv_bytes,omitempty"`
	MambaBytes int64     `msgpack:"mamba_bytes,omitempty"`
	RequestID  uint64    `msgpack:"request_id,omitempty"`
	Blocks     BlockList `msgpack:"blocks,omitempty"`
	Row        *int      `msgpack:"row,omitempty"`
	DeadlineMS int64     `msgpack:"deadline_ms,omitempty"`
	FromTP     int       `msgpack:"from_tp,omitempty"` // grant: the senders' TP size; 0: this agent's
	Grant      uint64    `msgpack:"grant,omitempty"`
	Send       uint64    `msgpack:"send,omitempty"`
	Ticket     []byte    `msgpack:"ticket,omitempty"`
	Kind       string    `msgpack:"kind,omitempty"`
	To         string    `msgpack:"to,omitempty"` // offer: the agent to hand the ticket to
	Layer      int       `msgpack:"layer,omitempty"`
	Wait       bool      `msgpack:"wait,omitempty"` // send: reply once the send ended, instead of an event
	// KVCUDA and MambaCUDA (register): the pool is in device memory, shared
	// by CUDA IPC handle instead of by fd.
	KVCUDA    *CUDAMemory `msgpack:"kv_cuda,omitempty"`
	MambaCUDA *CUDAMemory `msgpack:"mamba_cuda,omitempty"`
	// Buffers (register), instead of the above: the memory of caches kept
	// in allocations of their own (vLLM's per-layer tensors), which the
	// layout's planes name by index (Plane.Buffer); the host ones come as
	// fds by SCM_RIGHTS, in order.
	Buffers Buffers `msgpack:"buffers,omitempty"`
}

// Buffer is one piece of memory a registration passes: Bytes of host
// memory (an fd), or of device memory (CUDA).
type Buffer struct {
	Bytes int64       `msgpack:"bytes"`
	CUDA  *CUDAMemory `msgpack:"cuda,omitempty"`
}

// CUDAMemory names a pool or buffer in device memory: the allocation it
// lies in, its byte offset in that allocation (_share_cuda_'s storage
// offset) and the device's UUID as nvidia-smi prints it ("GPU-…"). The
// allocation is named by one of:
//   - Handle, its CUDA IPC handle (cuIpcGetMemHandle; what torch's
//     storage._share_cuda_() returns as its handle), for memory from
//     cuMemAlloc (torch's default caching allocator);
//   - VMMBytes, its size, for one allocation of the virtual memory
//     management API (cuMemCreate), which no IPC handle names: the engine
//     exports it as a POSIX fd (cuMemExportToShareableHandle) and passes
//     the fd by SCM_RIGHTS, in order with the host buffers' fds. The fd
//     does not say which allocation it is (the driver's exports are all
//     one device file), so VMMID does: buffers with one non-zero VMMID
//     are one allocation, mapped once, whose planes must not overlap; 0
//     is an allocation of its own.
type CUDAMemory struct {
	Handle   []byte `msgpack:"handle,omitempty"`
	VMMBytes uint64 `msgpack:"vmm_bytes,omitempty"`
	VMMID    uint64 `msgpack:"vmm_id,omitempty"`
	Offset   uint64 `msgpack:"offset"`
	Device   string `msgpack:"device"`
}

// passesFD reports whether a buffer's memory comes as a descriptor: host
// memory, or a VMM allocation.
func (b Buffer) passesFD() bool { return b.Bytes > 0 && (b.CUDA == nil || b.CUDA.VMMBytes > 0) }

// Reply answers one request (Re) or is an event (Ev); Code and Msg say why
// a request or a grant or send failed.
type Reply struct {
	Re          uint64   `msgpack:"re,omitempty"`
	Ev          string   `msgpack:"ev,omitempty"`
	Code        string   `msgpack:"code,omitempty"`
	Msg         string   `msgpack:"msg,omitempty"`
	Agent       string   `msgpack:"agent,omitempty"`
	AgentID     string   `msgpack:"agent_id,omitempty"`
	Version     int      `msgpack:"v,omitempty"`
	Fingerprint string   `msgpack:"fingerprint,omitempty"`
	Transports  []string `msgpack:"transports,omitempty"`
	Grant       uint64   `msgpack:"grant,omitempty"`
	Send        uint64   `msgpack:"send,omitempty"`
	RequestID   uint64   `msgpack:"request_id,omitempty"`
	Ticket      []byte   `msgpack:"ticket,omitempty"`
	Bytes       uint64   `msgpack:"bytes,omitempty"`
	Peers       []Peer   `msgpack:"peers,omitempty"`
}

// Peer is another agent as the registry shows it (OpPeers): its name, the
// layout fingerprint and rdma agent id of its engine's registration (empty
// while none is registered) and the transports its data path serves.
type Peer struct {
	Name        string   `msgpack:"name"`
	Fingerprint string   `msgpack:"fingerprint,omitempty"`
	AgentID     string   `msgpack:"agent_id,omitempty"`
	Transports  []string `msgpack:"transports,omitempty"`
}

// unmarshal decodes msgpack bytes from another process (an engine, an
// agent) into v, once msgpackcheck found that they hold what they claim:
// msgpack's reflection would allocate whatever length an array claims
// before reading it.
func unmarshal(b []byte, v any) error {
	if err := msgpackcheck.Check(b); err != nil {
		return err
	}
	// A decoder of its own, not msgpack's pool (see transfer/wire's decode).
	return msgpack.NewDecoder(&frameReader{b: b}).Decode(v)
}

// frameReader is the reader unmarshal's decoder reads: a msgpack.Decoder
// reads an io.ByteScanner without buffering ahead, so decodeInts can read
// the bytes of an array of integers where they lie.
type frameReader struct {
	b []byte
	i int
}

func (r *frameReader) Read(p []byte) (int, error) {
	if r.i >= len(r.b) {
		return 0, io.EOF
	}
	n := copy(p, r.b[r.i:])
	r.i += n
	return n, nil
}

func (r *frameReader) ReadByte() (byte, error) {
	if r.i >= len(r.b) {
		return 0, io.EOF
	}
	r.i++
	return r.b[r.i-1], nil
}

func (r *frameReader) UnreadByte() error {
	if r.i == 0 {
		return errors.New("agent: unread at the frame's start")
	}
	r.i--
	return nil
}

// decodeInts decodes an array of msgpack integers (nil: 0), each as the 64
// bits msgpack's DecodeInt64 and DecodeUint64 give it, into T. The lists
// of a send's path (its blocks, its ticket's extents: 512 and 1,539 of
// them for 512 blocks) took 54 and 81 µs through the decoder's reads of
// an element's bytes; from unmarshal's frameReader they are parsed in
// place, as long as they are integers: the room made for them grows with
// what decodes, never to the length the array claims.
func decodeInts[T ~int | ~uint64](d *msgpack.Decoder) ([]T, error) {
	n, err := d.DecodeArrayLen()
	if err != nil || n < 0 {
		return nil, err
	}
	r, inPlace := d.Buffered().(*frameReader)
	if !inPlace {
		out := make([]T, 0, min(n, 1<<12))
		for range n {
			v, err := d.DecodeUint64()
			if err != nil {
				return nil, err
			}
			out = append(out, T(v))
		}
		return out, nil
	}
	b := r.b[r.i:]
	if n > len(b) {
		return nil, fmt.Errorf("agent: an array of %d integers in %d bytes", n, len(b))
	}
	out := make([]T, 0, min(n, 1<<12))
	i := 0
	for range n {
		if i == len(b) {
			return nil, fmt.Errorf("agent: an array of integers: %w", io.ErrUnexpectedEOF)
		}
		size := msgpackcheck.IntSize(b[i])
		if size == 0 {
			return nil, fmt.Errorf("agent: msgpack code %#x in an array of integers", b[i])
		}
		if i+size > len(b) {
			return nil, fmt.Errorf("agent: an array of integers: %w", io.ErrUnexpectedEOF)
		}
		out = append(out, T(intAt(b[i:])))
		i += size
	}
	r.i += i
	return out, nil
}

// intAt reads the msgpack integer (or nil, 0) that b starts with, whole
// (msgpackcheck.IntSize checked): its 64 bits, as msgpack's decoder
// gives them.
func intAt(b []byte) uint64 {
	c, n := b[0], msgpackcheck.IntSize(b[0])-1
	var v uint64
	switch {
	case c <= 0x7f || c >= 0xe0: // fixints
		return uint64(int64(int8(c)))
	case n == 0: // nil
		return 0
	case n == 1:
		v = uint64(b[1])
	case n == 2:
		v = uint64(binary.BigEndian.Uint16(b[1:]))
	case n == 4:
		v = uint64(binary.BigEndian.Uint32(b[1:]))
	default:
		v = binary.BigEndian.Uint64(b[1:])
	}
	if c >= 0xd0 { // signed: sign-extend, as msgpack's decoder does
		shift := 64 - 8*n
		v = uint64(int64(v<<shift) >> shift)
	}
	return v
}

// BlockList is a request's block indices (Request.Blocks), decoded by
// decodeInts.
type BlockList []int

var _ msgpack.CustomDecoder = (*BlockList)(nil)

func (l *BlockList) DecodeMsgpack(d *msgpack.Decoder) (err error) {
	*l, err = decodeInts[int](d)
	return err
}

// writeFrame writes v as one frame.
func writeFrame(w io.Writer, v any) error {
	b, err := msgpack.Marshal(v)
	if err != nil {
		return fmt.Errorf("agent: encode: %w", err)
	}
	if len(b) > MaxFrame {
		return fmt.Errorf("%w: %d bytes", ErrFrameTooLarge, len(b))
	}
	buf := make([]byte, 4+len(b))
	binary.BigEndian.PutUint32(buf, uint32(len(b)))
	copy(buf[4:], b)
	_, err = w.Write(buf)
	return err
}

// readFrame reads one frame's body. A length over MaxFrame is refused
// before anything is allocated.
func readFrame(r io.Reader) ([]byte, error) {
	var h [4]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(h[:])
	if n > MaxFrame {
		return nil, fmt.Errorf("%w: %d bytes", ErrFrameTooLarge, n)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, fmt.Errorf("%w: frame cut short: %w", ErrBadRequest, err)
	}
	return b, nil
}

// decodeRequest decodes a frame's body into a Request.
func decodeRequest(b []byte) (Request, error) {
	var q Request
	if err := unmarshal(b, &q); err != nil {
		return Request{}, fmt.Errorf("%w: %w", ErrBadRequest, err)
	}
	if q.Op == "" {
		return Request{}, fmt.Errorf("%w: no op", ErrBadRequest)
	}
	return q, nil
}

// requestID is the id of a request frame that did not decode as a whole,
// or 0.
func requestID(b []byte) uint64 {
	var q struct {
		ID uint64 `msgpack:"id"`
	}
	if msgpack.Unmarshal(b, &q) != nil {
		return 0
	}
	return q.ID
}

// Planes and Buffers are a request's lists of structs. msgpack's
// reflection makes room for the length an array claims before decoding
// an element, and an element of these takes a byte of frame (an empty
// map) but tens of bytes of memory: a 16 MiB frame of them took 0.5 to
// 0.8 GB to decode. They are refused past a length well above what
// validation allows (2 planes per layer of maxLayers, maxBuffers), so
// that a list a little too long still gets validation's error, and a
// frame no engine would send ends as a malformed one.
type (
	Planes  []Plane
	Buffers []Buffer
)

const (
	maxDecodedPlanes  = 4 * maxLayers // twice a cache's planes at most
	maxDecodedBuffers = 1 << 12
)

var (
	_ msgpack.CustomDecoder = (*Planes)(nil)
	_ msgpack.CustomDecoder = (*Buffers)(nil)
)

func (p *Planes) DecodeMsgpack(d *msgpack.Decoder) error {
	return decodeBounded(d, (*[]Plane)(p), maxDecodedPlanes, func(n int) error {
		return fmt.Errorf("%d planes, more than a request may list (%d)", n, maxDecodedPlanes)
	})
}

func (b *Buffers) DecodeMsgpack(d *msgpack.Decoder) error {
	return decodeBounded(d, (*[]Buffer)(b), maxDecodedBuffers, func(n int) error {
		return fmt.Errorf("%d buffers, more than a request may list (%d)", n, maxDecodedBuffers)
	})
}

// decodeBounded decodes an array into *s, refusing one of more than max
// elements, with tooMany's error, before making room for it.
func decodeBounded[T any](d *msgpack.Decoder, s *[]T, max int, tooMany func(n int) error) error {
	n, err := d.DecodeArrayLen()
	if err != nil || n < 0 {
		*s = nil
		return err
	}
	if n > max {
		return tooMany(n)
	}
	out := make([]T, n)
	for i := range out {
		if err := d.Decode(&out[i]); err != nil {
			return err
		}
	}
	*s = out
	return nil
}

// subTicket is the grant of one source shard.
