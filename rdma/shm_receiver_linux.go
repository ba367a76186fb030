//go:build linux

package rdma

// The shm receiver: shmServer accepts same-host writers on its unix control
// socket, hands them the memfds of its regions and slot table, keeps track
// of each writer's process, and fences grants on the slot table
// (shm_slot_linux.go). Its connections are served by rxConn
// (tcp_receiver.go), which carries no data frames on shm.

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

type shmServer struct {
	e     *Engine
	path  string
	ln    *net.UnixListener
	fd    int    // slot table memfd
	table []byte // slot table
	n     int    // slots

	owner []*Grant // guarded by e.mu

	mu      sync.Mutex
	conns   map[*rxConn]struct{}
	writers map[uint64]*shmWriter // writer ids in use
	nextWid uint64
	closed  bool
	wg      sync.WaitGroup
}

// shmWriter is what the receiver knows of one writer id: the process behind
// its control connection, and whether that connection is still open. An id
// stays in use until its process exited, or until the writer itself closed
// the connection and no slot shows the id copying: a writer lets a
// connection go only after every copy under its id ended.
type shmWriter struct {
	pid    int  // SO_PEERCRED; 0 when not visible from here
	pidfd  int  // pidfd_open(pid); -1 when unavailable
	open   bool // the control connection is open
	hungUp bool // the writer closed it (not the receiver)
}

// gone reports whether the writer can no longer store into a mapping: its
// process exited. s.mu is held.
func (w *shmWriter) gone() bool {
	switch {
	case w.pidfd >= 0:
		fds := []unix.PollFd{{Fd: int32(w.pidfd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, 0)
		return err == nil && n > 0 && fds[0].Revents&unix.POLLIN != 0
	case w.pid > 0:
		return unix.Kill(w.pid, 0) == unix.ESRCH
	default:
		// Another pid namespace: the connection is all there is to go by.
		return !w.open
	}
}

func (w *shmWriter) release() {
	if w.pidfd >= 0 {
		unix.Close(w.pidfd)
		w.pidfd = -1
	}
}

// peerProcess returns the pid of the process at the other end of c and a
// pidfd for it (-1 when pidfd_open is unavailable); pid 0 when the kernel
// cannot tell (the peer lives in a pid namespace not visible from here).
func peerProcess(c *net.UnixConn) (pid, pidfd int) {
	pidfd = -1
	raw, err := c.SyscallConn()
	if err != nil {
		return 0, -1
	}
	var cred *unix.Ucred
	_ = raw.Control(func(fd uintptr) {
		cred, err = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	})
	if err != nil || cred == nil || cred.Pid <= 0 {
		return 0, -1
	}
	pid = int(cred.Pid)
	if fd, err := unix.PidfdOpen(pid, 0); err == nil {
		pidfd = fd
	}
	return pid, pidfd
}

func defaultShmPath(agent AgentID) string {
	clean := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' {
			return r
		}
		return '_'
	}, string(agent))
	if len(clean) > 32 {
		clean = clean[:32]
	}
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	return filepath.Join(os.TempDir(), fmt.Sprintf("handoff-%s-%d-%x.sock", clean, os.Getpid(), rnd))
}

func startSHM(e *Engine, path string) (*shmServer, error) {
	if path == "" {
		path = defaultShmPath(e.cfg.Agent)
	}
	n := e.cfg.MaxGrants
	table, fd, err := allocShared("grant-slots", int64(n*slotSize))
	if err != nil {
		return nil, err
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		freeShared(table, fd)
		return nil, fmt.Errorf("rdma: shm listen %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(true)
	// A peer that connects maps whole regions: only this user may.
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		freeShared(table, fd)
		return nil, fmt.Errorf("rdma: shm socket %s: %w", path, err)
	}
	s := &shmServer{e: e, path: path, ln: ln, fd: fd, table: table, n: n, owner: make([]*Grant, n),
		conns: make(map[*rxConn]struct{}), writers: make(map[uint64]*shmWriter)}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

func (s *shmServer) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || !s.e.acceptAgain("shm", err) {
				return
			}
			continue
		}
		rc := newRxConn(s.e, c, TransportSHM)
		pid, pidfd := peerProcess(c)
		if pid == 0 {
			s.e.log.Warn("rdma: shm writer's process is not visible from here (pid namespace): its death is inferred from its control connection")
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			(&shmWriter{pidfd: pidfd}).release()
			continue
		}
		wid, ok := s.newWriterLocked(&shmWriter{pid: pid, pidfd: pidfd, open: true})
		if !ok {
			s.mu.Unlock()
			s.e.log.Warn("rdma: shm refuses a writer: all writer ids in use")
			c.Close()
			(&shmWriter{pidfd: pidfd}).release()
			continue
		}
		rc.shm = &shmRxState{s: s, wid: wid}
		s.conns[rc] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			rc.serve()
			s.mu.Lock()
			delete(s.conns, rc)
			s.mu.Unlock()
		}()
	}
}

