package rdma

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/handoff-io/handoff/internal/crc32c"
)

// Range is a byte range of one of a ticket's destination extents: Length
// bytes at Offset of extent Ext (an index into Ticket.Extents).
type Range struct {
	Ext    int    `json:"ext"`
	Offset uint64 `json:"offset"`
	Length uint64 `json:"length"`
}

// Stream writes one grant progressively: many writes, each into some ranges
// of the ticket's extents, in any order, then one commit whose manifest
// covers every extent. It is how a prefill worker pushes each layer's cache
// as soon as compute finished it, while later layers still compute.
//
// The receiver needs nothing new: a stream's writes are data frames of the
// grant like any other (tcp ends each write with a flush, whose reply says
// its frames landed; shm copies inside the grant's slot brackets; inproc
// copies), so epochs fence them as they fence Write: once the receiver
// revoked the grant no byte of any write lands, including one of a writer
// that is late or dead, and the commit is refused.
//
// A Stream belongs to one writer. Its methods are safe for concurrent use
// but run one at a time (shm's slot admits one copy bracket at a time, and
// a byte range must be known written before the commit's manifest is
// built). The first failure ends the stream: later calls return it.
type Stream struct {
	e    *Engine
	peer Descriptor
	t    Ticket

	mu      sync.Mutex
	err     error       // sticky: the first failure, or errStreamDone
	segs    [][]segment // per extent: the ranges written, sorted by offset, with their crcs
	written uint64
}

// errStreamDone is the error of calls after a successful Commit.
var errStreamDone = fmt.Errorf("%w: stream already committed", ErrCommitted)

// OpenStream starts a progressive write of ticket t into peer, connecting
// first when needed. Nothing is sent yet.
func (e *Engine) OpenStream(ctx context.Context, peer Descriptor, t Ticket) (*Stream, error) {
	if err := e.beginOp(); err != nil {
		return nil, err
	}
	defer e.ops.Done()
	if err := checkTicket(peer, &t); err != nil {
		return nil, err
	}
	if _, err := e.peerFor(ctx, peer); err != nil {
		return nil, err
	}
	t.Extents = slices.Clone(t.Extents)
	return &Stream{e: e, peer: peer, t: t, segs: make([][]segment, len(t.Extents))}, nil
}

// checkTicket validates a ticket on the writer's side (Write, OpenStream).
func checkTicket(peer Descriptor, t *Ticket) error {
	if t.Agent != peer.Agent {
		return fmt.Errorf("%w: ticket is for %q, descriptor for %q", ErrWrongPeer, t.Agent, peer.Agent)
	}
	if len(t.Extents) == 0 || len(t.Extents) > MaxExtents {
		return fmt.Errorf("%w: ticket has %d extents", ErrOutOfRange, len(t.Extents))
	}
	if !t.Deadline.IsZero() && !time.Now().Before(t.Deadline) {
		return fmt.Errorf("%w: grant %d expired at %s", ErrDeadline, t.Grant, t.Deadline.Format(time.RFC3339Nano))
	}
	var total uint64
	for i, x := range t.Extents {
		if x.Length == 0 || x.Length > maxDataLen {
			return fmt.Errorf("%w: ticket extent %d of %d bytes", ErrOutOfRange, i, x.Length)
		}
		total += x.Length
	}
	if total != t.Bytes {
		return fmt.Errorf("%w: ticket extents sum to %d bytes, ticket says %d", ErrOutOfRange, total, t.Bytes)
	}
	return nil
}

// Ticket returns the ticket the stream writes.
func (s *Stream) Ticket() Ticket { return s.t }

// Err returns the failure that ended the stream, nil while it goes on: a
// call refused before anything was sent (see Write, Commit) leaves it nil.
// After a successful Commit it wraps ErrCommitted.
func (s *Stream) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// Written returns the bytes the stream's writes have landed so far.
func (s *Stream) Written() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.written
}

// Write lands the concatenation of src (local extents) in the
// concatenation of dst (ranges of the ticket's extents, same total length)
// and returns once the receiver has them, or refused them. A range may not
// overlap one written before: every destination byte is written once. The
// source memory must not change until Write returns, and must already hold
// its final bytes when Write is called: nothing is read later.
//
// Ranges or sources the stream refuses before sending anything (outside
// the ticket or their region, overlapping each other or bytes written
// before: an error wrapping ErrOutOfRange) are the caller's mistake:
// nothing was sent, the stream goes on (Err stays nil). Any other failure
// ends the stream (the receiver's refusal is a *RemoteError, as for
// Engine.Write); the grant then fails on the receiver, or has already.
func (s *Stream) Write(ctx context.Context, dst []Range, src []Extent) error {
	if err := s.e.beginOp(); err != nil {
		return err
	}
	defer s.e.ops.Done()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return s.err
	}
	return s.writeLocked(ctx, dst, src)
}

