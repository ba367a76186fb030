package transfer

// Every control-plane message of the protocol lives in this file. Messages are
// msgpack maps with explicit short keys and a version field "v"; unknown keys
// are ignored so a later minor revision may add fields. Bulk fields (tokens,
// extents, manifests) travel as packed little-endian byte strings, never as
// msgpack arrays: reflection over thousands of array items costs ~20x more.

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/rdma"
)

// WireVersion is the version every message carries. A receiver refuses other
// versions with ErrBadMessage.
const WireVersion uint8 = 1

// DefaultMaxPayload is NATS's default max_payload (1 MiB). The drivers use the
// connected server's value; this is the fallback.
const DefaultMaxPayload = 1 << 20

// maxPacked bounds one packed field while decoding, so a hostile length prefix
// cannot make the decoder allocate more than any NATS payload could hold.
const maxPacked = 8 << 20

// Tokens is a prompt, packed as little-endian int32 on the wire.
type Tokens []int32

// EncodeMsgpack implements msgpack.CustomEncoder.
func (t Tokens) EncodeMsgpack(enc *msgpack.Encoder) error {
	if t == nil {
		return enc.EncodeNil()
	}
	b, err := packedBuf(enc, 4*len(t))
	if err != nil {
		return err
	}
	for i, v := range t {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(v))
	}
	return packedDone(enc, b)
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (t *Tokens) DecodeMsgpack(dec *msgpack.Decoder) error {
	b, err := decodePacked(dec, 4, "tokens")
	if err != nil || b == nil {
		*t = nil
		return err
	}
	out := make(Tokens, len(b)/4)
	for i := range out {
		out[i] = int32(binary.LittleEndian.Uint32(b[4*i:]))
	}
	*t = out
	return nil
}

// extentSize is the packed size of one rdma.Extent: region u32, offset u64, length u64.
const extentSize = 20

// Extents is a list of data-plane extents, packed 20 bytes each on the wire.
type Extents []rdma.Extent

