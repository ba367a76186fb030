package wire

// The two messages on every handoff's path, PrefillRequest and PrefillReply,
// encode and decode by hand, on bytes (msgp.go), instead of by reflection.
// The format is the one reflection produces for their tags: a map of the
// same keys, in field order; integers are written compactly; unknown keys are
// skipped. Their EncodeMsgpack and DecodeMsgpack methods serve reflection
// where they are nested in other messages.

import (
	"slices"

	"errors"
	"fmt"
	"math"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/session"
)

func (s Sampling) appendTo(b []byte) []byte {
	n := 2
	if s.TopP != 0 {
		n++
	}
	if s.Logprobs != 0 {
		n++
	}
	b = appendMapLen(b, n)
	b = appendFloat64(appendStr(b, "t"), s.Temperature)
	b = appendUint(appendStr(b, "s"), s.Seed)
	if s.TopP != 0 {
		b = appendFloat64(appendStr(b, "p"), s.TopP)
	}
	if s.Logprobs != 0 {
		b = appendUint(appendStr(b, "lp"), uint64(s.Logprobs))
	}
	return b
}

func (s *Sampling) decode(r *reader) error {
	*s = Sampling{}
	n, err := r.mapLen()
	for ; err == nil && n > 0; n-- {
		var key []byte
		if key, err = r.bytes(); err != nil {
			break
		}
		switch string(key) {
		case "t":
			s.Temperature, err = r.float64()
		case "s":
			s.Seed, err = r.uint()
		case "p":
			s.TopP, err = r.float64()
		case "lp":
			var v uint64
			v, err = r.uintMax(math.MaxUint8, "logprobs")
			s.Logprobs = uint8(v)
		default:
			err = r.skip()
		}
	}
	return err
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (s Sampling) EncodeMsgpack(enc *msgpack.Encoder) error { return encodeWith(enc, s.appendTo) }

// DecodeMsgpack implements msgpack.CustomDecoder.
func (s *Sampling) DecodeMsgpack(dec *msgpack.Decoder) error { return decodeWith(dec, s.decode) }

func (p *Peer) appendTo(b []byte) []byte {
	n := 6
	if p.IPCNamespace != "" {
		n++
	}
	if len(p.CUDADevices) > 0 {
		n++
	}
	if len(p.UCXAddr) > 0 {
		n++
	}
	if p.Incarnation != 0 {
		n++
	}
	b = appendMapLen(b, n)
	if p.Incarnation != 0 {
		b = appendUint(appendStr(b, "inc"), p.Incarnation)
	}
	if len(p.UCXAddr) > 0 {
		b = appendBin(appendStr(b, "ucx"), p.UCXAddr)
	}
	if p.IPCNamespace != "" {
		b = appendStr(appendStr(b, "ipc"), p.IPCNamespace)
	}
	if len(p.CUDADevices) > 0 {
		b = appendArrayLen(appendStr(b, "cd"), len(p.CUDADevices))
		for _, u := range p.CUDADevices {
			b = appendStr(b, u)
		}
	}
	b = appendStr(appendStr(b, "a"), p.Agent)
	b = appendStr(appendStr(b, "h"), p.Host)
	b = appendStr(appendStr(b, "tcp"), p.TCPAddr)
	b = appendStr(appendStr(b, "shm"), p.ShmAddr)
	b = appendStr(b, "tr")
	if p.Transports == nil {
		b = appendNil(b)
	} else {
		b = appendArrayLen(b, len(p.Transports))
		for _, t := range p.Transports {
			b = appendStr(b, t)
		}
	}
	b = appendStr(b, "r")
	if p.Regions == nil {
		return appendNil(b)
	}
	b = appendArrayLen(b, len(p.Regions))
	for _, r := range p.Regions {
		n := 3
		if r.Memory != "" {
			n++
		}
		if r.Device != "" {
			n++
		}
		b = appendMapLen(b, n)
		b = appendUint(appendStr(b, "id"), uint64(r.ID))
		b = appendStr(appendStr(b, "n"), r.Name)
		b = appendUint(appendStr(b, "l"), r.Length)
		if r.Memory != "" {
			b = appendStr(appendStr(b, "m"), r.Memory)
		}
		if r.Device != "" {
			b = appendStr(appendStr(b, "d"), r.Device)
		}
	}
	return b
}

// maxListLen bounds decoded lists of structs and strings (a peer has a
// handful of transports and regions).
const maxListLen = 1024

func (r *reader) listLen() (int, error) {
	n, err := r.arrayLen()
	if err != nil {
		return 0, err
	}
	if n > maxListLen {
		return 0, fmt.Errorf("%w: list of %d items", ErrBadMessage, n)
	}
	return n, nil
}

func (p *Peer) decode(r *reader) error {
	*p = Peer{}
	var seen uint8
	n, err := r.mapLen()
	for ; err == nil && n > 0; n-- {
		var key []byte
		if key, err = r.bytes(); err != nil {
			break
		}
		switch string(key) {
		case "a":
			p.Agent, err = r.str()
		case "h":
			p.Host, err = r.str()
		case "tcp":
			p.TCPAddr, err = r.str()
		case "shm":
			p.ShmAddr, err = r.str()
		case "tr":
			if err = once(&seen, 2, "tr"); err == nil {
				p.Transports, err = decodeStrings(r)
			}
		case "ipc":
			p.IPCNamespace, err = r.str()
		case "cd":
			if err = once(&seen, 4, "cd"); err == nil {
				p.CUDADevices, err = decodeStrings(r)
			}
		case "ucx":
			var v []byte
			if v, err = r.bytes(); err == nil {
				p.UCXAddr = slices.Clone(v)
			}
		case "inc":
			p.Incarnation, err = r.uint()
		case "r":
			if err = once(&seen, 1, "r"); err == nil {
				p.Regions, err = decodeRegions(r)
			}
		default:
			err = r.skip()
		}
	}
	return err
}

// once refuses a struct-valued key seen before in the same map (bit marks
// it in seen): msgpack's own decoder merges a repeat into the first value,
// which these decoders, which start each struct afresh, would not. A
// peer's lists are refused repeated too: a list of empty strings takes a
// byte of message an item but 16 of memory, and a peer repeating its
// transports filled an 8 MiB request with 150 MB of them.
func once(seen *uint8, bit uint8, key string) error {
	if *seen&bit != 0 {
		return fmt.Errorf("msgpack: repeated key %q", key)
	}
	*seen |= bit
	return nil
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (p Peer) EncodeMsgpack(enc *msgpack.Encoder) error { return encodeWith(enc, p.appendTo) }

// DecodeMsgpack implements msgpack.CustomDecoder.
func (p *Peer) DecodeMsgpack(dec *msgpack.Decoder) error { return decodeWith(dec, p.decode) }

func decodeStrings(r *reader) ([]string, error) {
	n, err := r.listLen()
	if err != nil || n < 0 {
		return nil, err
	}
	out := make([]string, n)
	for i := range out {
		if out[i], err = r.str(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func decodeRegions(r *reader) ([]RegionInfo, error) {
	n, err := r.listLen()
	if err != nil || n < 0 {
		return nil, err
	}
	out := make([]RegionInfo, n)
	for i := range out {
		ri := &out[i]
		m, err := r.mapLen()
		for ; err == nil && m > 0; m-- {
			var key []byte
			if key, err = r.bytes(); err != nil {
				break
			}
			switch string(key) {
			case "id":
				var v uint64
				v, err = r.uint()
				ri.ID = uint32(v)
			case "n":
				ri.Name, err = r.str()
			case "l":
				ri.Length, err = r.uint()
			case "m":
				ri.Memory, err = r.str()
			case "d":
				ri.Device, err = r.str()
			default:
				err = r.skip()
			}
		}
		if err != nil {
			return nil, err
		}
	}
	return out, nil
}

// ticket is an rdma.Ticket's wire form: a map of the keys PrefillRequest's
// Ticket names, in that order.
type ticket rdma.Ticket

func (t *ticket) appendTo(b []byte) []byte {
	b = appendMapLen(b, 8)
	b = appendStr(appendStr(b, "a"), string(t.Agent))
	b = appendUint(appendStr(b, "g"), t.Grant)
	b = appendUint(appendStr(b, "e"), t.Epoch)
	b = appendBin(appendStr(b, "k"), t.Token[:])
	b = appendUint(appendStr(b, "id"), t.RequestID)
	b = extents(t.Extents).appendTo(appendStr(b, "x"))
	b = appendUint(appendStr(b, "b"), t.Bytes)
	return appendInt(appendStr(b, "dl"), unixNano(t.Deadline))
}

// decode reads a ticket; one whose token is not 16 bytes (or absent) is
// refused.
func (t *ticket) decode(r *reader) error {
	*t = ticket{}
	token := -1 // the last token's length; -1: none or nil
	n, err := r.mapLen()
	for ; err == nil && n > 0; n-- {
		var key []byte
		if key, err = r.bytes(); err != nil {
			break
		}
		switch string(key) {
		case "a":
			var a string
			a, err = r.str()
			t.Agent = rdma.AgentID(a)
		case "g":
			t.Grant, err = r.uint()
		case "e":
			t.Epoch, err = r.uint()
		case "k":
			var b []byte
			var ok bool
			b, ok, err = r.packed(1, "token")
			token = -1
			if ok {
				token = len(b)
				copy(t.Token[:], b)
			}
		case "id":
			t.RequestID, err = r.uint()
		case "x":
			err = (*extents)(&t.Extents).decode(r)
		case "b":
			t.Bytes, err = r.uint()
		case "dl":
			var dl int64
			dl, err = r.int()
			t.Deadline = fromUnixNano(dl)
		default:
			err = r.skip()
		}
	}
	if err == nil && token != len(t.Token) {
		err = fmt.Errorf("grant token of %d bytes", max(token, 0))
	}
	return err
}

// manifest is an rdma.Manifest's wire form: a map of the keys
// PrefillReply's Manifest names.
type manifest rdma.Manifest

func (m *manifest) appendTo(b []byte) []byte {
	b = appendMapLen(b, 2)
	b = u64s(m.Bytes).appendTo(appendStr(b, "b"))
	return u32s(m.CRC).appendTo(appendStr(b, "c"))
}

func (m *manifest) decode(r *reader) error {
	*m = manifest{}
	n, err := r.mapLen()
	for ; err == nil && n > 0; n-- {
		var key []byte
		if key, err = r.bytes(); err != nil {
			break
		}
		switch string(key) {
		case "b":
			err = (*u64s)(&m.Bytes).decode(r)
		case "c":
			err = (*u32s)(&m.CRC).decode(r)
		default:
			err = r.skip()
		}
	}
	return err
}

func (m *PrefillRequest) appendTo(b []byte) []byte {
	n := 13
	if m.TP != 0 {
		n++
	}
	if m.Drafts != 0 {
		n++
	}
	if m.Skip != 0 {
		n++
	}
	b = appendMapLen(b, n)
	b = appendUint(appendStr(b, "v"), uint64(m.V))
	b = appendUint(appendStr(b, "id"), m.RequestID)
	b = appendStr(appendStr(b, "from"), m.From)
	b = appendUint(appendStr(b, "try"), uint64(m.Attempt))
	b = appendStr(appendStr(b, "fp"), m.Fingerprint)
	b = m.Tokens.appendTo(appendStr(b, "tok"))
	b = m.Sampling.appendTo(appendStr(b, "smp"))
	b = appendInt(appendStr(b, "dl"), m.Deadline)
	b = m.Peer.appendTo(appendStr(b, "peer"))
	b = (*ticket)(&m.Ticket).appendTo(appendStr(b, "tk"))
	b = appendUint(appendStr(b, "kvb"), m.KVBytes)
	b = appendUint(appendStr(b, "mb"), m.MambaBytes)
	b = appendInt(appendStr(b, "rem"), m.Budget)
	if m.TP != 0 {
		b = appendUint(appendStr(b, "tp"), uint64(m.TP))
	}
	if m.Drafts != 0 {
		b = appendUint(appendStr(b, "nd"), uint64(m.Drafts))
	}
	if m.Skip != 0 {
		b = appendUint(appendStr(b, "skip"), uint64(m.Skip))
	}
	return b
}

func (m *PrefillRequest) decode(r *reader) error {
	*m = PrefillRequest{}
	var seen uint8
	n, err := r.mapLen()
	for ; err == nil && n > 0; n-- {
		var key []byte
		if key, err = r.bytes(); err != nil {
			break
		}
		var v uint64
		switch string(key) {
		case "v":
			v, err = r.uintMax(math.MaxUint8, "version")
			m.V = uint8(v)
		case "id":
			m.RequestID, err = r.uint()
		case "from":
			m.From, err = r.str()
		case "try":
			v, err = r.uintMax(math.MaxUint8, "attempt")
			m.Attempt = uint8(v)
		case "fp":
			m.Fingerprint, err = r.str()
		case "tok":
			err = m.Tokens.decode(r)
		case "smp":
			if err = once(&seen, 1, "smp"); err == nil {
				err = m.Sampling.decode(r)
			}
		case "dl":
			m.Deadline, err = r.int()
		case "peer":
			if err = once(&seen, 2, "peer"); err != nil {
				break
			}
			if r.peers != nil {
				err = r.peers.decode(r, &m.Peer)
			} else {
				err = m.Peer.decode(r)
			}
		case "tk":
			if err = once(&seen, 4, "tk"); err == nil {
				err = (*ticket)(&m.Ticket).decode(r)
			}
		case "kvb":
			m.KVBytes, err = r.uint()
		case "mb":
			m.MambaBytes, err = r.uint()
		case "rem":
			m.Budget, err = r.int()
		case "tp":
			v, err = r.uintMax(math.MaxUint16, "tp")
			m.TP = uint16(v)
		case "nd":
			v, err = r.uintMax(MaxDrafts, "drafts")
			m.Drafts = uint8(v)
		case "skip":
			v, err = r.uintMax(math.MaxUint32, "skip")
			m.Skip = uint32(v)
		default:
			err = r.skip()
		}
	}
	if err == nil && seen&4 == 0 {
		err = errors.New("request without a ticket")
	}
	return err
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (m *PrefillRequest) EncodeMsgpack(enc *msgpack.Encoder) error {
	return encodeWith(enc, m.appendTo)
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (m *PrefillRequest) DecodeMsgpack(dec *msgpack.Decoder) error {
	return decodeWith(dec, m.decode)
}

func (m *PrefillReply) appendTo(b []byte) []byte {
	n := 9
	if len(m.Logprobs) > 0 {
		n++
	}
	if m.Cached > 0 {
		n++
	}
	if len(m.Drafts) > 0 {
		n++
	}
	if m.TooLong {
		n++
	}
	b = appendMapLen(b, n)
	b = appendUint(appendStr(b, "v"), uint64(m.V))
	b = appendUint(appendStr(b, "id"), m.RequestID)
	b = appendStr(appendStr(b, "inst"), m.Instance)
	b = appendUint(appendStr(b, "code"), uint64(m.Code))
	b = appendStr(appendStr(b, "msg"), m.Msg)
	b = appendInt(appendStr(b, "tok"), int64(m.FirstToken))
	b = appendInt(appendStr(b, "pf"), m.PrefillNanos)
	b = appendInt(appendStr(b, "wr"), m.WriteNanos)
	b = (*manifest)(&m.Manifest).appendTo(appendStr(b, "man"))
	if len(m.Logprobs) > 0 {
		b = appendBin(appendStr(b, "lp"), m.Logprobs)
	}
	if m.Cached > 0 {
		b = appendUint(appendStr(b, "cached"), uint64(m.Cached))
	}
	if len(m.Drafts) > 0 {
		b = m.Drafts.appendTo(appendStr(b, "dr"))
	}
	if m.TooLong {
		b = appendBool(appendStr(b, "long"), true)
	}
	return b
}

func (m *PrefillReply) decode(r *reader) error {
	*m = PrefillReply{}
	var seen uint8
	n, err := r.mapLen()
	for ; err == nil && n > 0; n-- {
		var key []byte
		if key, err = r.bytes(); err != nil {
			break
		}
		var v uint64
		var i int64
		switch string(key) {
		case "v":
			v, err = r.uintMax(math.MaxUint8, "version")
			m.V = uint8(v)
		case "id":
			m.RequestID, err = r.uint()
		case "inst":
			m.Instance, err = r.str()
		case "code":
			v, err = r.uintMax(math.MaxUint16, "code")
			m.Code = session.Code(v)
		case "msg":
			m.Msg, err = r.str()
		case "tok":
			i, err = r.int()
			m.FirstToken = int32(i)
		case "pf":
			m.PrefillNanos, err = r.int()
		case "wr":
			m.WriteNanos, err = r.int()
		case "man":
			if err = once(&seen, 1, "man"); err == nil {
				err = (*manifest)(&m.Manifest).decode(r)
			}
		case "lp":
			var p []byte
			if p, err = r.bytes(); err == nil && len(p) > 0 {
				m.Logprobs = append([]byte(nil), p...)
			}
		case "cached":
			v, err = r.uintMax(math.MaxUint32, "cached tokens")
			m.Cached = uint32(v)
		case "dr":
			if err = m.Drafts.decode(r); err == nil && len(m.Drafts) == 0 {
				m.Drafts = nil
			}
		case "long":
			m.TooLong, err = r.bool()
		default:
			err = r.skip()
		}
	}
	return err
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (m *PrefillReply) EncodeMsgpack(enc *msgpack.Encoder) error {
	return encodeWith(enc, m.appendTo)
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (m *PrefillReply) DecodeMsgpack(dec *msgpack.Decoder) error {
	return decodeWith(dec, m.decode)
}
