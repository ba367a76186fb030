package rdma

// Engine.Write: cutting the sources into pieces at the destination's
// extent boundaries, and the writeOp the links carry out.

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// piece is one contiguous copy: src lands at offset off of destination extent ext.
type piece struct {
	ext uint32
	off uint64
	src []byte
	// apart: the piece is summed into crc, on its own, and joined into the
	// manifest afterwards (an extent that lanes of a striped tcp write share).
	apart bool
	crc   uint32
	// dev is the source in device memory, dn bytes of it; src is nil then.
	dev devSpan
	dn  uint64
}

// writeOp is one Write as the backends see it.
type writeOp struct {
	t        *Ticket // &tk
	tk       Ticket
	pieces   []piece
	manifest *Manifest // &mf: Bytes set; CRC filled by the backend through sum
	mf       Manifest
	noCRC    bool // SkipCRC: the manifest carries byte counts only
	dev      bool // some piece's source is in device memory (device.go)
	// n is the bytes of pieces: the ticket's for Write, a part of them for
	// one write of a Stream.
	n uint64
	// partial: one write of a Stream. Its pieces land (and are known to
	// have landed when write returns) but nothing is committed; every
	// piece is summed apart, and the Stream joins the sums at its commit.
	partial bool
	hooks   *hooks // the writer engine's test seams (hooks.go); nil: none
}

// sum folds src, the next bytes of piece p, into its crc (crcFor). Pieces
// of one extent are summed in order unless apart.
func (op *writeOp) sum(p *piece, src []byte) {
	if !op.noCRC {
		sum := op.crcFor(p)
		*sum = crc32Update(*sum, src)
	}
}

// commitFlags returns the commit frame's flags.
func (op *writeOp) commitFlags() uint8 {
	if op.noCRC {
		return flagNoCRC
	}
	return 0
}

var opPool = sync.Pool{New: func() any { return new(writeOp) }}

// getOp takes a writeOp of e's from the pool.
func (e *Engine) getOp() *writeOp {
	op := opPool.Get().(*writeOp)
	op.hooks = e.hooks.Load()
	return op
}

// testHooks returns the hooks of op's engine, or noHooks.
func (op *writeOp) testHooks() *hooks {
	if op.hooks == nil {
		return &noHooks
	}
	return op.hooks
}

// putOp resets a pooled writeOp and returns it.
func putOp(op *writeOp) {
	op.reset()
	opPool.Put(op)
}

// reset zeroes every field of op for its next use, keeping the pieces'
// backing array, cleared so that a pooled op holds no source memory.
func (op *writeOp) reset() {
	clear(op.pieces)
	*op = writeOp{pieces: op.pieces[:0]}
}

// Write copies the concatenation of src (local extents) into the
// concatenation of the ticket's extents (same total length), then commits
// with a manifest, and returns once the receiver accepted or refused the
// commit: one round trip per request. Source extents may be split at the
// destination's extent boundaries and vice versa. The source memory must not
// change until Write returns. A refusal by the receiver is a *RemoteError
// wrapping the sentinel (ErrRevoked, ErrStaleEpoch, ErrManifestMismatch, ...).
func (e *Engine) Write(ctx context.Context, peer Descriptor, t Ticket, src []Extent) (Manifest, error) {
	if err := e.beginOp(); err != nil {
		return Manifest{}, err
	}
	defer e.ops.Done()
	if t.Agent != peer.Agent {
		return Manifest{}, fmt.Errorf("%w: ticket is for %q, descriptor for %q", ErrWrongPeer, t.Agent, peer.Agent)
	}
	if len(t.Extents) == 0 || len(t.Extents) > MaxExtents {
		return Manifest{}, fmt.Errorf("%w: ticket has %d extents", ErrOutOfRange, len(t.Extents))
	}
	if !t.Deadline.IsZero() && !time.Now().Before(t.Deadline) {
		return Manifest{}, fmt.Errorf("%w: grant %d expired at %s", ErrDeadline, t.Grant, t.Deadline.Format(time.RFC3339Nano))
	}
	m := Manifest{Bytes: make([]uint64, len(t.Extents)), CRC: make([]uint32, len(t.Extents))}
	var total uint64
	for i, x := range t.Extents {
		if x.Length == 0 || x.Length > maxDataLen {
			return Manifest{}, fmt.Errorf("%w: ticket extent %d of %d bytes", ErrOutOfRange, i, x.Length)
		}
		m.Bytes[i] = x.Length
		total += x.Length
	}
	if total != t.Bytes {
		return Manifest{}, fmt.Errorf("%w: ticket extents sum to %d bytes, ticket says %d", ErrOutOfRange, total, t.Bytes)
	}
	op := e.getOp()
	defer putOp(op)
	op.tk, op.mf = t, m // in the pooled op, so that neither escapes; mf shares m's arrays
	op.t, op.manifest, op.noCRC, op.n = &op.tk, &op.mf, e.cfg.SkipCRC, total
	if err := e.split(op, src, total); err != nil {
		return Manifest{}, err
	}
	// A context already done starts nothing. The links see it only where
	// they wait, and a small write over tcp can end without waiting once:
	// it then succeeded under a cancelled context, now and then.
	if err := ctx.Err(); err != nil {
		return Manifest{}, fmt.Errorf("rdma: write to %s: %w", peer.Agent, err)
	}
	p, err := e.peerFor(ctx, peer)
	if err != nil {
		return Manifest{}, err
	}
	if op.dev && p.link.transport() == TransportSHM {
		return Manifest{}, fmt.Errorf("%w: a device source over shm (register device regions before connecting)", ErrUnsupported)
	}
	if err := p.write(ctx, op); err != nil {
		e.stats.writesFailed.Add(1)
		return Manifest{}, err
	}
	e.stats.writes.Add(1)
	e.stats.bytesWritten.Add(total)
	return m, nil
}

// split cuts the source extents into pieces at destination extent boundaries.
func (e *Engine) split(op *writeOp, src []Extent, total uint64) error {
	e.mu.RLock()
	defer e.mu.RUnlock()
	var have uint64
	dst := op.t.Extents
	di, doff := 0, uint64(0)
	for i, s := range src {
		r, ok := e.regions[s.Region]
		if !ok {
			return fmt.Errorf("%w: source extent %d names unknown local region %d", ErrOutOfRange, i, s.Region)
		}
		if err := r.checkExtent(s, false); err != nil {
			return fmt.Errorf("source extent %d: %w", i, err)
		}
		have += s.Length
		if have > total {
			return fmt.Errorf("%w: source extents hold more than the ticket's %d bytes", ErrOutOfRange, total)
		}
		if r.dev != nil {
			splitDevice(op, r.dev, s, &di, &doff)
			continue
		}
		b := r.slice(s)
		for len(b) > 0 {
			n := min(uint64(len(b)), dst[di].Length-doff)
			op.pieces = append(op.pieces, piece{ext: uint32(di), off: doff, src: b[:n:n]})
			b = b[n:]
			doff += n
			if doff == dst[di].Length {
				di, doff = di+1, 0
			}
		}
	}
	if have != total {
		return fmt.Errorf("%w: source extents hold %d bytes, ticket %d", ErrOutOfRange, have, total)
	}
	return nil
}
