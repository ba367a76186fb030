package rdma

import (
	"encoding/binary"
	"fmt"
	"math"
)

// Frame format (all integers little-endian). Every frame starts with a fixed
// 64-byte header; a payload of header.length bytes follows.
//
//	off size field
//	0   4    magic "HOF1"
//	4   1    type (hello, data, commit, reply, abort, flush)
//	5   1    flags: commit may set flagNoCRC; otherwise 0
//	6   2    reserved, must be 0
//	8   4    index: data = destination extent index, commit = extent count,
//	         reply and abort = status code, hello = protocol version
//	12  4    reserved, must be 0
//	16  8    grant id
//	24  8    epoch
//	32  16   token
//	48  8    offset: data = byte offset inside the destination extent; else 0
//	56  8    length of the payload that follows
//
// Payloads: data = the bytes to land; commit = count entries of
// (bytes u64, crc32c u32); reply and abort = a UTF-8 message; hello =
// "from\nto" agent ids (a tcp receiver's answer adds a third line: the
// optional frames it accepts, space-separated, e.g. "flush"; the shm hello
// answer adds the slot table layout).
// An abort is a writer giving up a grant it holds the token of: the receiver
// fails the grant with the status code as the reason. A flush (no payload)
// ends one lane of a write striped over several connections: the receiver
// replies once every earlier frame of the connection has landed, and the
// writer commits on another lane after all flushes were answered.
const (
	frameMagic      = 0x31464f48 // "HOF1"
	headerSize      = 64
	protocolVersion = 1

	frameHello  = 1
	frameData   = 2
	frameCommit = 3
	frameReply  = 4
	frameAbort  = 5
	frameFlush  = 6
	framePull   = 7 // cuda-ipc: the receiver copies from the writer's exported allocation (pull.go)

	// flagNoCRC marks a commit whose manifest carries byte counts only
	// (a writer configured with SkipCRC).
	flagNoCRC = 1

	// maxDataLen bounds one data frame; larger pieces are split by the writer.
	maxDataLen = 1 << 40
	// maxMsgLen bounds reply messages and hello agent ids.
	maxMsgLen         = 1024
	manifestEntrySize = 12
)

// header is a decoded frame header.
type header struct {
	typ    uint8
	flags  uint8
	index  uint32
	grant  uint64
	epoch  uint64
	token  [16]byte
	offset uint64
	length uint64
}

// put encodes h into b[:headerSize].
func (h *header) put(b []byte) {
	_ = b[headerSize-1]
	binary.LittleEndian.PutUint32(b[0:], frameMagic)
	b[4] = h.typ
	b[5], b[6], b[7] = h.flags, 0, 0
	binary.LittleEndian.PutUint32(b[8:], h.index)
	binary.LittleEndian.PutUint32(b[12:], 0)
	binary.LittleEndian.PutUint64(b[16:], h.grant)
	binary.LittleEndian.PutUint64(b[24:], h.epoch)
	copy(b[32:48], h.token[:])
	binary.LittleEndian.PutUint64(b[48:], h.offset)
	binary.LittleEndian.PutUint64(b[56:], h.length)
}

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrMalformedFrame}, args...)...)
}

