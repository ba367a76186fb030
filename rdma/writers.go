package rdma

// Writer liveness. A writer engine keeps its connections to a receiver open
// between writes (pooled tcp connections, the shm control socket), so when
// the last of them closes the writer has closed its engine or died: the
// kernel closes a killed process's sockets at once. A receiver that waits for
// that writer's data learns it then, not at its grant's deadline.

// OnWriterGone registers f, called with a writer's agent id when the last
// connection from it closes (a writer process killed with SIGKILL, an engine
// closed, a writer host whose connections reset). f runs on the connection's
// goroutine and must not block; it is not called once this engine is
// closing. A writer whose connections all failed and that dials again is
// reported too: treat the report as "its writes in flight are lost".
func (e *Engine) OnWriterGone(f func(AgentID)) {
	e.writersMu.Lock()
	defer e.writersMu.Unlock()
	e.onWriterGone = append(e.onWriterGone, f)
}

// writerUp counts a connection from agent that passed its hello.
func (e *Engine) writerUp(agent AgentID) {
	e.writersMu.Lock()
	defer e.writersMu.Unlock()
	if e.writers == nil {
		e.writers = make(map[AgentID]int)
	}
	e.writers[agent]++
}

// writerDown uncounts one; the last one reports the writer gone.
func (e *Engine) writerDown(agent AgentID) {
	e.writersMu.Lock()
	e.writers[agent]--
	if e.writers[agent] > 0 {
		e.writersMu.Unlock()
		return
	}
	delete(e.writers, agent)
	fs := e.onWriterGone
	e.writersMu.Unlock()
	e.mu.RLock()
	closed := e.closed
	e.mu.RUnlock()
	if closed {
		return
	}
	e.log.Info("rdma: every connection from a writer closed", "writer", string(agent))
	for _, f := range fs {
		f(agent)
	}
}
