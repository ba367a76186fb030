// Package msgpackcheck measures msgpack values without decoding them: how
// many bytes the first value of a message takes, refusing one whose
// lengths claim more than its bytes hold or that nests too deep.
//
// Decoders of untrusted bytes run it first. msgpack's reflection (version
// 5.4.1 of vmihailenco/msgpack) allocates a slice of the length an array
// claims before reading an element of it, and its Skip recurses without a
// bound: a few bytes claiming 2^28 elements, or a few MiB nested a million
// deep, would take a process's memory or its stack. Size allocates nothing
// and reads every byte at most once.
package msgpackcheck

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// MaxDepth bounds the nesting of arrays and maps.
const MaxDepth = 32

// ErrTruncated: the message ends inside a value, or a length claims more
// bytes (or elements, each a byte at least) than follow.
var ErrTruncated = errors.New("msgpack: truncated")

// Size returns how many bytes the msgpack value at the start of b takes.
func Size(b []byte) (int, error) {
	r := reader{b: b}
	if err := r.skip(0); err != nil {
		return 0, err
	}
	return len(b) - len(r.b), nil
}

// Check reports whether b starts with a msgpack value that its bytes hold.
func Check(b []byte) error {
	_, err := Size(b)
	return err
}

type reader struct{ b []byte }

func (r *reader) code() (byte, error) {
	if len(r.b) == 0 {
		return 0, ErrTruncated
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c, nil
}

func (r *reader) next(n uint64) error {
	if n > uint64(len(r.b)) {
		return ErrTruncated
	}
	r.b = r.b[n:]
	return nil
}

// uint reads a big-endian length of size bytes.
func (r *reader) uint(size int) (uint64, error) {
	if len(r.b) < size {
		return 0, ErrTruncated
	}
	var n uint64
	switch size {
	case 1:
		n = uint64(r.b[0])
	case 2:
		n = uint64(binary.BigEndian.Uint16(r.b))
	case 4:
		n = uint64(binary.BigEndian.Uint32(r.b))
	}
	r.b = r.b[size:]
	return n, nil
}

// skip passes over one value nested depth deep.
func (r *reader) skip(depth int) error {
	c, err := r.code()
	if err != nil {
		return err
	}
	switch {
	case c <= 0x7f || c >= 0xe0: // positive and negative fixint
		return nil
	case c <= 0x8f: // fixmap
		return r.skipN(2*uint64(c&0x0f), depth)
	case c <= 0x9f: // fixarray
		return r.skipN(uint64(c&0x0f), depth)
	case c <= 0xbf: // fixstr
		return r.next(uint64(c & 0x1f))
	}
	switch c {
	case 0xc0, 0xc2, 0xc3: // nil, false, true
		return nil
	case 0xcc, 0xd0:
		return r.next(1)
	case 0xcd, 0xd1:
		return r.next(2)
	case 0xce, 0xd2, 0xca:
		return r.next(4)
	case 0xcf, 0xd3, 0xcb:
		return r.next(8)
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1, 2, 4, 8, 16 and a type byte
		return r.next(1 + 1<<(c-0xd4))
	}
	var size int     // bytes of the length
	var extra uint64 // bytes after the length beyond it (an extension's type)
	var items uint64 // values per unit of length (arrays 1, maps 2); 0: bytes
	switch c {
	case 0xc4, 0xd9: // bin8, str8
		size = 1
	case 0xc5, 0xda:
		size = 2
	case 0xc6, 0xdb:
		size = 4
	case 0xc7: // ext8, ext16, ext32
		size, extra = 1, 1
	case 0xc8:
		size, extra = 2, 1
	case 0xc9:
		size, extra = 4, 1
	case 0xdc: // array16, array32
		size, items = 2, 1
	case 0xdd:
		size, items = 4, 1
	case 0xde: // map16, map32
		size, items = 2, 2
	case 0xdf:
		size, items = 4, 2
	default:
		return fmt.Errorf("msgpack: invalid code %#x", c)
	}
	n, err := r.uint(size)
	if err != nil {
		return err
	}
	if items > 0 {
		return r.skipN(items*n, depth)
	}
	return r.next(n + extra)
}

// IntSize is the size in bytes of the msgpack integer (or nil) whose code
// is c; 0 for any other code.
func IntSize(c byte) int {
	switch {
	case c <= 0x7f || c >= 0xe0 || c == 0xc0: // fixints, nil
		return 1
	case c >= 0xcc && c <= 0xd3: // uint8..64, int8..64
		return 1 + 1<<((c-0xcc)&3)
	}
	return 0
}

// skipN skips n values nested one level deeper than depth.
func (r *reader) skipN(n uint64, depth int) error {
	if depth >= MaxDepth {
		return fmt.Errorf("msgpack: nested deeper than %d", MaxDepth)
	}
	if n > uint64(len(r.b)) {
		return ErrTruncated // each value takes a byte at least
	}
	for ; n > 0; n-- {
		// Integers, the bulk of long arrays (a ticket's extents, a
		// request's blocks), without a call each.
		if len(r.b) == 0 {
			return ErrTruncated
		}
		if size := IntSize(r.b[0]); size > 0 {
			if err := r.next(uint64(size)); err != nil {
				return err
			}
			continue
		}
		if err := r.skip(depth + 1); err != nil {
			return err
		}
	}
	return nil
}
