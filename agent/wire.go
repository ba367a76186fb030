package agent

// The local API's messages and framing, and the ticket's encoding. Each
// message is a msgpack map in a frame: a 4-byte big-endian length, then the
// map. The engine sends requests (Op, ID); the agent answers each with one
// reply (Re = the request's ID, Err when it failed) and sends events (Ev)
// whenever a grant or a send ends. No IO here but io.Reader/io.Writer.

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/internal/msgpackcheck"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/reshard"
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
	OpRegister  = "register"   // Layout, KVBytes, MambaBytes (or Buffers), the fds by SCM_RIGHTS (kv first) -> Fingerprint, AgentID
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

// CUDAMemory names a pool or buffer in device memory: the CUDA IPC handle
// of the allocation it lies in (cuIpcGetMemHandle; what torch's
// storage._share_cuda_() returns as its handle), its byte offset in that
// allocation (_share_cuda_'s storage offset), and the device's UUID as
// nvidia-smi prints it ("GPU-…").
type CUDAMemory struct {
	Handle []byte `msgpack:"handle"`
	Offset uint64 `msgpack:"offset"`
	Device string `msgpack:"device"`
}

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
// place. A length is only a claim: one longer than the bytes left is
// refused before anything is allocated.
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
	out := make([]T, n)
	i := 0
	for k := range out {
		if i == len(b) {
			return nil, fmt.Errorf("agent: an array of integers: %w", io.ErrUnexpectedEOF)
		}
		c := b[i]
		i++
		size := 0
		switch {
		case c <= 0x7f || c >= 0xe0: // fixints
			out[k] = T(uint64(int64(int8(c))))
			continue
		case c == 0xc0: // nil
			continue
		case c == 0xcc || c == 0xd0:
			size = 1
		case c == 0xcd || c == 0xd1:
			size = 2
		case c == 0xce || c == 0xd2:
			size = 4
		case c == 0xcf || c == 0xd3:
			size = 8
		default:
			return nil, fmt.Errorf("agent: msgpack code %#x in an array of integers", c)
		}
		if len(b)-i < size {
			return nil, fmt.Errorf("agent: an array of integers: %w", io.ErrUnexpectedEOF)
		}
		var v uint64
		switch size {
		case 1:
			v = uint64(b[i])
		case 2:
			v = uint64(binary.BigEndian.Uint16(b[i:]))
		case 4:
			v = uint64(binary.BigEndian.Uint32(b[i:]))
		default:
			v = binary.BigEndian.Uint64(b[i:])
		}
		if c >= 0xd0 { // signed: sign-extend, as msgpack's decoder does
			shift := 64 - 8*size
			v = uint64(int64(v<<shift) >> shift)
		}
		out[k] = T(v)
		i += size
	}
	r.i += i
	return out, nil
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

// A ticket's version says how its extents are listed. Version 1 lists
// them in block order. Version 2 lists the KV pieces plane by plane
// (plans.planeMajor): a receiver with KV planes grants so. Version 3 is
// version 2 with the planes' extents folded (fold): one shape of extents
// and each plane's base, so a ticket naming thousands of scattered
// blocks of a many-layer model stays kilobytes, not megabytes. A sender
// that predates a version refuses it by name rather than writing in
// another order.
const (
	ticketPlaneMajor = 2
	ticketFolded     = 3
)

// foldFrom is the fewest extents a ticket folds: fewer fit a frame and an
// offer many times over as they are, and stay version 2, which senders
// that predate folding take.
const foldFrom = 1024

