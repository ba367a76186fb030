package wire

// Packed slices: a bulk field travels as one msgpack bin of fixed-size
// little-endian items (nil as nil), never as a msgpack array. The integer
// slices share one codec, appendWords and decodeWords, compiled for each
// word type (no call per item); extents packs a struct per item.

import (
	"encoding/binary"
	"fmt"
	"unsafe"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/rdma"
)

// maxPacked bounds one packed field while decoding, so a hostile length prefix
// cannot make the decoder allocate more than any NATS payload could hold.
const maxPacked = 8 << 20

// word is the item of a packed integer slice.
type word interface{ ~int32 | ~uint32 | ~uint64 }

// wordSize is W's packed size, 4 or 8 bytes: its size in memory, known to
// the compiler for each word type.
func wordSize[W word]() int { return int(unsafe.Sizeof(W(0))) }

// appendWords appends s as a bin of little-endian words, or nil when s is
// nil.
func appendWords[W word](b []byte, s []W) []byte {
	if s == nil {
		return appendNil(b)
	}
	size := wordSize[W]()
	b = appendBinLen(b, size*len(s))
	for _, v := range s {
		if size == 4 {
			b = binary.LittleEndian.AppendUint32(b, uint32(v))
		} else {
			b = binary.LittleEndian.AppendUint64(b, uint64(v))
		}
	}
	return b
}

// decodeWords reads a bin of little-endian words into a new slice; nil for
// nil or an error. what names the field in errors.
func decodeWords[S ~[]W, W word](r *reader, what string) (S, error) {
	size := wordSize[W]()
	b, ok, err := r.packed(size, what)
	if err != nil || !ok {
		return nil, err
	}
	out := make(S, len(b)/size)
	for i := range out {
		if size == 4 {
			out[i] = W(binary.LittleEndian.Uint32(b[4*i:]))
		} else {
			out[i] = W(binary.LittleEndian.Uint64(b[8*i:]))
		}
	}
	return out, nil
}

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

// Tokens is a prompt, packed as little-endian int32 on the wire.
type Tokens []int32

func (t Tokens) appendTo(b []byte) []byte { return appendWords(b, t) }

func (t *Tokens) decode(r *reader) (err error) {
	*t, err = decodeWords[Tokens](r, "tokens")
	return err
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (t Tokens) EncodeMsgpack(enc *msgpack.Encoder) error { return encodeWith(enc, t.appendTo) }

// DecodeMsgpack implements msgpack.CustomDecoder.
func (t *Tokens) DecodeMsgpack(dec *msgpack.Decoder) error { return decodeWith(dec, t.decode) }

// extentSize is the packed size of one rdma.Extent: region u32, offset u64, length u64.
const extentSize = 20

// extents is a list of data-plane extents, packed 20 bytes each on the wire.
type extents []rdma.Extent

func (x extents) appendTo(b []byte) []byte {
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

func (x *extents) decode(r *reader) error {
	b, ok, err := r.packed(extentSize, "extents")
	if err != nil || !ok {
		*x = nil
		return err
	}
	out := make(extents, len(b)/extentSize)
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
func (x extents) EncodeMsgpack(enc *msgpack.Encoder) error { return encodeWith(enc, x.appendTo) }

// DecodeMsgpack implements msgpack.CustomDecoder.
func (x *extents) DecodeMsgpack(dec *msgpack.Decoder) error { return decodeWith(dec, x.decode) }

// u64s is a list of uint64, packed little-endian on the wire.
type u64s []uint64

func (u u64s) appendTo(b []byte) []byte { return appendWords(b, u) }

func (u *u64s) decode(r *reader) (err error) {
	*u, err = decodeWords[u64s](r, "u64s")
	return err
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (u u64s) EncodeMsgpack(enc *msgpack.Encoder) error { return encodeWith(enc, u.appendTo) }

// DecodeMsgpack implements msgpack.CustomDecoder.
func (u *u64s) DecodeMsgpack(dec *msgpack.Decoder) error { return decodeWith(dec, u.decode) }

// u32s is a list of uint32, packed little-endian on the wire.
type u32s []uint32

func (u u32s) appendTo(b []byte) []byte { return appendWords(b, u) }

func (u *u32s) decode(r *reader) (err error) {
	*u, err = decodeWords[u32s](r, "u32s")
	return err
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (u u32s) EncodeMsgpack(enc *msgpack.Encoder) error { return encodeWith(enc, u.appendTo) }

// DecodeMsgpack implements msgpack.CustomDecoder.
func (u *u32s) DecodeMsgpack(dec *msgpack.Decoder) error { return decodeWith(dec, u.decode) }
