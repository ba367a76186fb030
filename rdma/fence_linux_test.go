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

// shmWriting reports, when called, whether a writer is inside a copy
// bracket of grant slot slot of e's shm table.
func shmWriting(e *Engine, slot int) func() bool {
	sl := slotAt(e.shm.table, slot)
	return func() bool { return wordState(sl.state().Load()) == slotWriting }
}
