package transfer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"

	"github.com/handoff-io/handoff/rdma"
)

// Layerwise says when a prefill worker streams a request's cache while
// prefill still computes it (each layer's KV as soon as the layer passed
// the prompt's chunk, each Mamba layer's state once final), instead of
// writing it all once prefill is done. The decoder needs no setting: a
// streamed grant is a grant, committed once, as any other.
type Layerwise uint8

const (
	// LayerwiseAuto streams prompts of at least
	// PrefillerConfig.LayerwiseMinTokens tokens (every prompt by default),
	// and writes shorter ones once prefill is done.
	LayerwiseAuto Layerwise = iota
	// LayerwiseOn streams every request whose executor reports layers.
	LayerwiseOn
	// LayerwiseOff writes every cache once prefill is done.
	LayerwiseOff
)

// DefaultLayerwiseMinTokens is LayerwiseAuto's threshold: every prompt.
// A hybrid model's cache is dominated by its Mamba state, whose size does
// not depend on the prompt, so streaming hid the whole transfer from 8
// prompt tokens to 16k, and cost nothing measurable on a cache too small
// to matter (docs/scaling.md, "Layer-wise streaming").
const DefaultLayerwiseMinTokens = 1

func (l Layerwise) String() string {
	switch l {
	case LayerwiseAuto:
		return "auto"
	case LayerwiseOn:
		return "on"
	case LayerwiseOff:
		return "off"
	}
	return fmt.Sprintf("Layerwise(%d)", uint8(l))
}

// ParseLayerwise reads "on", "off" or "auto".
func ParseLayerwise(s string) (Layerwise, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "auto", "":
		return LayerwiseAuto, nil
	case "on", "true":
		return LayerwiseOn, nil
	case "off", "false":
		return LayerwiseOff, nil
	}
	return 0, fmt.Errorf("%w: layerwise %q (want on, off or auto)", ErrInvalidConfig, s)
}

// streams reports whether a prompt of tokens tokens is streamed.
func (l Layerwise) streams(tokens, minTokens int) bool {
	switch l {
	case LayerwiseOn:
		return true
	case LayerwiseAuto:
		return tokens >= minTokens
	}
	return false
}

// Piece is a part of a request's cache that prefill finished: Src, an
// extent of the worker's registered regions, holds bytes [At, At+Length)
// of the cache as a whole write sends it (Prefilled.Source: the KV extents
// in token order, then the Mamba row).
type Piece struct {
	At  uint64
	Src rdma.Extent
}

// LayerwiseJob is an AdmittedJob whose prefill can report the parts of the
// cache as they become final, so that they leave while later layers
// compute.
type LayerwiseJob interface {
	AdmittedJob
	// Stream makes the job call sink with the pieces of each part of the
	// cache as soon as prefill finished it, from now on, until Prefill
	// returned. sink is called on the compute goroutine and does not
	// block; the pieces' bytes stay unchanged until Release. Parts
	// finished before Stream was called are not reported: the write after
	// Prefill sends whatever was not.
	Stream(sink func([]Piece))
}

// streamer pushes one request's pieces through an rdma.Stream on a
// goroutine of its own while prefill computes, then writes the rest and
// commits (finish). The compute goroutine only queues (push).
type streamer struct {
	s     *rdma.Stream
	ends  []uint64 // ends[i]: where ticket extent i ends in the whole write
	total uint64
	log   *slog.Logger
	seq   uint64 // the request's id, for the log

	// run's scratch, owned by its goroutine.
	dst []rdma.Range
	src []rdma.Extent

	mu     sync.Mutex
	queue  []Piece
	closed bool
	err    error // the stream failed: pieces are dropped from then on
	wake   chan struct{}
	done   chan struct{}
}

