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
