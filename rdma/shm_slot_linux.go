//go:build linux

package rdma

// The shm transport's grant slot table: the layout of a slot, its state
// word and the protocol writers and fences follow on it (below). The
// receiver is in shm_receiver_linux.go, the writer in shm_writer_linux.go.

import (
	"sync/atomic"
	"unsafe"
)

const shmSupported = true

// Shared-memory transport.
//
// The receiver exports two things to a same-host writer over its unix
// control socket (SCM_RIGHTS): the memfds of its regions and the memfd of a
// grant slot table. Slot i (64 bytes) describes the open grant whose id is
// congruent to i modulo the table size:
//
//	off field
//	0   state word: epoch<<18 | writer<<2 | state (closed, open, writing, fencing)
//	8   grant id
//	16  token (2 words)
//	32  digest of the grant's extents (FNV-1a over region, offset, length)
//	40  deadline (unix nanoseconds)
//	48  id of the last writer that copied into the grant
//	56  bytes copied into the grant (added by writers, once per bracket)
//
// Epochs are unique per engine, so (state, epoch) names one grant
// incarnation, and a fence touches only the words of its own grant's epoch
// (a slot reused by another grant is not its to close). A writer brackets
// each copy of at most shmBracket bytes with CAS open(e) -> writing(e, w)
// and a CAS back to open(e); it never copies unless the first CAS
// succeeded. To fence (revoke, deadline, commit) the receiver CASes
// open(e) -> closed(e); finding writing(e, w), it CASes it to fencing(e, w),
// and the writer, whose closing CAS then fails, ends its bracket with
// fencing(e, w) -> closed(e) and copies no more. The receiver waits for that
// up to Config.FenceWait; a writer that does not end its bracket by then
// (stopped, frozen) leaves the grant failed and its destination quarantined
// until the bracket ends or the writer's process is gone.
//
// Death is never inferred from the socket: the receiver takes the writer's
// pid at accept (SO_PEERCRED) and opens a pidfd, which polls readable once
// the process exited. A connection the receiver cut itself (a malformed
// frame, an out-of-step stream) leaves a live writer live. Only where the
// pid cannot be known (another pid namespace) does a closed connection
// stand for the process, as it did before.
//
// No per-byte round trip: the data path is a memcpy into the mapped arena,
// and the commit travels once over the socket.
//
// The writer sums what landed: crc32c.CopyUpdate copies each chunk into the
// destination and sums the bytes from the registers that store them, in
// brackets of shmBracket bytes (the slot says "writing" during each).
const (
	slotSize   = 64
	shmBracket = 4 << 20   // bytes copied per CAS bracket: a fence waits for at most one (~0.4 ms at 10 GB/s)
	shmSubCopy = 256 << 10 // copied and summed in one pass (crc32c.CopyUpdate)

	slotClosed  = 0
	slotOpen    = 1
	slotWriting = 2
	slotFencing = 3 // writing, and a fence waits for the bracket to end

	slotWriterBits = 16
	slotEpochShift = 2 + slotWriterBits
	slotEpochMask  = 1<<(64-slotEpochShift) - 1
	maxShmRegions  = 200 // SCM_RIGHTS carries at most 253 fds
)

func slotWord(state, writer uint64, epoch uint64) uint64 {
	return (epoch&slotEpochMask)<<slotEpochShift | writer<<2 | state
}

func wordState(w uint64) uint64  { return w & 3 }
func wordWriter(w uint64) uint64 { return w >> 2 & (1<<slotWriterBits - 1) }
func wordEpoch(w uint64) uint64  { return w >> slotEpochShift }

// slotView addresses one slot of a mapped table.
type slotView struct{ b []byte }

func (s slotView) word(off int) *atomic.Uint64 {
	return (*atomic.Uint64)(unsafe.Pointer(&s.b[off]))
}
func (s slotView) state() *atomic.Uint64    { return s.word(0) }
func (s slotView) grant() *atomic.Uint64    { return s.word(8) }
func (s slotView) token0() *atomic.Uint64   { return s.word(16) }
func (s slotView) token1() *atomic.Uint64   { return s.word(24) }
func (s slotView) digest() *atomic.Uint64   { return s.word(32) }
func (s slotView) deadline() *atomic.Uint64 { return s.word(40) }
func (s slotView) writer() *atomic.Uint64   { return s.word(48) }
func (s slotView) copied() *atomic.Uint64   { return s.word(56) }

func slotAt(table []byte, i int) slotView { return slotView{table[i*slotSize : (i+1)*slotSize]} }

// extentsDigest hashes a grant's extent list, so a writer can check that
// its ticket names exactly the grant's extents. It is a word-wise FNV-1a
// variant with a final avalanche: cheap for thousands of extents, and any
// difference in region, offset, length or count changes it.
func extentsDigest(xs []Extent) uint64 {
	const prime = 1099511628211
	h := uint64(14695981039346656037) ^ uint64(len(xs))
	for _, x := range xs {
		h = (h ^ uint64(x.Region)) * prime
		h = (h ^ x.Offset) * prime
		h = (h ^ x.Length) * prime
	}
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	return h
}