// startStreamer opens a stream of t into peer and starts its goroutine,
// which ends once stop or finish is called.
func startStreamer(ctx context.Context, eng writerEngine, peer rdma.Descriptor, t rdma.Ticket, log *slog.Logger, seq uint64) (*streamer, error) {
	s, err := eng.OpenStream(ctx, peer, t)
	if err != nil {
		return nil, err
	}
	st := &streamer{s: s, ends: make([]uint64, len(t.Extents)), log: log, seq: seq, wake: make(chan struct{}, 1), done: make(chan struct{})}
	for i, x := range t.Extents {
		st.total += x.Length
		st.ends[i] = st.total
	}
	go st.run(ctx)
	return st, nil
}

// push queues pieces; it never blocks (the compute goroutine calls it).
func (st *streamer) push(ps []Piece) {
	st.mu.Lock()
	if st.closed || st.err != nil {
		st.mu.Unlock()
		return
	}
	st.queue = append(st.queue, ps...)
	st.mu.Unlock()
	select {
	case st.wake <- struct{}{}:
	default:
	}
}

// run writes what was queued, all of it in one Write per wake-up (layers
// that finished while a write was in flight go out together).
func (st *streamer) run(ctx context.Context) {
	defer close(st.done)
	var batch []Piece
	for {
		st.mu.Lock()
		batch = append(batch[:0], st.queue...)
		clear(st.queue)
		st.queue = st.queue[:0]
		closed := st.closed
		st.mu.Unlock()
		if len(batch) > 0 {
			if err := st.write(ctx, batch); err != nil {
				st.mu.Lock()
				st.err, st.queue = err, nil
				st.mu.Unlock()
				return
			}
			continue
		}
		if closed {
			return
		}
		select {
		case <-st.wake:
		case <-ctx.Done():
			st.mu.Lock()
			st.err, st.queue = fmt.Errorf("transfer: streaming the cache: %w", ctx.Err()), nil
			st.mu.Unlock()
			return
		}
	}
}

// write sends batch in one Write. A batch refused with nothing sent (a
// piece outside the cache, or a Write the stream refused before sending
// anything: a range written already, a source outside its region; the
// stream goes on then, rdma.Stream.Err stays nil, as Write documents) does
// not end the stream: its pieces are tried one at a time, so that one bad
// piece does not hold the others back, and a piece refused on its own is
// dropped. The write after prefill sends it (WriteRest sends every byte no
// write did), so no piece is lost, and each is tried at most twice. The
// error returned, a failure that ended the stream, ends the request.
func (st *streamer) write(ctx context.Context, batch []Piece) error {
	err := st.writeOnce(ctx, batch)
	if err == nil || !st.unsent(err) {
		return err
	}
	if len(batch) > 1 {
		for i := range batch {
			if err = st.writeOnce(ctx, batch[i:i+1]); err == nil {
				continue
			}
			if !st.unsent(err) {
				return err
			}
			st.log.Debug("layer-wise piece refused, left to the write after prefill", "seq", st.seq, "at", batch[i].At, "bytes", batch[i].Src.Length, "err", err)
		}
		return nil
	}
	st.log.Debug("layer-wise piece refused, left to the write after prefill", "seq", st.seq, "at", batch[0].At, "bytes", batch[0].Src.Length, "err", err)
	return nil
}

// unsent reports whether the failed write err sent nothing and left the
// stream going: refused as out of range (by ranges, or by Write before it
// sent anything) with the stream not ended. A closed engine, a cancelled
// context or a receiver's refusal end the stream.
func (st *streamer) unsent(err error) bool {
	return errors.Is(err, rdma.ErrOutOfRange) && st.s.Err() == nil
}

// writeOnce sends pieces in one Write.
func (st *streamer) writeOnce(ctx context.Context, pieces []Piece) error {
	var err error
	st.dst, st.src, err = st.ranges(pieces, st.dst[:0], st.src[:0])
	if err != nil {
		return err
	}
	return st.s.Write(ctx, st.dst, st.src)
}

