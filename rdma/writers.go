package rdma

// Writer liveness. A writer engine keeps its connections to a receiver open
// between writes (pooled tcp connections, the shm control socket), so when
// the last of them closes the writer has closed its engine or died (the
// kernel closes a killed process's sockets at once), or something between
// the hosts reset every connection. A receiver that waits for that writer's
// data learns it then, not at its grant's deadline.

// OnWriterGone registers f, called with a writer's agent id when the writer
// closes its last connection to this engine: its process was killed (the
// kernel closes its sockets), its engine closed, its host reset the
// connections. A live writer engine never lets its last connection to a
// peer go without connecting again first (tcp replaces a broken connection,
// shm connects before it closes the old control socket), and a connection
// this engine cut itself is not reported, so a report means the writer is
// gone or unreachable. f runs on the connection's goroutine and must not
// block; it is not called once this engine is closing, nor after stop.
func (e *Engine) OnWriterGone(f func(AgentID)) (stop func()) {
	e.writersMu.Lock()
	defer e.writersMu.Unlock()
	e.nextWatch++
	id := e.nextWatch
	if e.onWriterGone == nil {
		e.onWriterGone = make(map[uint64]func(AgentID))
	}
	e.onWriterGone[id] = f
	return func() {
		e.writersMu.Lock()
		defer e.writersMu.Unlock()
		delete(e.onWriterGone, id)
	}
}

// WriterConnected reports whether agent holds a data-path connection to this
// engine that passed its hello.
func (e *Engine) WriterConnected(agent AgentID) bool {
	e.writersMu.Lock()
	defer e.writersMu.Unlock()
	return e.writers[agent] > 0
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

// writerDown uncounts one. The last one reports the writer gone when the
// writer's side ended it (byWriter): a live writer always holds a connection
// (it connects again before closing its last one), while a connection this
// engine cut (a fence, a malformed frame) says nothing about the writer.
func (e *Engine) writerDown(agent AgentID, byWriter bool) {
	e.writersMu.Lock()
	e.writers[agent]--
	if e.writers[agent] > 0 {
		e.writersMu.Unlock()
		return
	}
	delete(e.writers, agent)
	if !byWriter {
		e.writersMu.Unlock()
		return
	}
	fs := make([]func(AgentID), 0, len(e.onWriterGone))
	for _, f := range e.onWriterGone {
		fs = append(fs, f)
	}
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
