package rdma

import (
	"encoding/binary"

	"github.com/handoff-io/handoff/internal/cuda"
)

// A pull frame (cuda-ipc) asks the receiver to copy n bytes from offset
// off of the writer's exported device allocation into destination extent
// header.index at header.offset. Its payload, little-endian:
//
//	off size field
//	0   64   CUipcMemHandle of the allocation
//	64  8    base address in the writer's process (the receiver's cache key)
//	72  8    allocation size
//	80  8    buffer id (a cached mapping is stale when it changed)
//	88  16   device UUID
//	104 4    writer's pid
//	108 4    reserved, must be 0
//	112 8    source offset inside the allocation
//	120 8    length
const pullSize = 128

// pull is a decoded pull frame payload.
type pull struct {
	buf cuda.IPCBuffer
	off uint64
	n   uint64
}

// putPull encodes p into b[:pullSize].
func putPull(b []byte, p *pull) {
	_ = b[pullSize-1]
	copy(b[0:64], p.buf.Handle.Reserved[:])
	binary.LittleEndian.PutUint64(b[64:], uint64(p.buf.Base))
	binary.LittleEndian.PutUint64(b[72:], p.buf.Size)
	binary.LittleEndian.PutUint64(b[80:], p.buf.BufferID)
	copy(b[88:104], p.buf.Device[:])
	binary.LittleEndian.PutUint32(b[104:], uint32(p.buf.PID))
	binary.LittleEndian.PutUint32(b[108:], 0)
	binary.LittleEndian.PutUint64(b[112:], p.off)
	binary.LittleEndian.PutUint64(b[120:], p.n)
}

// decodePull decodes and checks a pull payload: a live-looking pid, a
// non-empty allocation, and a source range inside it.
func decodePull(b []byte) (pull, error) {
	var p pull
	if len(b) != pullSize {
		return p, malformed("pull payload of %d bytes, want %d", len(b), pullSize)
	}
	copy(p.buf.Handle.Reserved[:], b[0:64])
	p.buf.Base = cuda.DevicePtr(binary.LittleEndian.Uint64(b[64:]))
	p.buf.Size = binary.LittleEndian.Uint64(b[72:])
	p.buf.BufferID = binary.LittleEndian.Uint64(b[80:])
	copy(p.buf.Device[:], b[88:104])
	pid := binary.LittleEndian.Uint32(b[104:])
	p.off = binary.LittleEndian.Uint64(b[112:])
	p.n = binary.LittleEndian.Uint64(b[120:])
	switch {
	case binary.LittleEndian.Uint32(b[108:]) != 0:
		return p, malformed("pull reserved bytes are not zero")
	case pid == 0 || pid > 1<<22:
		return p, malformed("pull names pid %d", pid)
	case p.buf.Base == 0 || p.buf.Size == 0:
		return p, malformed("pull names an allocation of %d bytes at %#x", p.buf.Size, uint64(p.buf.Base))
	case p.n == 0 || p.n > maxDataLen:
		return p, malformed("pull length %d not in 1..%d", p.n, uint64(maxDataLen))
	case p.off > p.buf.Size || p.n > p.buf.Size-p.off:
		return p, malformed("pull of [%d, +%d) outside an allocation of %d bytes", p.off, p.n, p.buf.Size)
	}
	p.buf.PID = int(pid)
	return p, nil
}
