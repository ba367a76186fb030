package rdma

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/handoff-io/handoff/internal/crc32c"
)

type grantState uint8

const (
	grantOpen       grantState = iota // accepting data
	grantCommitting                   // verifying a commit; no data lands
	grantDone                         // committed and verified
	grantFailed                       // revoked, expired, refused or abandoned
)

// Grant is the receiver side of one request's transfer: destination extents
// that one writer may fill and then commit. All methods are safe for
// concurrent use.
type Grant struct {
	e      *Engine
	id     uint64
	ticket Ticket
	dst    [][]byte      // per extent, aliasing region memory (nil for a device extent)
	dev    []devSpan     // per extent, where it is in device memory; nil when no extent is
	done   chan struct{} // closed once terminal and nothing can land any more
	failed chan struct{} // closed when the grant ends without a commit
	ended  chan struct{} // closed once terminal and either done or quarantined
	endOne sync.Once
	due    int // index in the engine's expiry heap, -1 once out of it (under Engine.mu)

	mu       sync.Mutex
	quiet    sync.Cond // signalled when inflight drops to 0; L = &mu
	state    grantState
	epoch    uint64
	err      error // terminal error when state == grantFailed
	manifest Manifest
	inflight int
	landers  []lander
	ext      []extState
	// Room for the dst and ext of a grant of few extents (most grants are
	// one Mamba row and a KV run or two): no allocation for them.
	dstRoom     [2][]byte
	extRoom     [2]extState
	finished    bool // finish ran
	quarantined bool // failed while a live writer was inside a copy (quarantine)
}

// ID returns the grant id.
func (g *Grant) ID() uint64 { return g.id }

// RequestID returns the request the grant was opened for.
func (g *Grant) RequestID() uint64 { return g.ticket.RequestID }

// Ticket returns what the writer needs; the extents slice is a copy.
func (g *Grant) Ticket() Ticket {
	t := g.ticket
	t.Extents = append([]Extent(nil), t.Extents...)
	g.mu.Lock()
	t.Epoch = g.epoch
	g.mu.Unlock()
	return t
}

// Done is closed once the grant reached a terminal state (committed, revoked,
// expired, refused) and no byte can land in it any more: from then on its
// destination may be reused. A quarantined grant is terminal (failed) before
// Done closes.
func (g *Grant) Done() <-chan struct{} { return g.done }

// Failed is closed once the grant ended without a commit (revoked, expired,
// refused); it stays open for a committed grant. It closes with Done, or
// before it for a quarantined grant. A receiver that learns of the commit
// some other way (the writer's reply) watches Failed until then, and is not
// woken by a commit it has no use for yet.
func (g *Grant) Failed() <-chan struct{} { return g.failed }

// Quarantined reports whether the grant failed while a live writer was still
// inside a copy into its destination and could not be fenced within
// Config.FenceWait (a stopped or frozen process). Until Done is closed the
// destination must stay out of use: the engine keeps it busy (OpenGrant
// refuses it) and closes Done once the copy ended or the writer exited.
func (g *Grant) Quarantined() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.quarantined && !g.finished
}

// Wait blocks until the grant is Done or ctx ends. It returns the
// verified manifest when the writer's commit was accepted; otherwise the
// terminal error (ErrRevoked, ErrDeadline, ErrManifestMismatch,
// ErrPeerClosed, ...) or ctx.Err(). Cancelling ctx does not revoke the grant.
func (g *Grant) Wait(ctx context.Context) (Manifest, error) {
	select {
	case <-g.done:
	case <-ctx.Done():
		return Manifest{}, ctx.Err()
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.state != grantDone {
		return Manifest{}, g.err
	}
	return Manifest{Bytes: append([]uint64(nil), g.manifest.Bytes...), CRC: append([]uint32(nil), g.manifest.CRC...)}, nil
}

// Err returns nil while the grant is open or after a successful commit, and
// the terminal error otherwise.
func (g *Grant) Err() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.err
}