// newWriterLocked gives w a writer id no slot can still name; s.mu is held.
func (s *shmServer) newWriterLocked(w *shmWriter) (uint64, bool) {
	s.reapLocked()
	for range 1 << slotWriterBits {
		s.nextWid = s.nextWid%(1<<slotWriterBits-1) + 1
		if s.writers[s.nextWid] == nil {
			s.writers[s.nextWid] = w
			return s.nextWid, true
		}
	}
	return 0, false
}

// reapLocked frees the ids of writers whose connection closed and that can
// no longer copy under them: their process exited, or they closed the
// connection themselves and no slot shows them copying. A live writer the
// receiver cut keeps its id. s.mu is held.
func (s *shmServer) reapLocked() {
	var copying map[uint64]bool
	for wid, w := range s.writers {
		if w.open {
			continue
		}
		if !w.gone() {
			if !w.hungUp {
				continue
			}
			if copying == nil {
				copying = make(map[uint64]bool)
				for i := range s.n {
					if st := slotAt(s.table, i).state().Load(); wordState(st) >= slotWriting {
						copying[wordWriter(st)] = true
					}
				}
			}
			if copying[wid] {
				continue
			}
		}
		w.release()
		delete(s.writers, wid)
	}
}

// writerGone reports whether writer wid can no longer store: its process
// exited (or its id was freed, which happens only then or once it stopped
// copying under it).
func (s *shmServer) writerGone(wid uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	w := s.writers[wid]
	return w == nil || w.gone()
}

func (s *shmServer) slotOf(id uint64) int { return int(id % uint64(s.n)) }

// slotFree reports whether id's slot is unused; e.mu is held.
func (s *shmServer) slotFree(id uint64) bool { return s.owner[s.slotOf(id)] == nil }

// open makes g's slot open for writers; e.mu is held.
func (s *shmServer) open(g *Grant) {
	i := s.slotOf(g.id)
	s.owner[i] = g
	sl := slotAt(s.table, i)
	sl.grant().Store(g.id)
	sl.token0().Store(binary.LittleEndian.Uint64(g.ticket.Token[0:]))
	sl.token1().Store(binary.LittleEndian.Uint64(g.ticket.Token[8:]))
	sl.digest().Store(extentsDigest(g.ticket.Extents))
	sl.deadline().Store(uint64(g.ticket.Deadline.UnixNano()))
	sl.writer().Store(0)
	sl.copied().Store(0)
	sl.state().Store(slotWord(slotOpen, 0, g.epoch))
}

// stored returns the bytes writers recorded copying into g's slot.
func (s *shmServer) stored(g *Grant) uint64 {
	sl := slotAt(s.table, s.slotOf(g.id))
	if sl.grant().Load() != g.id {
		return 0
	}
	return sl.copied().Load()
}

// release frees g's slot after it was fenced; e.mu is held.
func (s *shmServer) release(g *Grant) {
	if i := s.slotOf(g.id); s.owner[i] == g {
		s.owner[i] = nil
	}
}