// ticket is what a receiving agent hands its engine for the senders: one
// rdma ticket per source shard that writes into this destination shard
// (reshard.go), the receiver's descriptor (so a sender needs no lookup),
// and what a sender checks before it writes a byte: the layout
// fingerprint, dtypes, both TP sizes, and how many blocks and whether a
// row.
type ticket struct {
	V           int        `msgpack:"v"`
	Agent       string     `msgpack:"agent"` // the agent's name (its rdma AgentID names one registration)
	Fingerprint string     `msgpack:"fp"`
	DTypes      string     `msgpack:"dtypes"`
	FromTP      int        `msgpack:"from_tp"`
	ToTP        int        `msgpack:"to_tp"`
	ToRank      int        `msgpack:"to_rank"`
	Blocks      int        `msgpack:"blocks"`
	Row         bool       `msgpack:"row"`
	Desc        []byte     `msgpack:"desc"` // rdma.Descriptor, JSON
	Subs        subTickets `msgpack:"subs"`
}

// subTickets are a ticket's grants, one per source shard: at most
// reshard.MaxTP, refused past that as they are decoded (msgpack's
// reflection would make room for any length a ticket claims, a few bytes
// of it per element).
type subTickets []subTicket

var _ msgpack.CustomDecoder = (*subTickets)(nil)