// ranges maps pieces, in the whole write's bytes, onto the ticket's
// extents (a piece that spans two extents is cut in two).
func (st *streamer) ranges(ps []Piece, dst []rdma.Range, src []rdma.Extent) ([]rdma.Range, []rdma.Extent, error) {
	for _, p := range ps {
		if p.Src.Length == 0 || p.At >= st.total || p.Src.Length > st.total-p.At {
			return nil, nil, fmt.Errorf("%w: piece [%d, +%d) outside the %d-byte cache", rdma.ErrOutOfRange, p.At, p.Src.Length, st.total)
		}
		at, x := p.At, p.Src
		for x.Length > 0 {
			i, _ := slices.BinarySearch(st.ends, at+1) // the extent holding byte at
			var start uint64
			if i > 0 {
				start = st.ends[i-1]
			}
			n := min(x.Length, st.ends[i]-at)
			// Bytes land in the ranges' concatenation from the sources':
			// a range that continues the last one extends it, whatever
			// its source (a resharded layer is many sources, one range).
			if k := len(dst) - 1; k >= 0 && dst[k].Ext == i && dst[k].Offset+dst[k].Length == at-start {
				dst[k].Length += n
			} else {
				dst = append(dst, rdma.Range{Ext: i, Offset: at - start, Length: n})
			}
			if k := len(src) - 1; k >= 0 && src[k].Region == x.Region && src[k].Offset+src[k].Length == x.Offset {
				src[k].Length += n
			} else {
				src = append(src, rdma.Extent{Region: x.Region, Offset: x.Offset, Length: n})
			}
			at, x.Offset, x.Length = at+n, x.Offset+n, x.Length-n
		}
	}
	return dst, src, nil
}

// finish waits for the queued pieces to land, writes what no piece
// covered from the whole-write sources, and commits. early is what the
// pieces wrote.
func (st *streamer) finish(ctx context.Context, all []rdma.Extent) (m rdma.Manifest, early uint64, err error) {
	if err := st.stop(true); err != nil {
		return rdma.Manifest{}, 0, err
	}
	early = st.s.Written()
	if err := st.s.WriteRest(ctx, all); err != nil {
		return rdma.Manifest{}, early, err
	}
	m, err = st.s.Commit(ctx)
	return m, early, err
}

// stop ends the goroutine once it wrote what was queued (drain) or once
// the write in flight, if any, returned (the request failed: its grant
// will be revoked), and returns the stream's failure, if any. Idempotent.
func (st *streamer) stop(drain bool) error {
	st.mu.Lock()
	st.closed = true
	if !drain {
		clear(st.queue)
		st.queue = st.queue[:0]
	}
	st.mu.Unlock()
	select {
	case st.wake <- struct{}{}:
	default:
	}
	<-st.done
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.err
}

// startStream starts streaming t's cache when the prefiller's mode and the
// job allow it. A stream that cannot start leaves the cache to the write
// after prefill, as without streaming.
func (t *task) startStream() {
	p := t.p
	ll, ok := t.lease.(LayerwiseJob)
	// A delta handoff (Skip) goes in one write: a stream's parts name the
	// whole prompt's blocks.
	if !ok || t.msg.Skip > 0 || !p.cfg.Layerwise.streams(len(t.msg.Tokens), p.cfg.LayerwiseMinTokens) {
		return
	}
	st, err := startStreamer(t.ctx, p.eng, t.peer, t.ticket, p.cfg.Logger, t.msg.RequestID)
	if err != nil {
		p.cfg.Logger.Debug("layer-wise stream not started; the cache goes in one write", "seq", t.msg.RequestID, "err", err)
		return
	}
	t.lw = st
	ll.Stream(st.push)
}

// stopStream ends t's stream, if any: what was queued is dropped, and once
// the write in flight returned nothing more is read from the job's cache.
func (t *task) stopStream() {
	if t.lw != nil {
		_ = t.lw.stop(false)
	}
}
