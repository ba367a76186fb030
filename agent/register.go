package agent

// An engine's registration: the memory it shares once, mapped as the
// regions of its own rdma.Engine, and the lookups of what it registered.

import (
	"fmt"
	"time"

	"github.com/handoff-io/handoff/rdma"
)

// register maps the engine's memory (the fds passed with the message: the
// KV pool's, then the Mamba pool's, or the host buffers' in order) as the
// regions of a new rdma.Engine and forbids the reserved rows in it.
func (s *session) register(q Request) (_ Reply, err error) {
	defer func() {
		if err != nil {
			// Descriptors passed with a refused registration are its own:
			// a retry passes its own, and must not take these.
			s.fc.closeFDs()
		}
	}()
	bufs, buffered := q.Buffers, len(q.Buffers) > 0
	if !buffered {
		bufs = []Buffer{{Bytes: q.KVBytes, CUDA: q.KVCUDA}, {Bytes: q.MambaBytes, CUDA: q.MambaCUDA}}
	}
	n := 0 // the buffers in host memory and VMM allocations come as fds
	for _, b := range bufs {
		if b.passesFD() {
			n++
		}
	}
	fds, err := s.fc.take(n)
	if err != nil {
		return Reply{}, err
	}
	defer func() {
		for _, fd := range fds {
			closeFD(fd) // rdma keeps duplicates of what it maps
		}
	}()
	if extra := s.fc.queued(); extra > 0 {
		return Reply{}, fmt.Errorf("%w: %d descriptors passed, the registration's memory takes %d", ErrBadRequest, n+extra, n)
	}
	if len(bufs) > maxBuffers {
		return Reply{}, fmt.Errorf("%w: %d buffers, at most %d", ErrInvalidLayout, len(bufs), maxBuffers)
	}
	mems, err := describeBuffers(bufs, fds, buffered)
	if err != nil {
		return Reply{}, err
	}
	s.mu.Lock()
	registered := s.eng != nil
	s.mu.Unlock()
	if registered {
		return Reply{}, ErrRegistered
	}
	// Claimed before s.mu (it takes Agent.mu, which comes first); a
	// session's requests are handled one at a time, so it is still
	// unregistered below.
	if err := s.a.claimFiles(s, hostFiles(bufs, mems)); err != nil {
		return Reply{}, err
	}
	defer func() {
		if err != nil {
			s.a.releaseFiles(s)
		}
	}()
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case q.Layout == nil:
		return Reply{}, fmt.Errorf("%w: no layout", ErrInvalidLayout)
	case buffered && (q.KVBytes != 0 || q.MambaBytes != 0 || q.KVCUDA != nil || q.MambaCUDA != nil):
		return Reply{}, fmt.Errorf("%w: memory registered both by pool and by buffers", ErrInvalidLayout)
	}
	p, err := compile(*q.Layout, buffered)
	if err != nil {
		return Reply{}, err
	}
	if err := checkBuffers(p.kvAt, p.mamAt, mems); err != nil {
		return Reply{}, err
	}
	cfg := s.a.cfg
	id := rdma.AgentID(fmt.Sprintf("%s#%d", cfg.Name, s.a.gen.Add(1)))
	eng, err := rdma.New(rdma.Config{Agent: id, Transports: cfg.Transports, TCPAddr: cfg.TCPAddr, Advertise: cfg.Advertise,
		FenceWait: cfg.FenceWait, GrantTTL: cfg.GrantTTL, Logger: s.log})
	if err != nil {
		return Reply{}, err
	}
	fail := func(err error) (Reply, error) {
		eng.Close()
		s.closeArenas()
		s.bufs = nil
		return Reply{}, err
	}
	arenas, err := s.openBuffers(bufs, mems)
	if err != nil {
		return fail(err)
	}
	s.bufs = make([]*rdma.Region, len(bufs))
	for i, b := range bufs {
		var r *rdma.Region
		switch {
		case b.Bytes == 0:
			continue
		case arenas[i] != nil:
			r, err = eng.RegisterDevice(mems[i].name, arenas[i])
		default:
			r, err = eng.RegisterFD(mems[i].name, mems[i].fd, b.Bytes)
		}
		if err != nil {
			return fail(err)
		}
		s.bufs[i] = r
	}
	for _, r := range p.reserved {
		for _, pt := range p.mamAt.parts { // each plane's part of the row
			s.bufs[pt.buf].Forbid(pt.off+uint64(r)*pt.stride, pt.len)
		}
	}
	s.eng, s.pools = eng, p
	d := eng.Descriptor()
	ts := make([]string, len(d.Transports))
	for i, t := range d.Transports {
		ts[i] = string(t)
	}
	s.log.Info("agent: engine registered", "rdma_agent", id, "fingerprint", p.fingerprint, "tp", p.l.TP, "kv_bytes", p.kvBytes(), "mamba_bytes", p.mambaBytes(),
		"buffers", len(bufs), "memory", memoryOf(bufs))
	return Reply{Fingerprint: p.fingerprint, AgentID: string(id), Transports: ts}, nil
}