func (s *subTickets) DecodeMsgpack(d *msgpack.Decoder) error {
	return decodeBounded(d, (*[]subTicket)(s), reshard.MaxTP, func(n int) error {
		return fmt.Errorf("%d grants, more than TP %d has shards", n, reshard.MaxTP)
	})
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
type subTicket struct {
	Shard  int        `msgpack:"shard"`
	Ticket wireTicket `msgpack:"ticket"`
}

// wireTicket is an rdma.Ticket in msgpack: extents as flat (region,
// offset, length) triples, the deadline in Unix nanoseconds, so a ticket
// of thousands of extents decodes in microseconds. In a version-3 ticket
// the extents may begin with folded ones (fold): for each (region,
// offset) pair of Bases, each (offset, length) pair of Shape, at that
// offset from the base; Extents lists the rest.
type wireTicket struct {
	Agent     string `msgpack:"agent"`
	Grant     uint64 `msgpack:"grant"`
	Epoch     uint64 `msgpack:"epoch"`
	Token     []byte `msgpack:"token"`
	RequestID uint64 `msgpack:"request_id"`
	Shape     words  `msgpack:"shape,omitempty"`
	Bases     words  `msgpack:"bases,omitempty"`
	Extents   words  `msgpack:"extents"`
	Bytes     uint64 `msgpack:"bytes"`
	Deadline  int64  `msgpack:"deadline"`
}

// words is a msgpack array of unsigned integers, decoded without
// reflection (decodeInts): a ticket of a 512-block send carries 1,539 of
// them, on the send's path.
type words []uint64

var (
	_ msgpack.CustomEncoder = words(nil)
	_ msgpack.CustomDecoder = (*words)(nil)
)

// EncodeMsgpack writes each word in the fewest bytes that hold it
// (msgpack's default writes every uint64 in nine): a ticket's regions,
// lengths and offsets mostly fit in one to five.
func (w words) EncodeMsgpack(e *msgpack.Encoder) error {
	if err := e.EncodeArrayLen(len(w)); err != nil {
		return err
	}
	for _, v := range w {
		if err := e.EncodeUint(v); err != nil {
			return err
		}
	}
	return nil
}

func (w *words) DecodeMsgpack(d *msgpack.Decoder) (err error) {
	*w, err = decodeInts[uint64](d)
	return err
}

// toWire renders t, its leading extents folded in groups of g where they
// repeat one shape (fold; g 0 folds nothing). It says whether it folded.
func toWire(t rdma.Ticket, g int) (wireTicket, bool) {
	w := wireTicket{Agent: string(t.Agent), Grant: t.Grant, Epoch: t.Epoch, Token: t.Token[:], RequestID: t.RequestID, Bytes: t.Bytes}
	if !t.Deadline.IsZero() {
		w.Deadline = t.Deadline.UnixNano()
	}
	var rest []rdma.Extent
	w.Shape, w.Bases, rest = fold(t.Extents, g)
	w.Extents = make([]uint64, 0, 3*len(rest))
	for _, e := range rest {
		w.Extents = append(w.Extents, uint64(e.Region), e.Offset, e.Length)
	}
	return w, len(w.Bases) > 0
}

// fold finds the leading groups of g extents of es that repeat one shape:
// each group's extents in one region, at the same offsets from the
// group's lowest and of the same lengths. A plane-major ticket's groups
// are its planes, whose blocks a receiver lists alike. It returns the
// shape as (offset, length) pairs, each group's (region, lowest offset),
// and the extents after the groups; nothing folded unless two groups
// repeat.
func fold(es []rdma.Extent, g int) (shape, bases []uint64, rest []rdma.Extent) {
	if g < 1 || len(es) < 2*g {
		return nil, nil, es
	}
	lowest := func(grp []rdma.Extent) (uint64, bool) {
		lo := grp[0].Offset
		for _, e := range grp {
			if e.Region != grp[0].Region {
				return 0, false
			}
			lo = min(lo, e.Offset)
		}
		return lo, true
	}
	lo, ok := lowest(es[:g])
	if !ok {
		return nil, nil, es
	}
	shape = make([]uint64, 0, 2*g)
	for _, e := range es[:g] {
		shape = append(shape, e.Offset-lo, e.Length)
	}
	m := 0
	for ; (m+1)*g <= len(es); m++ {
		grp := es[m*g : (m+1)*g]
		lo, ok := lowest(grp)
		for i := 0; ok && i < g; i++ {
			ok = grp[i].Offset-lo == shape[2*i] && grp[i].Length == shape[2*i+1]
		}
		if !ok {
			break
		}
		bases = append(bases, uint64(grp[0].Region), lo)
	}
	if m < 2 {
		return nil, nil, es
	}
	return shape, bases, es[m*g:]
}

// ticket unfolds w into the rdma ticket it renders, refusing one of more
// than most extents before it makes room for them: a few bytes of shape
// and bases can claim millions.
func (w wireTicket) ticket(most int) (rdma.Ticket, error) {
	if len(w.Token) != 16 || len(w.Extents)%3 != 0 || len(w.Shape)%2 != 0 || len(w.Bases)%2 != 0 || (len(w.Shape) == 0) != (len(w.Bases) == 0) {
		return rdma.Ticket{}, fmt.Errorf("%w: token of %d bytes, %d extent words, %d shape words, %d base words", ErrBadTicket, len(w.Token), len(w.Extents), len(w.Shape), len(w.Bases))
	}
	n := len(w.Bases)/2*(len(w.Shape)/2) + len(w.Extents)/3
	if n > most {
		return rdma.Ticket{}, fmt.Errorf("%w: %d extents, at most %d", ErrBadTicket, n, most)
	}
	t := rdma.Ticket{Agent: rdma.AgentID(w.Agent), Grant: w.Grant, Epoch: w.Epoch, RequestID: w.RequestID, Bytes: w.Bytes,
		Extents: make([]rdma.Extent, 0, n)}
	copy(t.Token[:], w.Token)
	if w.Deadline != 0 {
		t.Deadline = time.Unix(0, w.Deadline)
	}
	for i := 0; i < len(w.Bases); i += 2 {
		if w.Bases[i] > math.MaxUint32 {
			return rdma.Ticket{}, fmt.Errorf("%w: region %d", ErrBadTicket, w.Bases[i])
		}
		for j := 0; j < len(w.Shape); j += 2 {
			off := w.Bases[i+1] + w.Shape[j]
			if off < w.Bases[i+1] {
				return rdma.Ticket{}, fmt.Errorf("%w: base %d plus offset %d overflows", ErrBadTicket, w.Bases[i+1], w.Shape[j])
			}
			t.Extents = append(t.Extents, rdma.Extent{Region: rdma.RegionID(w.Bases[i]), Offset: off, Length: w.Shape[j+1]})
		}
	}
	for i := 0; i < len(w.Extents); i += 3 {
		if w.Extents[i] > math.MaxUint32 {
			return rdma.Ticket{}, fmt.Errorf("%w: region %d", ErrBadTicket, w.Extents[i])
		}
		t.Extents = append(t.Extents, rdma.Extent{Region: rdma.RegionID(w.Extents[i]), Offset: w.Extents[i+1], Length: w.Extents[i+2]})
	}
	return t, nil
}

// encodeTicket renders a ticket as the bytes the engine carries: subs[i]
// is the rdma ticket of source shard shards[i], its extents folded in
// groups of groups[i] (fold) where t is plane-major and they are many
// (foldFrom), which makes it a version-3 ticket.
func encodeTicket(t ticket, d rdma.Descriptor, shards []int, subs []rdma.Ticket, groups []int) ([]byte, error) {
	var err error
	if t.Desc, err = json.Marshal(d); err != nil {
		return nil, fmt.Errorf("agent: encode descriptor: %w", err)
	}
	for i, rt := range subs {
		g := 0
		if (t.V == ticketPlaneMajor || t.V == ticketFolded) && len(rt.Extents) >= foldFrom {
			g = groups[i]
		}
		w, folded := toWire(rt, g)
		if folded {
			t.V = ticketFolded
		}
		t.Subs = append(t.Subs, subTicket{Shard: shards[i], Ticket: w})
	}
	return msgpack.Marshal(t)
}

// decodeTicket parses ticket bytes and returns the rdma ticket of source
// shard rank, still folded (nil when that shard writes nothing into it;
// wireTicket.ticket unfolds it). It checks the shape (version, TP sizes
// and ranks, each rdma ticket in the descriptor's agent), not the layout:
// the sender does that.
func decodeTicket(b []byte, rank int) (t ticket, d rdma.Descriptor, sub *wireTicket, err error) {
	fail := func(format string, args ...any) (ticket, rdma.Descriptor, *wireTicket, error) {
		return ticket{}, rdma.Descriptor{}, nil, fmt.Errorf("%w: "+format, append([]any{ErrBadTicket}, args...)...)
	}
	if err := unmarshal(b, &t); err != nil {
		return fail("%v", err)
	}
	switch {
	case t.V < 1 || t.V > ticketFolded:
		return fail("version %d", t.V)
	case t.FromTP < 1 || t.FromTP > reshard.MaxTP || t.ToTP < 1 || t.ToTP > reshard.MaxTP || t.ToRank < 0 || t.ToRank >= t.ToTP:
		return fail("TP %d → rank %d of %d", t.FromTP, t.ToRank, t.ToTP)
	case t.Blocks < 0 || (t.Blocks == 0 && !t.Row):
		return fail("%d blocks and row %v", t.Blocks, t.Row)
	case len(t.Subs) == 0 || len(t.Subs) > t.FromTP:
		return fail("%d grants for TP-%d senders", len(t.Subs), t.FromTP)
	}
	if err := json.Unmarshal(t.Desc, &d); err != nil {
		return fail("descriptor: %v", err)
	}
	seen := map[int]bool{}
	for i, s := range t.Subs {
		if s.Shard < 0 || s.Shard >= t.FromTP || seen[s.Shard] {
			return fail("a grant for source shard %d of %d", s.Shard, t.FromTP)
		}
		seen[s.Shard] = true
		if t.V != ticketFolded && len(s.Ticket.Shape)+len(s.Ticket.Bases) > 0 {
			return fail("folded extents in a version-%d ticket", t.V)
		}
		if s.Shard != rank {
			continue
		}
		if s.Ticket.Agent != string(d.Agent) {
			return fail("ticket of agent %q with the descriptor of %q", s.Ticket.Agent, d.Agent)
		}
		sub = &t.Subs[i].Ticket
	}
	return t, d, sub, nil
}
