package rdma

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/handoff-io/handoff/internal/crc32c"
)

const (
	// defaultTCPLanes is Config.TCPLanes' default.
	defaultTCPLanes = 4
	// laneMinBytes is the least a lane of a striped write carries: below it
	// the lane's flush round trip costs more than the parallelism gives.
	laneMinBytes = 1 << 20
)

// stripe divides op's pieces among up to lanes lanes of about equal bytes,
// at least laneMinBytes each, splitting a piece where a lane ends. It
// returns the pieces in order and the cut points between lanes (first 0,
// last len(pieces)); no cuts means one connection carries it all. The
// pieces of an extent that two lanes share are marked apart: lanes run
// concurrently and an extent's crc runs in order, so each such piece is
// summed on its own and the sums are joined in order after the lanes
// (crc32c.Combine), as the receiver joins its landings' sums.
func stripe(op *writeOp, lanes int) ([]piece, []int) {
	k := min(uint64(lanes), op.n/laneMinBytes)
	if k < 2 {
		return nil, nil
	}
	all := make([]piece, 0, len(op.pieces)+int(k))
	cuts := make([]int, 1, k+1)
	var acc uint64 // bytes before the current lane's end
	for _, p := range op.pieces {
		for len(p.src) > 0 {
			lane := uint64(len(cuts)) // 1-based lane number
			end := op.n * lane / k
			if lane == k {
				end = op.n
			}
			n := min(uint64(len(p.src)), end-acc)
			all = append(all, piece{ext: p.ext, off: p.off, src: p.src[:n], apart: op.partial})
			p.off, p.src = p.off+n, p.src[n:]
			acc += n
			if acc == end && lane < k {
				cuts = append(cuts, len(all))
			}
		}
	}
	cuts = append(cuts, len(all))
	// Mark the extents that span a cut.
	for _, c := range cuts[1 : len(cuts)-1] {
		if c == 0 || c == len(all) || all[c-1].ext != all[c].ext {
			continue
		}
		ext := all[c].ext
		for i := c - 1; i >= 0 && all[i].ext == ext; i-- {
			all[i].apart = true
		}
		for i := c; i < len(all) && all[i].ext == ext; i++ {
			all[i].apart = true
		}
	}
	return all, cuts
}

// writeStriped sends pieces over len(cuts)-1 connections at once: each lane
// but the first ends with a flush, and once every flush was answered the
// first lane, whose own data went out meanwhile, commits, with the sums of
// the pieces marked apart joined into the manifest.
func (l *tcpLink) writeStriped(ctx context.Context, op *writeOp, pieces []piece, cuts []int) error {
	k := len(cuts) - 1
	lanes := make([]*txConn, k)
	for i := range lanes {
		tc, err := l.get(ctx)
		if err != nil {
			for _, tc := range lanes[:i] {
				l.put(tc)
			}
			return err
		}
		lanes[i] = tc
	}
	for _, tc := range lanes {
		tc.bind(ctx)
	}
	errs := make([]error, k)
	var lanesDone sync.WaitGroup
	for i := 1; i < k; i++ {
		lanesDone.Go(func() {
			tc := lanes[i]
			errs[i] = l.finish(ctx, tc, op.t, tc.send(op, pieces[cuts[i]:cuts[i+1]], frameFlush))
		})
	}
	tc := lanes[0]
	if op.partial {
		// Every lane of a Stream's part ends with a flush; the Stream joins
		// the pieces' sums, so it gets the pieces as they were cut.
		errs[0] = l.finish(ctx, tc, op.t, tc.send(op, pieces[:cuts[1]], frameFlush))
		lanesDone.Wait()
		op.pieces = append(op.pieces[:0], pieces...)
		return errors.Join(errs...)
	}
	werr := tc.send(op, pieces[:cuts[1]], 0)
	lanesDone.Wait()
	if !op.noCRC {
		for i := range pieces {
			if p := &pieces[i]; p.apart {
				op.manifest.CRC[p.ext] = crc32c.Combine(op.manifest.CRC[p.ext], p.crc, int64(len(p.src)))
			}
		}
	}
	if err := errors.Join(errs[1:]...); err != nil {
		// No commit: dropping the first lane fails the grant on the
		// receiver (a connection that landed bytes and closed).
		l.drop(tc)
		if werr != nil {
			err = errors.Join(err, fmt.Errorf("%w: writing to %s: %w", ErrPeerClosed, l.peer.Agent, werr))
		}
		return err
	}
	if werr == nil {
		werr = tc.send(op, nil, frameCommit)
	}
	return l.finish(ctx, tc, op.t, werr)
}