// Revoke fences the grant: its epoch moves on, every later frame is refused,
// and in-flight landings are finished or aborted before Revoke returns, so on
// return no further byte lands and the destination may be reused, with one
// exception: a writer that stores into memory it mapped (shm) and is alive
// but does not end its copy within Config.FenceWait (stopped, frozen) leaves
// the grant quarantined, and the destination may be reused only once Done is
// closed. Revoke returns within
// about FenceWait whatever the writer does. A committed grant stays
// committed. Revoke is idempotent.
func (g *Grant) Revoke() {
	g.terminate(nil)
}

// checkLocked validates a frame's epoch and token against the grant.
// g.mu is held.
func (g *Grant) checkLocked(epoch uint64, token *[16]byte) error {
	if subtle.ConstantTimeCompare(token[:], g.ticket.Token[:]) != 1 {
		return fmt.Errorf("%w: grant %d", ErrBadToken, g.id)
	}
	switch g.state {
	case grantDone:
		return fmt.Errorf("%w: grant %d", ErrCommitted, g.id)
	case grantCommitting:
		return fmt.Errorf("%w: grant %d is committing", ErrCommitted, g.id)
	case grantFailed:
		if epoch != g.epoch {
			return fmt.Errorf("%w: epoch %d, grant %d is at %d: %w", ErrStaleEpoch, epoch, g.id, g.epoch, g.err)
		}
		return g.err
	}
	if epoch != g.epoch {
		return fmt.Errorf("%w: epoch %d, grant %d is at %d", ErrStaleEpoch, epoch, g.id, g.epoch)
	}
	return nil
}

func (g *Grant) expired(now time.Time) bool {
	return !g.ticket.Deadline.IsZero() && !now.Before(g.ticket.Deadline)
}

func (g *Grant) deadlineErr() error {
	return fmt.Errorf("%w: grant %d (request %d) at %s", ErrDeadline, g.id, g.ticket.RequestID, g.ticket.Deadline.Format(time.RFC3339Nano))
}

// commit verifies a writer's manifest against what landed and completes or
// fails the grant. counted is false for transports whose data does not pass
// through the receiver (shm): then the byte count is the one the writers
// kept themselves (fence.stored: shm's is in the grant's slot), and the
// checksums are the writer's own, taken over the destination right after
// each copy (or, with Config.VerifySHM, computed again here over the
// extents as they are after the fence).
// hasCRC is false for a SkipCRC commit.
func (g *Grant) commit(epoch uint64, token *[16]byte, m *Manifest, counted, hasCRC bool) error {
	g.mu.Lock()
	if err := g.checkLocked(epoch, token); err != nil {
		g.mu.Unlock()
		return err
	}
	if g.expired(time.Now()) {
		g.mu.Unlock()
		err := g.deadlineErr()
		g.terminate(err)
		return err
	}
	g.state = grantCommitting
	for g.inflight > 0 {
		g.quiet.Wait()
	}
	dst, ext, dev := g.dst, g.ext, g.dev // finish may drop them once a revoke settles the grant
	g.mu.Unlock()

	// Fence every transport: after this no writer can store into g (shm:
	// its slot is closed), or g is quarantined.
	var verr error
	fenced := g.e.fence(g, g.e.cfg.FenceWait)
	if fenced {
		var copied uint64
		if !counted {
			copied = g.e.stored(g)
		}
		verr = g.verify(dst, dev, ext, m, counted, hasCRC, copied)
	} else {
		verr = fmt.Errorf("%w: grant %d: a writer is still inside a copy into it after %s", ErrQuarantined, g.id, g.e.cfg.FenceWait)
	}

	g.mu.Lock()
	if g.state != grantCommitting { // revoked or expired while verifying
		err := g.err
		g.mu.Unlock()
		<-g.ended
		return err
	}
	if verr != nil {
		g.settleLocked(grantFailed, verr)
	} else {
		g.manifest = Manifest{Bytes: append([]uint64(nil), m.Bytes...), CRC: append([]uint32(nil), m.CRC...)}
		g.settleLocked(grantDone, nil)
	}
	g.mu.Unlock()
	g.end(fenced)
	return verr
}

