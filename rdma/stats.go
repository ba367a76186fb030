package rdma

import "sync/atomic"

// Stats are an engine's cumulative counters, for metrics and the bench
// tool. Receiver-side counters describe grants this engine opened;
// writer-side ones describe Write calls it made.
type Stats struct {
	GrantsOpened    uint64 // OpenGrant successes
	GrantsCommitted uint64 // grants whose commit was verified
	GrantsFailed    uint64 // grants revoked, expired, refused or abandoned
	GrantsOpen      uint64 // grants neither committed nor failed yet
	BytesLanded     uint64 // bytes committed into this engine's grants
	FramesRefused   uint64 // data frames refused (bad token, stale epoch, range, ...)
	Writes          uint64 // Write calls the receiver accepted
	WritesFailed    uint64 // Write calls that returned an error
	BytesWritten    uint64 // bytes of accepted Writes
	// GrantsQuarantined counts grants that failed while a live shm writer
	// was still copying into them (Grant.Quarantined); QuarantinedBytes is
	// the destination bytes such grants keep out of use right now.
	GrantsQuarantined uint64
	QuarantinedBytes  uint64
	// BytesStaged counts device bytes that passed through pinned staging
	// buffers (tcp to or from device memory), on either side; BytesPulled
	// the device bytes this receiver copied out of writers' allocations
	// (cuda-ipc).
	BytesStaged uint64
	BytesPulled uint64
}

// counters is the atomic backing of Stats.
type counters struct {
	grantsOpened, grantsCommitted, grantsFailed atomic.Uint64
	bytesLanded, framesRefused                  atomic.Uint64
	writes, writesFailed, bytesWritten          atomic.Uint64
	grantsQuarantined                           atomic.Uint64
	bytesStaged, bytesPulled                    atomic.Uint64
	quarantinedBytes                            atomic.Int64
}

// Stats returns a snapshot of the engine's counters.
func (e *Engine) Stats() Stats {
	c := &e.stats
	s := Stats{
		GrantsOpened:    c.grantsOpened.Load(),
		GrantsCommitted: c.grantsCommitted.Load(),
		GrantsFailed:    c.grantsFailed.Load(),
		BytesLanded:     c.bytesLanded.Load(),
		FramesRefused:   c.framesRefused.Load(),
		Writes:          c.writes.Load(),
		WritesFailed:    c.writesFailed.Load(),
		BytesWritten:    c.bytesWritten.Load(),

		GrantsQuarantined: c.grantsQuarantined.Load(),
		QuarantinedBytes:  uint64(max(c.quarantinedBytes.Load(), 0)),
		BytesStaged:       c.bytesStaged.Load(),
		BytesPulled:       c.bytesPulled.Load(),
	}
	if done := s.GrantsCommitted + s.GrantsFailed; s.GrantsOpened > done {
		s.GrantsOpen = s.GrantsOpened - done
	}
	return s
}
