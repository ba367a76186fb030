//go:build linux

package rdma

// The shm writer's holds on its writer ids: a reconnect retires the old
// control connection, but the receiver fails the uncommitted grants of a
// writer id whose connection closed, so a retired connection stays open
// while a write that copied under its id has not committed (hold,
// unhold, retire), and, for a Stream, until its commit or abort
// (holdStream, endStream).

// streamHold is a Stream's hold on the writer id it last copied under.
type streamHold struct {
	wid, epoch uint64
	release    func()
}

// hold counts a write copying under writer id wid, until unhold.
func (l *shmLink) hold(wid uint64) {
	l.genMu.Lock()
	l.users[wid]++
	l.genMu.Unlock()
}

// unhold ends a write's hold on wid and releases wid's retired connection
// when that was its last user.
func (l *shmLink) unhold(wid uint64) {
	l.genMu.Lock()
	var r *shmConn
	if l.users[wid]--; l.users[wid] <= 0 {
		delete(l.users, wid)
		r = l.retired[wid]
		delete(l.retired, wid)
	}
	l.genMu.Unlock()
	if r != nil {
		releaseShm(r.conn, r.table, r.regions)
	}
}

// retire lets a replaced connection go once no write holds its writer id.
func (l *shmLink) retire(wid uint64, c *shmConn) {
	l.genMu.Lock()
	if l.users[wid] > 0 {
		l.retired[wid] = c
		c = nil
	}
	l.genMu.Unlock()
	if c != nil {
		releaseShm(c.conn, c.table, c.regions)
	}
}

// holdStream keeps release, the hold of a stream's part on writer id wid,
// until the stream commits or aborts (endStream): the receiver fails the
// uncommitted grants a writer id tagged once its control connection
// closes, and a reconnect between two parts (another write's cut
// exchange, a region registered after the hello) retires the connection
// the first part copied under. A stream keeps one hold, on the writer id
// of its last part: the earlier one is let go, its slot tagged anew.
func (l *shmLink) holdStream(t *Ticket, wid uint64, release func()) {
	l.copying.RLock() // the slot table, for staleStreamsLocked
	defer l.copying.RUnlock()
	l.genMu.Lock()
	old, had := l.streams[t.Grant]
	keep := !had || old.wid != wid || old.epoch != t.Epoch
	if keep {
		l.streams[t.Grant] = streamHold{wid: wid, epoch: t.Epoch, release: release}
	}
	stale := l.staleStreamsLocked(false)
	l.genMu.Unlock()
	if !keep {
		release() // held already
	} else if had {
		old.release()
	}
	for _, r := range stale {
		r()
	}
}

// endStream lets go the hold of grant's stream, if it has one.
func (l *shmLink) endStream(grant uint64) {
	l.copying.RLock() // the slot table, for staleStreamsLocked
	defer l.copying.RUnlock()
	l.genMu.Lock()
	h, ok := l.streams[grant]
	delete(l.streams, grant)
	stale := l.staleStreamsLocked(false)
	l.genMu.Unlock()
	if ok {
		h.release()
	}
	for _, r := range stale {
		r()
	}
}

// staleStreamsLocked forgets the holds of streams whose grant's slot is no
// longer theirs (a stream given up without commit or abort: a cancelled
// layer-by-layer prefill) and returns their releases. It looks when asked
// (all: at a reconnect), while a retired connection waits for its users
// (which such a hold would keep open for good), and once the holds
// outnumber the receiver's slots twice. genMu and copying (R or W) are
// held.
func (l *shmLink) staleStreamsLocked(all bool) []func() {
	if l.table == nil || !all && len(l.retired) == 0 && len(l.streams) <= 2*l.n {
		return nil
	}
	var out []func()
	for g, h := range l.streams {
		sl := slotAt(l.table, int(g%uint64(l.n)))
		w := sl.state().Load()
		if sl.grant().Load() != g || wordEpoch(w) != h.epoch&slotEpochMask || (wordState(w) != slotOpen && wordState(w) != slotWriting) {
			delete(l.streams, g)
			out = append(out, h.release)
		}
	}
	return out
}
