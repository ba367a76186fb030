package transfer

import (
	"encoding/binary"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/rdma"
)

// maxPacked bounds one packed field while decoding, so a hostile length prefix
// cannot make the decoder allocate more than any NATS payload could hold.
const maxPacked = 8 << 20

// Tokens is a prompt, packed as little-endian int32 on the wire.
type Tokens []int32

func (t Tokens) appendTo(b []byte) []byte {
	if t == nil {
		return appendNil(b)
	}
	b = appendBinLen(b, 4*len(t))
	for _, v := range t {
		b = binary.LittleEndian.AppendUint32(b, uint32(v))
	}
	return b
}

func (t *Tokens) decode(r *reader) error {
	b, ok, err := r.packed(4, "tokens")
	if err != nil || !ok {
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

// EncodeMsgpack implements msgpack.CustomEncoder.
func (t Tokens) EncodeMsgpack(enc *msgpack.Encoder) error { return encodeWith(enc, t.appendTo) }

// DecodeMsgpack implements msgpack.CustomDecoder.
func (t *Tokens) DecodeMsgpack(dec *msgpack.Decoder) error { return decodeWith(dec, t.decode) }

// extentSize is the packed size of one rdma.Extent: region u32, offset u64, length u64.
const extentSize = 20

// Extents is a list of data-plane extents, packed 20 bytes each on the wire.
type Extents []rdma.Extent

func (x Extents) appendTo(b []byte) []byte {
	if x == nil {
		return appendNil(b)
	}
	b = appendBinLen(b, extentSize*len(x))
	for _, e := range x {
		b = binary.LittleEndian.AppendUint32(b, uint32(e.Region))
		b = binary.LittleEndian.AppendUint64(b, e.Offset)
		b = binary.LittleEndian.AppendUint64(b, e.Length)
	}
	return b
}

func (x *Extents) decode(r *reader) error {
	b, ok, err := r.packed(extentSize, "extents")
	if err != nil || !ok {
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

// EncodeMsgpack implements msgpack.CustomEncoder.
func (x Extents) EncodeMsgpack(enc *msgpack.Encoder) error { return encodeWith(enc, x.appendTo) }

// DecodeMsgpack implements msgpack.CustomDecoder.
func (x *Extents) DecodeMsgpack(dec *msgpack.Decoder) error { return decodeWith(dec, x.decode) }

// U64s is a list of uint64, packed little-endian on the wire.
type U64s []uint64

func (u U64s) appendTo(b []byte) []byte {
	if u == nil {
		return appendNil(b)
	}
	b = appendBinLen(b, 8*len(u))
	for _, v := range u {
		b = binary.LittleEndian.AppendUint64(b, v)
	}
	return b
}

func (u *U64s) decode(r *reader) error {
	b, ok, err := r.packed(8, "u64s")
	if err != nil || !ok {
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

// EncodeMsgpack implements msgpack.CustomEncoder.
func (u U64s) EncodeMsgpack(enc *msgpack.Encoder) error { return encodeWith(enc, u.appendTo) }

// DecodeMsgpack implements msgpack.CustomDecoder.
func (u *U64s) DecodeMsgpack(dec *msgpack.Decoder) error { return decodeWith(dec, u.decode) }

// U32s is a list of uint32, packed little-endian on the wire.
type U32s []uint32

func (u U32s) appendTo(b []byte) []byte {
	if u == nil {
		return appendNil(b)
	}
	b = appendBinLen(b, 4*len(u))
	for _, v := range u {
		b = binary.LittleEndian.AppendUint32(b, v)
	}
	return b
}

func (u *U32s) decode(r *reader) error {
	b, ok, err := r.packed(4, "u32s")
	if err != nil || !ok {
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

// EncodeMsgpack implements msgpack.CustomEncoder.
func (u U32s) EncodeMsgpack(enc *msgpack.Encoder) error { return encodeWith(enc, u.appendTo) }

// DecodeMsgpack implements msgpack.CustomDecoder.
func (u *U32s) DecodeMsgpack(dec *msgpack.Decoder) error { return decodeWith(dec, u.decode) }

// packed reads a bin of whole elem-byte items in place; ok is false for nil.
func (r *reader) packed(elem int, what string) (b []byte, ok bool, err error) {
	n, err := r.bytesLen()
	if err != nil || n < 0 {
		return nil, false, err
	}
	if n > maxPacked || n%elem != 0 {
		return nil, false, fmt.Errorf("%w: packed %s of %d bytes", ErrBadMessage, what, n)
	}
	b, err = r.next(n)
	return b, err == nil, err
}