// regions names the registered regions, by buffer (0 where none).
func (s *session) regions() []rdma.RegionID {
	s.mu.Lock()
	defer s.mu.Unlock()
	return regionIDs(s.bufs)
}

func regionIDs(rs []*rdma.Region) []rdma.RegionID {
	ids := make([]rdma.RegionID, len(rs))
	for i, r := range rs {
		if r != nil {
			ids[i] = r.ID()
		}
	}
	return ids
}

// registration returns the engine and pools, or ErrNotRegistered.
func (s *session) registration() (*rdma.Engine, *pools, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.eng == nil {
		return nil, nil, ErrNotRegistered
	}
	return s.eng, s.pools, nil
}

// named returns the registration and the row of a request that names
// blocks and a row (a grant, a send), both checked against it.
func (s *session) named(q Request) (*rdma.Engine, *pools, int, error) {
	eng, p, err := s.registration()
	if err != nil {
		return nil, nil, 0, err
	}
	row := rowOf(q)
	if err := p.checkNames(q.Blocks, row); err != nil {
		return nil, nil, 0, err
	}
	return eng, p, row, nil
}

func rowOf(q Request) int {
	if q.Row == nil {
		return -1
	}
	return *q.Row
}

// reuseWait bounds how long a registration waits for another connection
// holding the same host memory to end (awaitFiles).
const reuseWait = 5 * time.Second

// claimFiles takes the files of a registration's host memory for s,
// waiting while another connection holds any of them (an engine that
// re-registers may do so before its old connection's end let the memory
// go, or two connections register at once): a registration over memory
// that another one may still receive into would give the same bytes to
// two grants. Past reuseWait the registration is refused. The claim lasts
// until the registration fails or its session ended (releaseFiles).
func (a *Agent) claimFiles(s *session, files []string) error {
	t := time.NewTimer(reuseWait)
	defer t.Stop()
	for {
		a.mu.Lock()
		var holder *session
		for _, f := range files {
			if o := a.files[f]; o != nil && o != s {
				holder = o
				break
			}
		}
		if holder == nil {
			for _, f := range files {
				a.files[f] = s
			}
			a.mu.Unlock()
			return nil
		}
		freed := a.freed
		a.mu.Unlock()
		select {
		case <-freed:
		case <-a.ctx.Done():
			return ErrClosed
		case <-t.C:
			if holder.ctx.Err() != nil {
				return fmt.Errorf("%w: the memory passed is still the registration of engine pid %d, which ended but whose grants a writer is still copying into: retry", rdma.ErrQuarantined, holder.pid)
			}
			return fmt.Errorf("%w: the memory passed is registered by the live connection of engine pid %d", ErrRegistered, holder.pid)
		}
	}
}

// releaseFiles lets go of s's claims and wakes the registrations waiting.
func (a *Agent) releaseFiles(s *session) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for f, o := range a.files {
		if o == s {
			delete(a.files, f)
		}
	}
	close(a.freed)
	a.freed = make(chan struct{})
}
