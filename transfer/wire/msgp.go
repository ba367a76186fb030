package wire

// Byte-level msgpack: the appenders write exactly what msgpack/v5's Encoder
// writes for the same values (compact integers, fixstr/str8/16/32, bin8/16/32,
// float64 as double), and the reader accepts what its Decoder accepts for the
// types we read (any integer code for an integer, str or bin for bytes, nil
// for zero). They work on a []byte with no io.Reader, no reflection and no
// allocation of their own, for the messages on every handoff's path.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/handoff-io/handoff/rdma"

	"github.com/handoff-io/handoff/internal/msgpackcheck"
)

func appendMapLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x80|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xde), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdf), uint32(n))
}

func appendArrayLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xdc), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdd), uint32(n))
}

func appendStr(b []byte, s string) []byte {
	n := len(s)
	switch {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n < 256:
		b = append(b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		b = binary.BigEndian.AppendUint16(append(b, 0xda), uint16(n))
	default:
		b = binary.BigEndian.AppendUint32(append(b, 0xdb), uint32(n))
	}
	return append(b, s...)
}

// appendBinLen writes the header of an n-byte bin.
func appendBinLen(b []byte, n int) []byte {
	switch {
	case n < 256:
		return append(b, 0xc4, byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xc5), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xc6), uint32(n))
}

// appendBin writes p as a bin, or nil when p is nil.
func appendBin(b, p []byte) []byte {
	if p == nil {
		return appendNil(b)
	}
	return append(appendBinLen(b, len(p)), p...)
}

func appendNil(b []byte) []byte { return append(b, 0xc0) }

func appendBool(b []byte, v bool) []byte {
	if v {
		return append(b, 0xc3)
	}
	return append(b, 0xc2)
}

func appendUint(b []byte, v uint64) []byte {
	switch {
	case v <= math.MaxInt8:
		return append(b, byte(v))
	case v <= math.MaxUint8:
		return append(b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(v))
	case v <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xcf), v)
}

func appendInt(b []byte, v int64) []byte {
	switch {
	case v >= 0:
		return appendUint(b, uint64(v))
	case v >= -32:
		return append(b, byte(v))
	case v >= math.MinInt8:
		return append(b, 0xd0, byte(v))
	case v >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(b, 0xd1), uint16(v))
	case v >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(b, 0xd2), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(v))
}

func appendFloat64(b []byte, f float64) []byte {
	return binary.BigEndian.AppendUint64(append(b, 0xcb), math.Float64bits(f))
}

// errTruncated: the message ends inside a value. Decoders wrap every reader
// error in ErrBadMessage.
var errTruncated = errors.New("msgpack: truncated")

// reader decodes msgpack values from b in order. Slices it returns alias b.
type reader struct {
	b []byte
	// peers, when set, decodes a PrefillRequest's peer (see
	// decodePrefillRequest), and desc is that peer's descriptor.
	peers *PeerCache
	desc  *rdma.Descriptor
}

