//go:build linux

package rdma

// cutSHMWriters closes the shm control connections e serves.
func cutSHMWriters(e *Engine) int {
	if e.shm == nil {
		return 0
	}
	n := 0
	e.shm.mu.Lock()
	for c := range e.shm.conns {
		c.c.Close()
		n++
	}
	e.shm.mu.Unlock()
	return n
}

// shmConns counts the shm control connections e serves.
func shmConns(e *Engine) int {
	if e.shm == nil {
		return 0
	}
	e.shm.mu.Lock()
	defer e.shm.mu.Unlock()
	return len(e.shm.conns)
}

// shmWriting reports, when called, whether a writer is inside a copy
// bracket of g's slot of e's shm table.
func shmWriting(e *Engine, g *Grant) func() bool {
	sl := slotAt(e.shm.table, e.shm.slotOf(g.ID()))
	return func() bool { return wordState(sl.state().Load()) == slotWriting }
}