// verify compares m with the grant's extents. No landing is in flight and
// none can start (state committing, every transport fenced). copied is the
// byte count the writers recorded themselves (counted false).
func (g *Grant) verify(dst [][]byte, dev []devSpan, ext []extState, m *Manifest, counted, hasCRC bool, copied uint64) error {
	if !hasCRC && !g.e.cfg.SkipCRC {
		return fmt.Errorf("%w: commit without crc32c, and this receiver requires it (grant %d)", ErrManifestMismatch, g.id)
	}
	n := len(dst)
	if len(m.Bytes) != n || len(m.CRC) != n {
		return fmt.Errorf("%w: manifest lists %d/%d extents, grant %d has %d", ErrManifestMismatch, len(m.Bytes), len(m.CRC), g.id, n)
	}
	if !counted && copied != g.ticket.Bytes {
		return fmt.Errorf("%w: %d bytes copied into grant %d, want %d", ErrManifestMismatch, copied, g.id, g.ticket.Bytes)
	}
	// shm: the writer summed the destination right after copying it, while
	// it was in cache; re-reading it all here would cost more than the copy.
	// The writer maps the whole region anyway (same user, 0600 socket), so
	// its sums are trusted unless Config.VerifySHM asks otherwise.
	recompute := counted || g.e.cfg.VerifySHM
	var sumBytes uint64 // bytes whose crc must be computed now
	for i := range dst {
		want := g.ticket.Extents[i].Length
		if m.Bytes[i] != want {
			return fmt.Errorf("%w: extent %d: manifest says %d bytes, extent has %d (grant %d)", ErrManifestMismatch, i, m.Bytes[i], want, g.id)
		}
		st := &ext[i]
		if counted && st.landed != want {
			return fmt.Errorf("%w: extent %d: %d bytes landed, want %d (grant %d)", ErrManifestMismatch, i, st.landed, want, g.id)
		}
		if _, ok := st.crcOf(want); hasCRC && !(counted && ok) {
			sumBytes += want
		}
	}
	if !hasCRC || !recompute {
		return nil
	}
	workers := min(runtime.GOMAXPROCS(0), maxVerifyWorkers, n)
	if sumBytes < parallelVerifyMin || workers < 2 {
		for i := range n {
			crc, err := g.extentCRC(i, dst, dev, ext, counted)
			if err != nil {
				return err
			}
			if crc != m.CRC[i] {
				return fmt.Errorf("%w: extent %d: crc32c %08x landed, manifest says %08x (grant %d)", ErrManifestMismatch, i, crc, m.CRC[i], g.id)
			}
		}
		return nil
	}
	// The writer is idle waiting for the verdict: use the other cores.
	crcs := make([]uint32, n)
	errs := make([]error, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				crcs[i], errs[i] = g.extentCRC(i, dst, dev, ext, counted)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	for i, crc := range crcs {
		if crc != m.CRC[i] {
			return fmt.Errorf("%w: extent %d: crc32c %08x landed, manifest says %08x (grant %d)", ErrManifestMismatch, i, crc, m.CRC[i], g.id)
		}
	}
	return nil
}

// extentCRC returns the crc32c of landed extent i: the one kept while it
// landed (in order and in segments), else computed over its bytes (read
// back from the device for a device extent).
func (g *Grant) extentCRC(i int, dst [][]byte, dev []devSpan, ext []extState, counted bool) (uint32, error) {
	n := g.ticket.Extents[i].Length
	if crc, ok := ext[i].crcOf(n); counted && ok {
		return crc, nil
	}
	if dev != nil && dev[i].a != nil {
		crc, err := g.e.deviceCRC(dev[i], n)
		if err != nil {
			return 0, fmt.Errorf("rdma: reading extent %d of grant %d back from the device: %w", i, g.id, err)
		}
		return crc, nil
	}
	return crc32c.Checksum(dst[i]), nil
}

const (
	// parallelVerifyMin is the commit size from which the receiver sums
	// extents on several cores.
	parallelVerifyMin = 1 << 20
	maxVerifyWorkers  = 4
)

// settleLocked moves the grant to a terminal state. g.mu is held.
func (g *Grant) settleLocked(s grantState, err error) {
	g.state = s
	g.err = err
	if s == grantFailed {
		g.epoch = g.e.newEpoch()
	}
}

// terminate fails the grant with cause (nil: revoked) unless it is already
// terminal, fences it on every transport (fence.go: in-flight landings are
// aborted and waited for, shm's slot closed), and returns once nothing can
// land or the grant is quarantined.
func (g *Grant) terminate(cause error) {
	g.mu.Lock()
	switch g.state {
	case grantDone, grantFailed:
		for g.inflight > 0 {
			g.quiet.Wait()
		}
		g.mu.Unlock()
		<-g.ended
		return
	}
	if cause == nil { // built only here: a committed grant is revoked after every delivery
		cause = fmt.Errorf("%w: grant %d (request %d)", ErrRevoked, g.id, g.ticket.RequestID)
	}
	g.settleLocked(grantFailed, cause)
	g.mu.Unlock()
	g.end(g.e.fence(g, g.e.cfg.FenceWait))
}

// end completes a settled grant: finish when nothing can land any more
// (fenced), quarantine while a live writer may still store into it.
func (g *Grant) end(fenced bool) {
	if fenced {
		g.finish()
	} else {
		g.quarantine()
	}
}

// quarantine ends a failed grant that a fence reported a live writer may
// still store into (shm: stopped or frozen inside a copy): Revoke returns
// and Failed closes now, while Done, the busy spans that keep OpenGrant off
// the destination, and what the fences hold for it (shm: the slot) wait
// until every fence could fence it (Engine.watchQuarantine: the writer's
// bracket ended or its process exited).
func (g *Grant) quarantine() {
	g.mu.Lock()
	if g.finished || g.quarantined {
		g.mu.Unlock()
		return
	}
	g.quarantined = true
	err := g.err
	g.mu.Unlock()
	e := g.e
	e.stats.grantsQuarantined.Add(1)
	e.stats.quarantinedBytes.Add(int64(g.ticket.Bytes))
	e.log.Warn("rdma: grant quarantined: a live writer is still inside a copy into it; its destination stays out of use until the copy ends or the writer exits",
		"grant", g.id, "request", g.ticket.RequestID, "bytes", g.ticket.Bytes, "err", err)
	close(g.failed)
	g.endOne.Do(func() { close(g.ended) })
	e.mu.Lock()
	watch := !e.closed
	if watch {
		e.quarantines.Add(1)
		e.watched[g] = struct{}{}
	}
	e.mu.Unlock()
	if !watch { // the engine is closing: its regions are about to go
		g.finish()
		return
	}
	go e.watchQuarantine(g)
}

// finish releases the grant's resources once; the state is terminal and
// nothing can land any more.
func (g *Grant) finish() {
	g.mu.Lock()
	if g.finished {
		g.mu.Unlock()
		return
	}
	g.finished = true
	quarantined := g.quarantined
	// A settled grant stays findable for a while (late frames get the exact
	// reason) but no longer needs its per-extent state.
	g.dst, g.dev, g.ext, g.landers = nil, nil, nil, nil
	g.mu.Unlock()
	g.e.retire(g)
	err := g.Err()
	// Count before the channels close: whoever returns from Revoke or Done
	// (a second terminate waits on ended) sees the grant settled in Stats.
	if err == nil {
		g.e.stats.grantsCommitted.Add(1)
		g.e.stats.bytesLanded.Add(g.ticket.Bytes)
	} else {
		g.e.stats.grantsFailed.Add(1)
	}
	if quarantined {
		g.e.stats.quarantinedBytes.Add(-int64(g.ticket.Bytes))
	} else if err != nil {
		close(g.failed)
	}
	g.endOne.Do(func() { close(g.ended) })
	close(g.done)
	if g.e.log.Enabled(context.Background(), slog.LevelDebug) { // the arguments would allocate
		g.e.log.Debug("rdma: grant settled", "grant", g.id, "request", g.ticket.RequestID, "err", err)
	}
}

// crc32Update extends a crc32c with b (internal/crc32c: vector folding
// where the core has it, else hash/crc32's SSE4.2/ARMv8 instructions).
func crc32Update(crc uint32, b []byte) uint32 { return crc32c.Update(crc, b) }