// decodeHeader decodes and validates one frame header. It checks everything
// that can be checked without the grant: magic, type, reserved fields, and
// the payload length allowed for the type.
func decodeHeader(b []byte) (header, error) {
	var h header
	if len(b) < headerSize {
		return h, malformed("truncated header: %d of %d bytes", len(b), headerSize)
	}
	if m := binary.LittleEndian.Uint32(b[0:]); m != frameMagic {
		return h, malformed("bad magic %#x", m)
	}
	h.typ = b[4]
	h.flags = b[5]
	if h.flags != 0 && (h.typ != frameCommit || h.flags != flagNoCRC) {
		return h, malformed("flags %#x on frame type %d", h.flags, h.typ)
	}
	if b[6] != 0 || b[7] != 0 || binary.LittleEndian.Uint32(b[12:]) != 0 {
		return h, malformed("reserved header bytes are not zero")
	}
	h.index = binary.LittleEndian.Uint32(b[8:])
	h.grant = binary.LittleEndian.Uint64(b[16:])
	h.epoch = binary.LittleEndian.Uint64(b[24:])
	copy(h.token[:], b[32:48])
	h.offset = binary.LittleEndian.Uint64(b[48:])
	h.length = binary.LittleEndian.Uint64(b[56:])
	switch h.typ {
	case frameData:
		if h.length == 0 || h.length > maxDataLen {
			return h, malformed("data length %d not in 1..%d", h.length, uint64(maxDataLen))
		}
		if h.offset > math.MaxUint64-h.length {
			return h, malformed("data offset %d + length %d overflows", h.offset, h.length)
		}
		if h.index >= MaxExtents {
			return h, malformed("extent index %d >= %d", h.index, MaxExtents)
		}
	case frameCommit:
		if h.index == 0 || h.index > MaxExtents {
			return h, malformed("commit extent count %d not in 1..%d", h.index, MaxExtents)
		}
		if h.length != uint64(h.index)*manifestEntrySize {
			return h, malformed("commit payload %d bytes, want %d", h.length, uint64(h.index)*manifestEntrySize)
		}
		if h.offset != 0 {
			return h, malformed("commit offset %d is not zero", h.offset)
		}
	case frameReply, frameAbort:
		if h.index >= numCodes || (h.typ == frameAbort && h.index == codeOK) {
			return h, malformed("unknown status code %d", h.index)
		}
		if h.length > maxMsgLen || h.offset != 0 {
			return h, malformed("reply message of %d bytes", h.length)
		}
	case framePull:
		if h.length != pullSize {
			return h, malformed("pull payload %d bytes, want %d", h.length, pullSize)
		}
		if h.index >= MaxExtents {
			return h, malformed("extent index %d >= %d", h.index, MaxExtents)
		}
		if h.offset > maxDataLen {
			return h, malformed("pull offset %d > %d", h.offset, uint64(maxDataLen))
		}
	case frameFlush:
		if h.index != 0 || h.offset != 0 || h.length != 0 {
			return h, malformed("flush with index %d, offset %d, length %d", h.index, h.offset, h.length)
		}
	case frameHello:
		if h.index != protocolVersion {
			return h, malformed("protocol version %d, want %d", h.index, protocolVersion)
		}
		if h.length == 0 || h.length > maxMsgLen || h.offset != 0 {
			return h, malformed("hello agent id of %d bytes", h.length)
		}
	default:
		return h, malformed("unknown frame type %d", h.typ)
	}
	return h, nil
}

// putManifest encodes m as a commit payload into b, which must hold
// len(m.Bytes)*manifestEntrySize bytes.
func putManifest(b []byte, m *Manifest) {
	for i := range m.Bytes {
		e := b[i*manifestEntrySize:]
		binary.LittleEndian.PutUint64(e, m.Bytes[i])
		binary.LittleEndian.PutUint32(e[8:], m.CRC[i])
	}
}

// decodeManifest decodes a commit payload of n entries into m, reusing its
// slices when they are large enough.
func decodeManifest(b []byte, n int, m *Manifest) error {
	if n <= 0 || n > MaxExtents || len(b) != n*manifestEntrySize {
		return malformed("manifest of %d bytes for %d extents", len(b), n)
	}
	if cap(m.Bytes) < n {
		m.Bytes = make([]uint64, n)
		m.CRC = make([]uint32, n)
	}
	m.Bytes, m.CRC = m.Bytes[:n], m.CRC[:n]
	for i := 0; i < n; i++ {
		e := b[i*manifestEntrySize:]
		m.Bytes[i] = binary.LittleEndian.Uint64(e)
		m.CRC[i] = binary.LittleEndian.Uint32(e[8:])
	}
	return nil
}

// frame is one whole decoded frame; used by decodeFrame.
type frame struct {
	header
	payload  []byte   // data payload, reply message or hello agent id (aliases the input)
	manifest Manifest // commit payload
}

// decodeFrame decodes one complete frame from the front of b and returns it
// with the number of bytes consumed. It is the reference decoder the stream
// readers follow, and the fuzz target.
func decodeFrame(b []byte) (frame, int, error) {
	var f frame
	h, err := decodeHeader(b)
	if err != nil {
		return f, 0, err
	}
	f.header = h
	rest := b[headerSize:]
	if uint64(len(rest)) < h.length {
		return f, 0, malformed("truncated payload: %d of %d bytes", len(rest), h.length)
	}
	p := rest[:h.length]
	switch h.typ {
	case frameCommit:
		if err := decodeManifest(p, int(h.index), &f.manifest); err != nil {
			return f, 0, err
		}
	default:
		f.payload = p
	}
	return f, headerSize + int(h.length), nil
}

// writerAborted is the failure of a grant whose writer aborted it (an abort
// frame): the writer's reason, under the sentinel its code names.
func writerAborted(peer string, h *header, msg []byte) error {
	if h.index == codeInternal {
		return fmt.Errorf("writer %s aborted grant %d: %s", peer, h.grant, msg)
	}
	return fmt.Errorf("writer %s aborted grant %d: %w: %s", peer, h.grant, codeSentinels[h.index], msg)
}