// WriteRest writes every byte of the grant that no write of the stream has
// written yet, taking it from src as Engine.Write would: the concatenation
// of src (local extents, as long as the ticket) lands in the concatenation
// of the ticket's extents. Call it once all of src holds its final bytes,
// then Commit. It writes nothing when nothing is missing.
func (s *Stream) WriteRest(ctx context.Context, src []Extent) error {
	if err := s.e.beginOp(); err != nil {
		return err
	}
	defer s.e.ops.Done()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return s.err
	}
	ends := make([]uint64, len(src)) // ends[i]: where src[i] ends in the concatenation
	var have uint64
	for i, x := range src {
		have += x.Length
		ends[i] = have
	}
	if have != s.t.Bytes {
		return fmt.Errorf("%w: source extents hold %d bytes, ticket %d", ErrOutOfRange, have, s.t.Bytes)
	}
	var dst []Range
	var from []Extent
	gap := func(ext int, base, off, n uint64) {
		for n > 0 {
			at := base + off
			i, _ := slices.BinarySearch(ends, at+1) // the source extent holding byte at
			x := src[i]
			start := ends[i] - x.Length
			k := min(n, ends[i]-at)
			dst = append(dst, Range{Ext: ext, Offset: off, Length: k})
			from = append(from, Extent{Region: x.Region, Offset: x.Offset + (at - start), Length: k})
			off, n = off+k, n-k
		}
	}
	var base uint64
	for i, x := range s.t.Extents {
		var pos uint64
		for _, g := range s.segs[i] {
			if g.off > pos {
				gap(i, base, pos, g.off-pos)
			}
			pos = g.off + g.n
		}
		if pos < x.Length {
			gap(i, base, pos, x.Length-pos)
		}
		base += x.Length
	}
	if len(dst) == 0 {
		return nil
	}
	return s.writeLocked(ctx, dst, from)
}

// writeLocked is Write with s.mu held and the stream not failed.
func (s *Stream) writeLocked(ctx context.Context, dst []Range, src []Extent) error {
	op, err := s.op(dst, src)
	if err != nil {
		// A caller's mistake: nothing was sent, the stream goes on.
		return err
	}
	defer putOp(op)
	p, err := s.e.peerFor(ctx, s.peer)
	if err == nil {
		err = p.write(ctx, op)
	}
	if err != nil {
		s.e.stats.writesFailed.Add(1)
		s.err = err
		return err
	}
	for i := range op.pieces {
		pc := &op.pieces[i]
		s.insert(pc.ext, segment{pc.off, pc.size(), pc.crc})
	}
	s.written += op.n
	s.e.stats.bytesWritten.Add(op.n)
	return nil
}

// op checks dst against the ticket and what was written, and cuts src into
// pieces at the ranges' boundaries. s.mu is held.
func (s *Stream) op(dst []Range, src []Extent) (*writeOp, error) {
	var want uint64
	for i, r := range dst {
		if r.Ext < 0 || r.Ext >= len(s.t.Extents) {
			return nil, fmt.Errorf("%w: range %d names extent %d, the ticket has %d", ErrOutOfRange, i, r.Ext, len(s.t.Extents))
		}
		if n := s.t.Extents[r.Ext].Length; r.Length == 0 || r.Offset > n || r.Length > n-r.Offset {
			return nil, fmt.Errorf("%w: range %d: [%d, +%d) outside extent %d of %d bytes", ErrOutOfRange, i, r.Offset, r.Length, r.Ext, n)
		}
		if s.overlaps(r) {
			return nil, fmt.Errorf("%w: range %d: [%d, +%d) of extent %d was written already", ErrOutOfRange, i, r.Offset, r.Length, r.Ext)
		}
		want += r.Length
	}
	if ext, ok := overlapping(dst); ok {
		return nil, fmt.Errorf("%w: ranges overlap in extent %d", ErrOutOfRange, ext)
	}
	op := s.e.getOp()
	op.tk = s.t
	op.mf = Manifest{Bytes: make([]uint64, len(s.t.Extents)), CRC: make([]uint32, len(s.t.Extents))}
	op.t, op.manifest, op.noCRC, op.n, op.partial = &op.tk, &op.mf, s.e.cfg.SkipCRC, want, true
	if err := s.split(op, dst, src, want); err != nil {
		putOp(op)
		return nil, err
	}
	return op, nil
}