// EncodeMsgpack implements msgpack.CustomEncoder.
func (x Extents) EncodeMsgpack(enc *msgpack.Encoder) error {
	if x == nil {
		return enc.EncodeNil()
	}
	b, err := packedBuf(enc, extentSize*len(x))
	if err != nil {
		return err
	}
	for i, e := range x {
		o := b[extentSize*i:]
		binary.LittleEndian.PutUint32(o, uint32(e.Region))
		binary.LittleEndian.PutUint64(o[4:], e.Offset)
		binary.LittleEndian.PutUint64(o[12:], e.Length)
	}
	return packedDone(enc, b)
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (x *Extents) DecodeMsgpack(dec *msgpack.Decoder) error {
	b, err := decodePacked(dec, extentSize, "extents")
	if err != nil || b == nil {
		*x = nil
		return err
	}
	out := make(Extents, len(b)/extentSize)
	for i := range out {
		o := b[extentSize*i:]
		out[i] = rdma.Extent{
			Region: rdma.RegionID(binary.LittleEndian.Uint32(o)),
			Offset: binary.LittleEndian.Uint64(o[4:]),
			Length: binary.LittleEndian.Uint64(o[12:]),
		}
	}
	*x = out
	return nil
}

// U64s is a list of uint64, packed little-endian on the wire.
type U64s []uint64

// EncodeMsgpack implements msgpack.CustomEncoder.
func (u U64s) EncodeMsgpack(enc *msgpack.Encoder) error {
	if u == nil {
		return enc.EncodeNil()
	}
	b, err := packedBuf(enc, 8*len(u))
	if err != nil {
		return err
	}
	for i, v := range u {
		binary.LittleEndian.PutUint64(b[8*i:], v)
	}
	return packedDone(enc, b)
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (u *U64s) DecodeMsgpack(dec *msgpack.Decoder) error {
	b, err := decodePacked(dec, 8, "u64s")
	if err != nil || b == nil {
		*u = nil
		return err
	}
	out := make(U64s, len(b)/8)
	for i := range out {
		out[i] = binary.LittleEndian.Uint64(b[8*i:])
	}
	*u = out
	return nil
}

// U32s is a list of uint32, packed little-endian on the wire.
type U32s []uint32

// EncodeMsgpack implements msgpack.CustomEncoder.
func (u U32s) EncodeMsgpack(enc *msgpack.Encoder) error {
	if u == nil {
		return enc.EncodeNil()
	}
	b, err := packedBuf(enc, 4*len(u))
	if err != nil {
		return err
	}
	for i, v := range u {
		binary.LittleEndian.PutUint32(b[4*i:], v)
	}
	return packedDone(enc, b)
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (u *U32s) DecodeMsgpack(dec *msgpack.Decoder) error {
	b, err := decodePacked(dec, 4, "u32s")
	if err != nil || b == nil {
		*u = nil
		return err
	}
	out := make(U32s, len(b)/4)
	for i := range out {
		out[i] = binary.LittleEndian.Uint32(b[4*i:])
	}
	*u = out
	return nil
}

// packedBuf writes the header of an n-byte bin and returns where to put its
// bytes: the spare capacity of the package's own output buffer (filled in
// place), or a new slice when encoding elsewhere. packedDone writes them.
func packedBuf(enc *msgpack.Encoder, n int) ([]byte, error) {
	if err := enc.EncodeBytesLen(n); err != nil {
		return nil, err
	}
	if bw, ok := enc.Writer().(*bytes.Buffer); ok {
		bw.Grow(n)
		return bw.AvailableBuffer()[:n], nil
	}
	return make([]byte, n), nil
}

func packedDone(enc *msgpack.Encoder, b []byte) error {
	_, err := enc.Writer().Write(b)
	return err
}

func decodePacked(dec *msgpack.Decoder, elem int, what string) ([]byte, error) {
	n, err := dec.DecodeBytesLen()
	if err != nil {
		return nil, err
	}
	if n < 0 {
		return nil, nil
	}
	if n > maxPacked || n%elem != 0 {
		return nil, fmt.Errorf("%w: packed %s of %d bytes", ErrBadMessage, what, n)
	}
	b := make([]byte, n)
	if err := dec.ReadFull(b); err != nil {
		return nil, err
	}
	return b, nil
}

// Sampling carries the request's sampling parameters to the prefill worker,
// which samples the first token.
type Sampling struct {
	Temperature float64 `msgpack:"t"`
	Seed        uint64  `msgpack:"s"`
	MaxTokens   int32   `msgpack:"n"`
}

// RegionInfo is the wire form of rdma.RegionDesc.
type RegionInfo struct {
	ID     uint32 `msgpack:"id"`
	Name   string `msgpack:"n"`
	Length uint64 `msgpack:"l"`
}

// Peer is the wire form of an rdma.Descriptor: how to reach an agent's regions.
type Peer struct {
	Agent      string       `msgpack:"a"`
	Host       string       `msgpack:"h"`
	TCPAddr    string       `msgpack:"tcp"`
	ShmAddr    string       `msgpack:"shm"`
	Transports []string     `msgpack:"tr"`
	Regions    []RegionInfo `msgpack:"r"`
}

// PeerOf converts a descriptor to its wire form.
func PeerOf(d rdma.Descriptor) Peer {
	p := Peer{Agent: string(d.Agent), Host: d.Host, TCPAddr: d.TCPAddr, ShmAddr: d.ShmAddr}
	if len(d.Transports) > 0 {
		p.Transports = make([]string, len(d.Transports))
		for i, t := range d.Transports {
			p.Transports[i] = string(t)
		}
	}
	if len(d.Regions) > 0 {
		p.Regions = make([]RegionInfo, len(d.Regions))
		for i, r := range d.Regions {
			p.Regions[i] = RegionInfo{ID: uint32(r.ID), Name: r.Name, Length: r.Length}
		}
	}
	return p
}

// Descriptor converts p back to an rdma.Descriptor.
func (p Peer) Descriptor() rdma.Descriptor {
	d := rdma.Descriptor{Agent: rdma.AgentID(p.Agent), Host: p.Host, TCPAddr: p.TCPAddr, ShmAddr: p.ShmAddr}
	if len(p.Transports) > 0 {
		d.Transports = make([]rdma.Transport, len(p.Transports))
		for i, t := range p.Transports {
			d.Transports[i] = rdma.Transport(t)
		}
	}
	if len(p.Regions) > 0 {
		d.Regions = make([]rdma.RegionDesc, len(p.Regions))
		for i, r := range p.Regions {
			d.Regions[i] = rdma.RegionDesc{ID: rdma.RegionID(r.ID), Name: r.Name, Length: r.Length}
		}
	}
	return d
}

// Ticket is the wire form of an rdma.Ticket: what a writer needs to write into
// a grant.
type Ticket struct {
	Agent     string  `msgpack:"a"`
	Grant     uint64  `msgpack:"g"`
	Epoch     uint64  `msgpack:"e"`
	Token     []byte  `msgpack:"k"`
	RequestID uint64  `msgpack:"id"`
	Extents   Extents `msgpack:"x"`
	Bytes     uint64  `msgpack:"b"`
	Deadline  int64   `msgpack:"dl"` // unix nanoseconds, 0 for none
}

// TicketOf converts an rdma.Ticket to its wire form.
func TicketOf(t rdma.Ticket) Ticket {
	return Ticket{
		Agent: string(t.Agent), Grant: t.Grant, Epoch: t.Epoch, Token: t.Token[:],
		RequestID: t.RequestID, Extents: Extents(t.Extents), Bytes: t.Bytes, Deadline: unixNano(t.Deadline),
	}
}

// RDMA converts w back to an rdma.Ticket. A token that is not 16 bytes is an
// ErrBadMessage.
func (w Ticket) RDMA() (rdma.Ticket, error) {
	t := rdma.Ticket{
		Agent: rdma.AgentID(w.Agent), Grant: w.Grant, Epoch: w.Epoch, RequestID: w.RequestID,
		Extents: []rdma.Extent(w.Extents), Bytes: w.Bytes, Deadline: fromUnixNano(w.Deadline),
	}
	if len(w.Token) != len(t.Token) {
		return rdma.Ticket{}, fmt.Errorf("%w: grant token of %d bytes", ErrBadMessage, len(w.Token))
	}
	copy(t.Token[:], w.Token)
	return t, nil
}

// Manifest is the wire form of an rdma.Manifest: bytes and crc32c per
// destination extent.
type Manifest struct {
	Bytes U64s `msgpack:"b"`
	CRC   U32s `msgpack:"c"`
}

// ManifestOf converts an rdma.Manifest to its wire form.
func ManifestOf(m rdma.Manifest) Manifest { return Manifest{Bytes: U64s(m.Bytes), CRC: U32s(m.CRC)} }

// RDMA converts w back to an rdma.Manifest.
func (w Manifest) RDMA() rdma.Manifest {
	return rdma.Manifest{Bytes: []uint64(w.Bytes), CRC: []uint32(w.CRC)}
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
	Deadline    int64    `msgpack:"dl"`   // unix nanoseconds
	Peer        Peer     `msgpack:"peer"` // the receiver's data-plane descriptor
	Ticket      Ticket   `msgpack:"tk"`
	KVBytes     uint64   `msgpack:"kvb"` // bytes of the ticket's leading KV extents
	MambaBytes  uint64   `msgpack:"mb"`  // bytes of the ticket's trailing Mamba extent
}

// PrefillReply answers a PrefillRequest: success with the first token, or a
// refusal/failure code. Success is sent only after the commit was accepted.
type PrefillReply struct {
	V            uint8    `msgpack:"v"`
	RequestID    uint64   `msgpack:"id"`
	Instance     string   `msgpack:"inst"`
	Code         Code     `msgpack:"code"`
	Msg          string   `msgpack:"msg"`
	FirstToken   int32    `msgpack:"tok"`
	PrefillNanos int64    `msgpack:"pf"`
	WriteNanos   int64    `msgpack:"wr"`
	KVBytes      uint64   `msgpack:"kvb"`
	MambaBytes   uint64   `msgpack:"mb"`
	Manifest     Manifest `msgpack:"man"`
}

// Cancel tells the worker that serves a request to stop and free it. Published
// (no reply) on the instance's cancel subject or on the namespace's.
type Cancel struct {
	V         uint8  `msgpack:"v"`
	RequestID uint64 `msgpack:"id"`
	Grant     uint64 `msgpack:"g"` // the grant of the cancelled attempt; 0 cancels any
	Code      Code   `msgpack:"code"`
	// From is the decode instance that sent the request: request and grant
	// ids are only unique per decoder. Empty (an older sender) matches any.
	From string `msgpack:"from"`
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
}

// Role is a worker's role in the registry.
type Role string

const (
	RolePrefill Role = "prefill"
	RoleDecode  Role = "decode"
)

// EncodePrefillRequest encodes m (stamping the version) and fails with
// ErrPayloadTooLarge when the result exceeds maxPayload (<= 0: DefaultMaxPayload).
func EncodePrefillRequest(m PrefillRequest, maxPayload int64) ([]byte, error) {
	m.V = WireVersion
	return encode(&m, maxPayload, 512+4*len(m.Tokens)+extentSize*len(m.Ticket.Extents))
}

// DecodePrefillRequest decodes and checks a PrefillRequest.
func DecodePrefillRequest(b []byte) (PrefillRequest, error) {
	var m PrefillRequest
	if err := decode(b, &m, &m.V); err != nil {
		return PrefillRequest{}, err
	}
	if m.Ticket.RequestID != m.RequestID {
		return PrefillRequest{}, fmt.Errorf("%w: ticket names request %d, message %d", ErrBadMessage, m.Ticket.RequestID, m.RequestID)
	}
	if len(m.Ticket.Token) != 16 {
		return PrefillRequest{}, fmt.Errorf("%w: grant token of %d bytes", ErrBadMessage, len(m.Ticket.Token))
	}
	var sum uint64
	for _, e := range m.Ticket.Extents {
		sum += e.Length
	}
	if sum != m.Ticket.Bytes || m.KVBytes+m.MambaBytes != sum || m.KVBytes > sum {
		return PrefillRequest{}, fmt.Errorf("%w: extents hold %d bytes, ticket says %d, kv+mamba %d+%d",
			ErrBadMessage, sum, m.Ticket.Bytes, m.KVBytes, m.MambaBytes)
	}
	return m, nil
}

// EncodePrefillReply encodes m (stamping the version).
func EncodePrefillReply(m PrefillReply, maxPayload int64) ([]byte, error) {
	m.V = WireVersion
	return encode(&m, maxPayload, 192+len(m.Msg)+12*len(m.Manifest.Bytes))
}

// DecodePrefillReply decodes and checks a PrefillReply.
func DecodePrefillReply(b []byte) (PrefillReply, error) {
	var m PrefillReply
	if err := decode(b, &m, &m.V); err != nil {
		return PrefillReply{}, err
	}
	if m.Code >= codeCount {
		return PrefillReply{}, fmt.Errorf("%w: unknown code %d", ErrBadMessage, m.Code)
	}
	if len(m.Manifest.Bytes) != len(m.Manifest.CRC) {
		return PrefillReply{}, fmt.Errorf("%w: manifest with %d sizes and %d checksums", ErrBadMessage, len(m.Manifest.Bytes), len(m.Manifest.CRC))
	}
	return m, nil
}

// EncodeCancel encodes m (stamping the version).
func EncodeCancel(m Cancel) ([]byte, error) {
	m.V = WireVersion
	return encode(&m, 0, 64)
}

// DecodeCancel decodes and checks a Cancel.
func DecodeCancel(b []byte) (Cancel, error) {
	var m Cancel
	if err := decode(b, &m, &m.V); err != nil {
		return Cancel{}, err
	}
	if m.Code >= codeCount {
		return Cancel{}, fmt.Errorf("%w: unknown code %d", ErrBadMessage, m.Code)
	}
	return m, nil
}

// EncodeInstance encodes m (stamping the version).
func EncodeInstance(m Instance) ([]byte, error) {
	m.V = WireVersion
	return encode(&m, 0, 512)
}

// DecodeInstance decodes and checks an Instance.
func DecodeInstance(b []byte) (Instance, error) {
	var m Instance
	if err := decode(b, &m, &m.V); err != nil {
		return Instance{}, err
	}
	if m.ID == "" {
		return Instance{}, fmt.Errorf("%w: instance without id", ErrBadMessage)
	}
	if m.Role != RolePrefill && m.Role != RoleDecode {
		return Instance{}, fmt.Errorf("%w: unknown role %q", ErrBadMessage, m.Role)
	}
	return m, nil
}

// encode marshals v into a buffer of sizeHint bytes (grown if needed); the
// result is owned by the caller (it is handed to NATS, which keeps it).
func encode(v any, maxPayload int64, sizeHint int) ([]byte, error) {
	if maxPayload <= 0 {
		maxPayload = DefaultMaxPayload
	}
	buf := bytes.NewBuffer(make([]byte, 0, sizeHint))
	enc := msgpack.GetEncoder()
	enc.Reset(buf)
	err := enc.Encode(v)
	msgpack.PutEncoder(enc)
	if err != nil {
		return nil, fmt.Errorf("transfer: encode: %w", err)
	}
	b := buf.Bytes()
	if int64(len(b)) > maxPayload {
		return nil, fmt.Errorf("%w: %d bytes, max %d", ErrPayloadTooLarge, len(b), maxPayload)
	}
	return b, nil
}

func decode(b []byte, v any, version *uint8) error {
	dec := msgpack.GetDecoder()
	defer msgpack.PutDecoder(dec)
	dec.Reset(bytes.NewReader(b))
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("%w: %w", ErrBadMessage, err)
	}
	if *version != WireVersion {
		return fmt.Errorf("%w: version %d, want %d", ErrBadMessage, *version, WireVersion)
	}
	return nil
}

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

// The two messages on every handoff's path, PrefillRequest and PrefillReply,
// encode and decode by hand instead of by reflection (~4x cheaper). The
// format is the one reflection produces for their tags: a map of the same
// keys; integers are written compactly; unknown keys are skipped.

type encoder struct {
	e   *msgpack.Encoder
	err error
}

func (w *encoder) key(k string) {
	if w.err == nil {
		w.err = w.e.EncodeString(k)
	}
}

func (w *encoder) str(k, v string) {
	w.key(k)
	if w.err == nil {
		w.err = w.e.EncodeString(v)
	}
}

func (w *encoder) uint(k string, v uint64) {
	w.key(k)
	if w.err == nil {
		w.err = w.e.EncodeUint(v)
	}
}

func (w *encoder) int(k string, v int64) {
	w.key(k)
	if w.err == nil {
		w.err = w.e.EncodeInt(v)
	}
}

func (w *encoder) u64s(k string, v U64s) {
	w.key(k)
	if w.err == nil {
		w.err = v.EncodeMsgpack(w.e)
	}
}

func (w *encoder) u32s(k string, v U32s) {
	w.key(k)
	if w.err == nil {
		w.err = v.EncodeMsgpack(w.e)
	}
}

func (w *encoder) tokens(k string, v Tokens) {
	w.key(k)
	if w.err == nil {
		w.err = v.EncodeMsgpack(w.e)
	}
}

func (w *encoder) extents(k string, v Extents) {
	w.key(k)
	if w.err == nil {
		w.err = v.EncodeMsgpack(w.e)
	}
}

// sub encodes a nested message by its method (no interface boxing).
func (w *encoder) sub(k string, enc func(*msgpack.Encoder) error) {
	w.key(k)
	if w.err == nil {
		w.err = enc(w.e)
	}
}

func (w *encoder) mapLen(n int) {
	if w.err == nil {
		w.err = w.e.EncodeMapLen(n)
	}
}

// keys reads map keys into a scratch buffer, so decoding a message does not
// allocate a string per key.
type keys struct{ buf [16]byte }

// mapLen reads a map header; nil counts as an empty map.
func mapLen(dec *msgpack.Decoder) (int, error) {
	n, err := dec.DecodeMapLen()
	return max(n, 0), err
}

// next reads one key. Keys longer than the buffer (unknown to this version)
// come back empty, which no decoder knows, so their value is skipped.
// The slice is valid until the next call.
func (k *keys) next(dec *msgpack.Decoder) ([]byte, error) {
	n, err := dec.DecodeBytesLen()
	if err != nil || n <= 0 {
		return nil, err
	}
	if n > len(k.buf) {
		if n > maxPacked {
			return nil, fmt.Errorf("%w: key of %d bytes", ErrBadMessage, n)
		}
		if err := dec.ReadFull(make([]byte, n)); err != nil {
			return nil, err
		}
		return k.buf[:0], nil // the empty key: unknown to every decoder
	}
	if err := dec.ReadFull(k.buf[:n]); err != nil {
		return nil, err
	}
	return k.buf[:n], nil
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (s Sampling) EncodeMsgpack(enc *msgpack.Encoder) error {
	w := encoder{e: enc}
	w.mapLen(3)
	w.key("t")
	if w.err == nil {
		w.err = enc.EncodeFloat64(s.Temperature)
	}
	w.uint("s", s.Seed)
	w.int("n", int64(s.MaxTokens))
	return w.err
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (s *Sampling) DecodeMsgpack(dec *msgpack.Decoder) error {
	var k keys
	return s.decode(dec, &k)
}

func (s *Sampling) decode(dec *msgpack.Decoder, k *keys) error {
	*s = Sampling{}
	n, err := mapLen(dec)
	for ; err == nil && n > 0; n-- {
		var key []byte
		if key, err = k.next(dec); err != nil {
			break
		}
		switch string(key) {
		case "t":
			s.Temperature, err = dec.DecodeFloat64()
		case "s":
			s.Seed, err = dec.DecodeUint64()
		case "n":
			s.MaxTokens, err = dec.DecodeInt32()
		default:
			err = dec.Skip()
		}
	}
	return err
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (p Peer) EncodeMsgpack(enc *msgpack.Encoder) error {
	w := encoder{e: enc}
	w.mapLen(6)
	w.str("a", p.Agent)
	w.str("h", p.Host)
	w.str("tcp", p.TCPAddr)
	w.str("shm", p.ShmAddr)
	w.key("tr")
	if w.err == nil {
		w.err = encodeStrings(enc, p.Transports)
	}
	w.key("r")
	if w.err == nil && p.Regions == nil {
		w.err = enc.EncodeNil()
	} else if w.err == nil {
		w.err = enc.EncodeArrayLen(len(p.Regions))
		for _, r := range p.Regions {
			w.mapLen(3)
			w.uint("id", uint64(r.ID))
			w.str("n", r.Name)
			w.uint("l", r.Length)
		}
	}
	return w.err
}

func encodeStrings(enc *msgpack.Encoder, ss []string) error {
	if ss == nil {
		return enc.EncodeNil()
	}
	if err := enc.EncodeArrayLen(len(ss)); err != nil {
		return err
	}
	for _, s := range ss {
		if err := enc.EncodeString(s); err != nil {
			return err
		}
	}
	return nil
}

// maxListLen bounds decoded lists of structs and strings (a peer has a
// handful of transports and regions).
const maxListLen = 1024

func decodeListLen(dec *msgpack.Decoder) (int, error) {
	n, err := dec.DecodeArrayLen()
	if err != nil {
		return 0, err
	}
	if n > maxListLen {
		return 0, fmt.Errorf("%w: list of %d items", ErrBadMessage, n)
	}
	return n, nil
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (p *Peer) DecodeMsgpack(dec *msgpack.Decoder) error {
	var k keys
	return p.decode(dec, &k)
}

func (p *Peer) decode(dec *msgpack.Decoder, k *keys) error {
	*p = Peer{}
	n, err := mapLen(dec)
	for ; err == nil && n > 0; n-- {
		var key []byte
		if key, err = k.next(dec); err != nil {
			break
		}
		switch string(key) {
		case "a":
			p.Agent, err = dec.DecodeString()
		case "h":
			p.Host, err = dec.DecodeString()
		case "tcp":
			p.TCPAddr, err = dec.DecodeString()
		case "shm":
			p.ShmAddr, err = dec.DecodeString()
		case "tr":
			p.Transports, err = decodeStrings(dec)
		case "r":
			p.Regions, err = decodeRegions(dec, k)
		default:
			err = dec.Skip()
		}
	}
	return err
}

func decodeStrings(dec *msgpack.Decoder) ([]string, error) {
	n, err := decodeListLen(dec)
	if err != nil || n < 0 {
		return nil, err
	}
	out := make([]string, n)
	for i := range out {
		if out[i], err = dec.DecodeString(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func decodeRegions(dec *msgpack.Decoder, k *keys) ([]RegionInfo, error) {
	n, err := decodeListLen(dec)
	if err != nil || n < 0 {
		return nil, err
	}
	out := make([]RegionInfo, n)
	for i := range out {
		r := &out[i]
		m, err := mapLen(dec)
		for ; err == nil && m > 0; m-- {
			var key []byte
			if key, err = k.next(dec); err != nil {
				break
			}
			switch string(key) {
			case "id":
				r.ID, err = dec.DecodeUint32()
			case "n":
				r.Name, err = dec.DecodeString()
			case "l":
				r.Length, err = dec.DecodeUint64()
			default:
				err = dec.Skip()
			}
		}
		if err != nil {
			return nil, err
		}
	}
	return out, nil
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (t Ticket) EncodeMsgpack(enc *msgpack.Encoder) error {
	w := encoder{e: enc}
	w.mapLen(8)
	w.str("a", t.Agent)
	w.uint("g", t.Grant)
	w.uint("e", t.Epoch)
	w.key("k")
	if w.err == nil {
		w.err = enc.EncodeBytes(t.Token)
	}
	w.uint("id", t.RequestID)
	w.extents("x", t.Extents)
	w.uint("b", t.Bytes)
	w.int("dl", t.Deadline)
	return w.err
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (t *Ticket) DecodeMsgpack(dec *msgpack.Decoder) error {
	var k keys
	return t.decode(dec, &k)
}

func (t *Ticket) decode(dec *msgpack.Decoder, k *keys) error {
	*t = Ticket{}
	n, err := mapLen(dec)
	for ; err == nil && n > 0; n-- {
		var key []byte
		if key, err = k.next(dec); err != nil {
			break
		}
		switch string(key) {
		case "a":
			t.Agent, err = dec.DecodeString()
		case "g":
			t.Grant, err = dec.DecodeUint64()
		case "e":
			t.Epoch, err = dec.DecodeUint64()
		case "k":
			t.Token, err = decodePacked(dec, 1, "token")
		case "id":
			t.RequestID, err = dec.DecodeUint64()
		case "x":
			err = t.Extents.DecodeMsgpack(dec)
		case "b":
			t.Bytes, err = dec.DecodeUint64()
		case "dl":
			t.Deadline, err = dec.DecodeInt64()
		default:
			err = dec.Skip()
		}
	}
	return err
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (m Manifest) EncodeMsgpack(enc *msgpack.Encoder) error {
	w := encoder{e: enc}
	w.mapLen(2)
	w.u64s("b", m.Bytes)
	w.u32s("c", m.CRC)
	return w.err
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (m *Manifest) DecodeMsgpack(dec *msgpack.Decoder) error {
	var k keys
	return m.decode(dec, &k)
}

func (m *Manifest) decode(dec *msgpack.Decoder, k *keys) error {
	*m = Manifest{}
	n, err := mapLen(dec)
	for ; err == nil && n > 0; n-- {
		var key []byte
		if key, err = k.next(dec); err != nil {
			break
		}
		switch string(key) {
		case "b":
			err = m.Bytes.DecodeMsgpack(dec)
		case "c":
			err = m.CRC.DecodeMsgpack(dec)
		default:
			err = dec.Skip()
		}
	}
	return err
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (m *PrefillRequest) EncodeMsgpack(enc *msgpack.Encoder) error {
	w := encoder{e: enc}
	w.mapLen(12)
	w.uint("v", uint64(m.V))
	w.uint("id", m.RequestID)
	w.str("from", m.From)
	w.uint("try", uint64(m.Attempt))
	w.str("fp", m.Fingerprint)
	w.tokens("tok", m.Tokens)
	w.sub("smp", m.Sampling.EncodeMsgpack)
	w.int("dl", m.Deadline)
	w.sub("peer", m.Peer.EncodeMsgpack)
	w.sub("tk", m.Ticket.EncodeMsgpack)
	w.uint("kvb", m.KVBytes)
	w.uint("mb", m.MambaBytes)
	return w.err
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (m *PrefillRequest) DecodeMsgpack(dec *msgpack.Decoder) error {
	*m = PrefillRequest{}
	var k keys
	n, err := mapLen(dec)
	for ; err == nil && n > 0; n-- {
		var key []byte
		if key, err = k.next(dec); err != nil {
			break
		}
		switch string(key) {
		case "v":
			m.V, err = dec.DecodeUint8()
		case "id":
			m.RequestID, err = dec.DecodeUint64()
		case "from":
			m.From, err = dec.DecodeString()
		case "try":
			m.Attempt, err = dec.DecodeUint8()
		case "fp":
			m.Fingerprint, err = dec.DecodeString()
		case "tok":
			err = m.Tokens.DecodeMsgpack(dec)
		case "smp":
			err = m.Sampling.decode(dec, &k)
		case "dl":
			m.Deadline, err = dec.DecodeInt64()
		case "peer":
			err = m.Peer.decode(dec, &k)
		case "tk":
			err = m.Ticket.decode(dec, &k)
		case "kvb":
			m.KVBytes, err = dec.DecodeUint64()
		case "mb":
			m.MambaBytes, err = dec.DecodeUint64()
		default:
			err = dec.Skip()
		}
	}
	return err
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (m *PrefillReply) EncodeMsgpack(enc *msgpack.Encoder) error {
	w := encoder{e: enc}
	w.mapLen(11)
	w.uint("v", uint64(m.V))
	w.uint("id", m.RequestID)
	w.str("inst", m.Instance)
	w.uint("code", uint64(m.Code))
	w.str("msg", m.Msg)
	w.int("tok", int64(m.FirstToken))
	w.int("pf", m.PrefillNanos)
	w.int("wr", m.WriteNanos)
	w.uint("kvb", m.KVBytes)
	w.uint("mb", m.MambaBytes)
	w.sub("man", m.Manifest.EncodeMsgpack)
	return w.err
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (m *PrefillReply) DecodeMsgpack(dec *msgpack.Decoder) error {
	*m = PrefillReply{}
	var k keys
	n, err := mapLen(dec)
	for ; err == nil && n > 0; n-- {
		var key []byte
		if key, err = k.next(dec); err != nil {
			break
		}
		switch string(key) {
		case "v":
			m.V, err = dec.DecodeUint8()
		case "id":
			m.RequestID, err = dec.DecodeUint64()
		case "inst":
			m.Instance, err = dec.DecodeString()
		case "code":
			var c uint16
			c, err = dec.DecodeUint16()
			m.Code = Code(c)
		case "msg":
			m.Msg, err = dec.DecodeString()
		case "tok":
			m.FirstToken, err = dec.DecodeInt32()
		case "pf":
			m.PrefillNanos, err = dec.DecodeInt64()
		case "wr":
			m.WriteNanos, err = dec.DecodeInt64()
		case "kvb":
			m.KVBytes, err = dec.DecodeUint64()
		case "mb":
			m.MambaBytes, err = dec.DecodeUint64()
		case "man":
			err = m.Manifest.decode(dec, &k)
		default:
			err = dec.Skip()
		}
	}
	return err
}