func (r *reader) code() (byte, error) {
	if len(r.b) == 0 {
		return 0, errTruncated
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c, nil
}

func (r *reader) next(n int) ([]byte, error) {
	if n < 0 || n > len(r.b) {
		return nil, errTruncated
	}
	p := r.b[:n:n]
	r.b = r.b[n:]
	return p, nil
}

func (r *reader) u8() (uint64, error) {
	p, err := r.next(1)
	if err != nil {
		return 0, err
	}
	return uint64(p[0]), nil
}

func (r *reader) u16() (uint64, error) {
	p, err := r.next(2)
	if err != nil {
		return 0, err
	}
	return uint64(binary.BigEndian.Uint16(p)), nil
}

func (r *reader) u32() (uint64, error) {
	p, err := r.next(4)
	if err != nil {
		return 0, err
	}
	return uint64(binary.BigEndian.Uint32(p)), nil
}

func (r *reader) u64() (uint64, error) {
	p, err := r.next(8)
	if err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint64(p), nil
}

// int reads any integer (nil is 0), as msgpack's DecodeInt64 does.
func (r *reader) int() (int64, error) {
	c, err := r.code()
	if err != nil {
		return 0, err
	}
	return r.intOf(c)
}

func (r *reader) intOf(c byte) (int64, error) {
	if c <= 0x7f || c >= 0xe0 {
		return int64(int8(c)), nil
	}
	var v uint64
	var err error
	switch c {
	case 0xc0:
		return 0, nil
	case 0xcc:
		v, err = r.u8()
	case 0xd0:
		v, err = r.u8()
		v = uint64(int8(v))
	case 0xcd:
		v, err = r.u16()
	case 0xd1:
		v, err = r.u16()
		v = uint64(int16(v))
	case 0xce:
		v, err = r.u32()
	case 0xd2:
		v, err = r.u32()
		v = uint64(int32(v))
	case 0xcf, 0xd3:
		v, err = r.u64()
	default:
		return 0, fmt.Errorf("msgpack: invalid code=%x decoding int64", c)
	}
	return int64(v), err
}

// uint reads any integer as msgpack's DecodeUint64 does (two's complement
// for a negative one).
func (r *reader) uint() (uint64, error) {
	v, err := r.int()
	return uint64(v), err
}

// uintMax reads an unsigned integer for a narrower field, refusing one
// above max rather than truncating it.
func (r *reader) uintMax(max uint64, what string) (uint64, error) {
	v, err := r.uint()
	if err == nil && v > max {
		err = fmt.Errorf("msgpack: %s %d out of range", what, v)
	}
	return v, err
}

func (r *reader) bool() (bool, error) {
	c, err := r.code()
	if err != nil {
		return false, err
	}
	switch c {
	case 0xc2:
		return false, nil
	case 0xc3:
		return true, nil
	}
	return false, fmt.Errorf("msgpack: invalid code=%x decoding bool", c)
}

func (r *reader) float64() (float64, error) {
	c, err := r.code()
	if err != nil {
		return 0, err
	}
	switch c {
	case 0xca:
		v, err := r.u32()
		return float64(math.Float32frombits(uint32(v))), err
	case 0xcb:
		v, err := r.u64()
		return math.Float64frombits(v), err
	}
	v, err := r.intOf(c)
	if err != nil {
		return 0, fmt.Errorf("msgpack: invalid code=%x decoding float64", c)
	}
	return float64(v), nil
}

// bytesLen reads the header of a str or bin: -1 for nil.
func (r *reader) bytesLen() (int, error) {
	c, err := r.code()
	if err != nil {
		return 0, err
	}
	if c >= 0xa0 && c <= 0xbf {
		return int(c & 0x1f), nil
	}
	var n uint64
	switch c {
	case 0xc0:
		return -1, nil
	case 0xd9, 0xc4:
		n, err = r.u8()
	case 0xda, 0xc5:
		n, err = r.u16()
	case 0xdb, 0xc6:
		n, err = r.u32()
	default:
		return 0, fmt.Errorf("msgpack: invalid code=%x decoding string/bytes length", c)
	}
	return int(n), err
}

// bytes reads a str or bin in place: nil for nil.
func (r *reader) bytes() ([]byte, error) {
	n, err := r.bytesLen()
	if err != nil || n < 0 {
		return nil, err
	}
	return r.next(n)
}

func (r *reader) str() (string, error) {
	p, err := r.bytes()
	if err != nil || len(p) == 0 {
		return "", err
	}
	return string(p), nil
}

// mapLen reads a map header; nil is an empty map.
func (r *reader) mapLen() (int, error) {
	c, err := r.code()
	if err != nil {
		return 0, err
	}
	if c >= 0x80 && c <= 0x8f {
		return int(c & 0x0f), nil
	}
	var n uint64
	switch c {
	case 0xc0:
		return 0, nil
	case 0xde:
		n, err = r.u16()
	case 0xdf:
		n, err = r.u32()
	default:
		return 0, fmt.Errorf("msgpack: invalid code=%x decoding map length", c)
	}
	return int(n), err
}

// arrayLen reads an array header: -1 for nil.
func (r *reader) arrayLen() (int, error) {
	c, err := r.code()
	if err != nil {
		return 0, err
	}
	if c >= 0x90 && c <= 0x9f {
		return int(c & 0x0f), nil
	}
	var n uint64
	switch c {
	case 0xc0:
		return -1, nil
	case 0xdc:
		n, err = r.u16()
	case 0xdd:
		n, err = r.u32()
	default:
		return 0, fmt.Errorf("msgpack: invalid code=%x decoding array length", c)
	}
	return int(n), err
}

// skip passes over one value of any type (msgpackcheck: lengths checked,
// nesting bounded).
func (r *reader) skip() error {
	n, err := msgpackcheck.Size(r.b)
	if err != nil {
		return err
	}
	r.b = r.b[n:]
	return nil
}