// split pairs the source bytes with the ranges.
func (s *Stream) split(op *writeOp, dst []Range, src []Extent, want uint64) error {
	e := s.e
	e.mu.RLock()
	defer e.mu.RUnlock()
	var have uint64
	di, doff := 0, uint64(0)
	for i, x := range src {
		r, ok := e.regions[x.Region]
		if !ok {
			return fmt.Errorf("%w: source extent %d names unknown local region %d", ErrOutOfRange, i, x.Region)
		}
		if err := r.checkExtent(x, false); err != nil {
			return fmt.Errorf("source extent %d: %w", i, err)
		}
		have += x.Length
		if have > want {
			return fmt.Errorf("%w: source extents hold more than the ranges' %d bytes", ErrOutOfRange, want)
		}
		if r.dev != nil { // device memory (device.go): the link stages or pulls these
			op.dev = true
			for off := uint64(0); off < x.Length; {
				d := dst[di]
				n := min(x.Length-off, d.Length-doff)
				op.pieces = append(op.pieces, piece{ext: uint32(d.Ext), off: d.Offset + doff, dev: devSpan{r.dev, x.Offset + off}, dn: n, apart: true})
				off += n
				doff += n
				if doff == d.Length {
					di, doff = di+1, 0
				}
			}
			continue
		}
		b := r.slice(x)
		for len(b) > 0 {
			d := dst[di]
			n := min(uint64(len(b)), d.Length-doff)
			op.pieces = append(op.pieces, piece{ext: uint32(d.Ext), off: d.Offset + doff, src: b[:n:n], apart: true})
			b = b[n:]
			doff += n
			if doff == d.Length {
				di, doff = di+1, 0
			}
		}
	}
	if have != want {
		return fmt.Errorf("%w: source extents hold %d bytes, ranges %d", ErrOutOfRange, have, want)
	}
	return nil
}

// overlapping reports whether two of rs overlap, and in which extent. A
// stream's ranges usually come in order: that is checked in one pass, and
// a sorted copy only otherwise.
func overlapping(rs []Range) (ext int, ok bool) {
	byPlace := func(a, b Range) int {
		if c := cmp.Compare(a.Ext, b.Ext); c != 0 {
			return c
		}
		return cmp.Compare(a.Offset, b.Offset)
	}
	if !slices.IsSortedFunc(rs, byPlace) {
		rs = slices.Clone(rs)
		slices.SortFunc(rs, byPlace)
	}
	for i := 1; i < len(rs); i++ {
		if q, r := rs[i-1], rs[i]; q.Ext == r.Ext && q.Offset+q.Length > r.Offset {
			return r.Ext, true
		}
	}
	return 0, false
}

// overlaps reports whether r meets a range written before. s.mu is held.
func (s *Stream) overlaps(r Range) bool {
	segs := s.segs[r.Ext]
	i, _ := slices.BinarySearchFunc(segs, r.Offset, func(g segment, off uint64) int { return cmp.Compare(g.off, off) })
	if i < len(segs) && segs[i].off < r.Offset+r.Length {
		return true
	}
	return i > 0 && segs[i-1].off+segs[i-1].n > r.Offset
}

// insert records a written piece, merging it with the one it continues
// (pieces of one range come in order). s.mu is held.
func (s *Stream) insert(ext uint32, g segment) {
	segs := s.segs[ext]
	i, _ := slices.BinarySearchFunc(segs, g.off, func(x segment, off uint64) int { return cmp.Compare(x.off, off) })
	if i > 0 && segs[i-1].off+segs[i-1].n == g.off {
		prev := &segs[i-1]
		prev.crc = crc32c.Combine(prev.crc, g.crc, int64(g.n))
		prev.n += g.n
		return
	}
	s.segs[ext] = slices.Insert(segs, i, g)
}

// Commit sends the commit once every byte of every extent was written, and
// returns the receiver's verdict with the manifest it accepted: the crc32c
// of each extent, joined from the sums of the pieces that filled it. A
// stream with bytes missing is not committed (the error wraps
// ErrOutOfRange) and stays usable.
func (s *Stream) Commit(ctx context.Context) (Manifest, error) {
	if err := s.e.beginOp(); err != nil {
		return Manifest{}, err
	}
	defer s.e.ops.Done()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return Manifest{}, s.err
	}
	m := Manifest{Bytes: make([]uint64, len(s.t.Extents)), CRC: make([]uint32, len(s.t.Extents))}
	for i, x := range s.t.Extents {
		var pos uint64
		var crc uint32
		for _, g := range s.segs[i] {
			if g.off != pos {
				break
			}
			crc, pos = crc32c.Combine(crc, g.crc, int64(g.n)), pos+g.n
		}
		if pos != x.Length {
			return Manifest{}, fmt.Errorf("%w: extent %d of grant %d: the stream wrote %d of its first bytes, it has %d", ErrOutOfRange, i, s.t.Grant, pos, x.Length)
		}
		m.Bytes[i] = x.Length
		if !s.e.cfg.SkipCRC {
			m.CRC[i] = crc
		}
	}
	op := s.e.getOp()
	defer putOp(op)
	op.tk, op.mf = s.t, m
	op.t, op.manifest, op.noCRC = &op.tk, &op.mf, s.e.cfg.SkipCRC
	p, err := s.e.peerFor(ctx, s.peer)
	if err == nil {
		err = p.write(ctx, op)
	}
	if err != nil {
		s.e.stats.writesFailed.Add(1)
		s.err = err
		return Manifest{}, err
	}
	s.err = errStreamDone
	s.e.stats.writes.Add(1)
	return m, nil
}