// fence closes g's slot so that no writer starts another copy into it, and
// waits up to wait for a copy in progress to end. It reports whether the
// slot is closed: false means a live writer is still inside a bracket after
// wait (stopped or frozen); the slot then says fencing, and the writer closes
// it itself when its bracket ends. Only words of g's own epoch are touched:
// a slot that another grant reuses is not g's to close.
func (s *shmServer) fence(g *Grant, wait time.Duration) bool {
	sl := slotAt(s.table, s.slotOf(g.id))
	epoch := g.ticket.Epoch & slotEpochMask
	closed := slotWord(slotClosed, 0, epoch)
	var until time.Time
	for spins := 0; ; spins++ {
		if sl.grant().Load() != g.id {
			return true
		}
		w := sl.state().Load()
		if wordEpoch(w) != epoch {
			return true
		}
		switch wordState(w) {
		case slotClosed:
			return true
		case slotOpen:
			if sl.state().CompareAndSwap(w, closed) {
				return true
			}
			continue
		case slotWriting, slotFencing:
			wid := wordWriter(w)
			if s.writerGone(wid) {
				// Its process exited: nothing more can be stored.
				sl.state().CompareAndSwap(w, closed)
				continue
			}
			if wordState(w) == slotWriting {
				sl.state().CompareAndSwap(w, slotWord(slotFencing, wid, epoch))
				continue
			}
		}
		// A bracket copies at most shmBracket bytes: wait it out, within wait.
		now := time.Now()
		if until.IsZero() {
			until = now.Add(wait)
			if f := s.e.testHooks().fenceWaits; f != nil {
				f(g)
			}
		}
		if !now.Before(until) {
			return false
		}
		if spins < 64 {
			runtime.Gosched()
		} else {
			time.Sleep(20 * time.Microsecond)
		}
	}
}

var _ slotted = (*shmServer)(nil)

func (s *shmServer) close() {
	s.mu.Lock()
	s.closed = true
	s.ln.Close()
	for c := range s.conns {
		c.c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	s.mu.Lock()
	for wid, w := range s.writers {
		w.release()
		delete(s.writers, wid)
	}
	s.mu.Unlock()
}

func (s *shmServer) unmap() {
	freeShared(s.table, s.fd)
	s.table = nil
}

// shmRxState is the receiver's view of one shm writer connection.
type shmRxState struct {
	s   *shmServer
	wid uint64
}

// hello answers a writer's hello with the slot table and the region memfds.
func (r *shmRxState) hello(c *rxConn) error {
	e := r.s.e
	e.mu.RLock()
	var fds []int
	var sb strings.Builder
	fmt.Fprintf(&sb, "%s\n%s\nwid=%d slots=%d regions=", e.cfg.Agent, c.peer, r.wid, r.s.n)
	fds = append(fds, r.s.fd)
	first := true
	for id := RegionID(1); int(id) <= len(e.regions); id++ {
		reg := e.regions[id]
		if reg == nil || reg.fd < 0 || len(fds) > maxShmRegions {
			continue
		}
		if !first {
			sb.WriteByte(',')
		}
		first = false
		fmt.Fprintf(&sb, "%d:%d", reg.id, len(reg.mem))
		fds = append(fds, reg.fd)
	}
	msg := sb.String()
	if len(msg) > maxMsgLen {
		e.mu.RUnlock()
		err := fmt.Errorf("%w: shm hello of %d bytes (too many regions)", ErrUnsupported, len(msg))
		c.reply(0, 0, err)
		return err
	}
	h := header{typ: frameHello, index: protocolVersion, length: uint64(len(msg))}
	b := make([]byte, headerSize, headerSize+len(msg))
	h.put(b)
	b = append(b, msg...)
	_, _, err := c.c.(*net.UnixConn).WriteMsgUnix(b, unix.UnixRights(fds...), nil)
	e.mu.RUnlock()
	if err != nil {
		return fmt.Errorf("%w: sending shm hello: %w", ErrPeerClosed, err)
	}
	return nil
}

func (r *shmRxState) commit(g *Grant, h *header, m *Manifest) error {
	return g.commit(h.epoch, &h.token, m, false, h.flags&flagNoCRC == 0)
}

// closed runs when the writer's control connection ended: grants it was
// copying into, or had copied into without committing, fail. Their fences
// wait for a bracket the writer is still in: a connection the receiver cut
// says nothing about the writer's process. hungUp: the writer closed it.
func (r *shmRxState) closed(cause error, hungUp bool) {
	s := r.s
	s.mu.Lock()
	if w := s.writers[r.wid]; w != nil {
		w.open, w.hungUp = false, hungUp
	}
	s.reapLocked()
	s.mu.Unlock()
	var abandoned []*Grant
	s.e.mu.RLock()
	for i, g := range s.owner {
		if g == nil {
			continue
		}
		sl := slotAt(s.table, i)
		if sl.writer().Load() == r.wid || wordWriter(sl.state().Load()) == r.wid {
			abandoned = append(abandoned, g)
		}
	}
	s.e.mu.RUnlock()
	for _, g := range abandoned {
		g.terminate(fmt.Errorf("%w: the control connection of shm writer %d ended before its commit: %v", ErrPeerClosed, r.wid, cause))
	}
}
