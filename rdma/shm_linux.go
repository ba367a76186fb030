//go:build linux

package rdma

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

const shmSupported = true

// Shared-memory transport.
//
// The receiver exports two things to a same-host writer over its unix
// control socket (SCM_RIGHTS): the memfds of its regions and the memfd of a
// grant slot table. Slot i (64 bytes) describes the open grant whose id is
// congruent to i modulo the table size:
//
//	off field
//	0   state word: epoch<<18 | writer<<2 | state (closed, open, writing, fencing)
//	8   grant id
//	16  token (2 words)
//	32  digest of the grant's extents (FNV-1a over region, offset, length)
//	40  deadline (unix nanoseconds)
//	48  id of the last writer that copied into the grant
//	56  bytes copied into the grant (added by writers, once per bracket)
//
// Epochs are unique per engine, so (state, epoch) names one grant
// incarnation, and a fence touches only the words of its own grant's epoch
// (a slot reused by another grant is not its to close). A writer brackets
// each copy of at most shmBracket bytes with CAS open(e) -> writing(e, w)
// and a CAS back to open(e); it never copies unless the first CAS
// succeeded. To fence (revoke, deadline, commit) the receiver CASes
// open(e) -> closed(e); finding writing(e, w), it CASes it to fencing(e, w),
// and the writer, whose closing CAS then fails, ends its bracket with
// fencing(e, w) -> closed(e) and copies no more. The receiver waits for that
// up to Config.FenceWait; a writer that does not end its bracket by then
// (stopped, frozen) leaves the grant failed and its destination quarantined
// until the bracket ends or the writer's process is gone.
//
// Death is never inferred from the socket: the receiver takes the writer's
// pid at accept (SO_PEERCRED) and opens a pidfd, which polls readable once
// the process exited. A connection the receiver cut itself (a malformed
// frame, an out-of-step stream) leaves a live writer live. Only where the
// pid cannot be known (another pid namespace) does a closed connection
// stand for the process, as it did before.
//
// No per-byte round trip: the data path is a memcpy into the mapped arena,
// and the commit travels once over the socket.
//
// The writer sums what landed: crc32c.CopyUpdate copies each chunk into the
// destination and sums the bytes from the registers that store them, in
// brackets of shmBracket bytes (the slot says "writing" during each).
const (
	slotSize   = 64
	shmBracket = 4 << 20   // bytes copied per CAS bracket: a fence waits for at most one (~0.4 ms at 10 GB/s)
	shmSubCopy = 256 << 10 // copied and summed in one pass (crc32c.CopyUpdate)

	slotClosed  = 0
	slotOpen    = 1
	slotWriting = 2
	slotFencing = 3 // writing, and a fence waits for the bracket to end

	slotWriterBits = 16
	slotEpochShift = 2 + slotWriterBits
	slotEpochMask  = 1<<(64-slotEpochShift) - 1
	maxShmRegions  = 200 // SCM_RIGHTS carries at most 253 fds
)

func slotWord(state, writer uint64, epoch uint64) uint64 {
	return (epoch&slotEpochMask)<<slotEpochShift | writer<<2 | state
}

func wordState(w uint64) uint64  { return w & 3 }
func wordWriter(w uint64) uint64 { return w >> 2 & (1<<slotWriterBits - 1) }
func wordEpoch(w uint64) uint64  { return w >> slotEpochShift }

// slotView addresses one slot of a mapped table.
type slotView struct{ b []byte }

func (s slotView) word(off int) *atomic.Uint64 {
	return (*atomic.Uint64)(unsafe.Pointer(&s.b[off]))
}
func (s slotView) state() *atomic.Uint64    { return s.word(0) }
func (s slotView) grant() *atomic.Uint64    { return s.word(8) }
func (s slotView) token0() *atomic.Uint64   { return s.word(16) }
func (s slotView) token1() *atomic.Uint64   { return s.word(24) }
func (s slotView) digest() *atomic.Uint64   { return s.word(32) }
func (s slotView) deadline() *atomic.Uint64 { return s.word(40) }
func (s slotView) writer() *atomic.Uint64   { return s.word(48) }
func (s slotView) copied() *atomic.Uint64   { return s.word(56) }

func slotAt(table []byte, i int) slotView { return slotView{table[i*slotSize : (i+1)*slotSize]} }

// extentsDigest hashes a grant's extent list, so a writer can check that
// its ticket names exactly the grant's extents. It is a word-wise FNV-1a
// variant with a final avalanche: cheap for thousands of extents, and any
// difference in region, offset, length or count changes it.
func extentsDigest(xs []Extent) uint64 {
	const prime = 1099511628211
	h := uint64(14695981039346656037) ^ uint64(len(xs))
	for _, x := range xs {
		h = (h ^ uint64(x.Region)) * prime
		h = (h ^ x.Offset) * prime
		h = (h ^ x.Length) * prime
	}
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	return h
}

// ----- receiver -----

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
			if !errors.Is(err, net.ErrClosed) {
				s.e.log.Warn("rdma: shm accept", "err", err)
			}
			return
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

// publish makes g's slot open for writers; e.mu is held.
func (s *shmServer) publish(g *Grant) {
	s.owner[g.slot] = g
	sl := slotAt(s.table, g.slot)
	sl.grant().Store(g.id)
	sl.token0().Store(binary.LittleEndian.Uint64(g.ticket.Token[0:]))
	sl.token1().Store(binary.LittleEndian.Uint64(g.ticket.Token[8:]))
	sl.digest().Store(extentsDigest(g.ticket.Extents))
	sl.deadline().Store(uint64(g.ticket.Deadline.UnixNano()))
	sl.writer().Store(0)
	sl.copied().Store(0)
	sl.state().Store(slotWord(slotOpen, 0, g.epoch))
}

// copied returns the bytes writers recorded copying into g's slot.
func (s *shmServer) copied(g *Grant) uint64 {
	sl := slotAt(s.table, g.slot)
	if sl.grant().Load() != g.id {
		return 0
	}
	return sl.copied().Load()
}

// release frees g's slot after it was fenced; e.mu is held.
func (s *shmServer) release(g *Grant) {
	if s.owner[g.slot] == g {
		s.owner[g.slot] = nil
	}
}

// fence closes g's slot so that no writer starts another copy into it, and
// waits up to wait for a copy in progress to end. It reports whether the
// slot is closed: false means a live writer is still inside a bracket after
// wait (stopped or frozen); the slot then says fencing, and the writer closes
// it itself when its bracket ends. Only words of g's own epoch are touched:
// a slot that another grant reuses is not g's to close.
func (s *shmServer) fence(g *Grant, wait time.Duration) bool {
	sl := slotAt(s.table, g.slot)
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

// ----- writer -----

// shmLink copies into a same-host peer's mapped regions.
type shmLink struct {
	e    *Engine
	peer Descriptor

	mu      sync.Mutex // serialises control exchanges (commit)
	conn    *net.UnixConn
	rbuf    [headerSize + maxMsgLen]byte
	cbuf    []byte
	wid     uint64
	table   []byte
	n       int
	regions map[RegionID][]byte
	broken  bool

	copying sync.RWMutex // held (R) while copying; close takes it (W) before unmapping
	closed  atomic.Bool
	connRef atomic.Pointer[net.UnixConn] // l.conn, for close to unblock an exchange

	// A reconnect retires the old control connection, but the receiver
	// fails the uncommitted grants of a writer id whose connection closed:
	// a retired connection stays open until the writes that copied under
	// its id have committed. genMu is a leaf lock (taken under copying).
	genMu   sync.Mutex
	users   map[uint64]int      // writer id → writes between their copy and the end of their commit
	retired map[uint64]*shmConn // retired connections waiting for their users
}

// shmConn is one control connection and the mappings its hello gave.
type shmConn struct {
	conn    *net.UnixConn
	table   []byte
	regions map[RegionID][]byte
}

func dialSHM(ctx context.Context, e *Engine, peer Descriptor) (link, error) {
	l := &shmLink{e: e, peer: peer, users: make(map[uint64]int), retired: make(map[uint64]*shmConn)}
	if err := l.connect(ctx); err != nil {
		return nil, err
	}
	return l, nil
}

func (l *shmLink) transport() Transport { return TransportSHM }

// connect dials the control socket, checks the hello and maps the memfds.
func (l *shmLink) connect(ctx context.Context) error {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", l.peer.ShmAddr)
	if err != nil {
		return fmt.Errorf("rdma: dial shm %s at %s: %w", l.peer.Agent, l.peer.ShmAddr, err)
	}
	uc := nc.(*net.UnixConn)
	fail := func(err error) error { uc.Close(); return err }
	dl := time.Now().Add(helloTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl = d
	}
	_ = uc.SetDeadline(dl)
	if _, err := uc.Write(appendHello(nil, l.e.cfg.Agent, l.peer.Agent)); err != nil {
		return fail(fmt.Errorf("%w: shm hello to %s: %w", ErrPeerClosed, l.peer.Agent, err))
	}
	buf := make([]byte, headerSize+maxMsgLen)
	oob := make([]byte, unix.CmsgSpace(4*(maxShmRegions+1)))
	n, oobn, _, _, err := uc.ReadMsgUnix(buf, oob)
	if err != nil {
		return fail(fmt.Errorf("%w: shm hello from %s: %w", ErrPeerClosed, l.peer.Agent, err))
	}
	var fds []int
	if oobn > 0 {
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			return fail(fmt.Errorf("rdma: shm hello control message: %w", err))
		}
		for _, m := range msgs {
			got, err := unix.ParseUnixRights(&m)
			if err == nil {
				fds = append(fds, got...)
			}
		}
	}
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	if n < headerSize {
		if _, err := io.ReadFull(uc, buf[n:headerSize]); err != nil {
			return fail(fmt.Errorf("%w: shm hello from %s: %w", ErrPeerClosed, l.peer.Agent, err))
		}
		n = headerSize
	}
	h, err := decodeHeader(buf[:headerSize])
	if err != nil {
		return fail(err)
	}
	want := headerSize + int(h.length)
	if n < want {
		if _, err := io.ReadFull(uc, buf[n:want]); err != nil {
			return fail(fmt.Errorf("%w: shm hello from %s: %w", ErrPeerClosed, l.peer.Agent, err))
		}
	}
	msg := string(buf[headerSize:want])
	if h.typ == frameReply {
		return fail(&RemoteError{Agent: l.peer.Agent, Code: h.index, Msg: msg})
	}
	if h.typ != frameHello {
		return fail(malformed("shm hello answered with frame type %d", h.typ))
	}
	parts := strings.SplitN(msg, "\n", 3)
	if len(parts) != 3 || AgentID(parts[0]) != l.peer.Agent {
		return fail(fmt.Errorf("%w: expected %q, reached %q", ErrWrongPeer, l.peer.Agent, parts[0]))
	}
	var wid, slots uint64
	var regs string
	for _, kv := range strings.Fields(parts[2]) {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "wid":
			wid, err = strconv.ParseUint(v, 10, 64)
		case "slots":
			slots, err = strconv.ParseUint(v, 10, 32)
		case "regions":
			regs = v
		}
		if err != nil {
			return fail(malformed("shm hello %q: %v", parts[2], err))
		}
	}
	var specs [][2]uint64
	if regs != "" {
		for _, r := range strings.Split(regs, ",") {
			a, b, _ := strings.Cut(r, ":")
			id, err1 := strconv.ParseUint(a, 10, 32)
			size, err2 := strconv.ParseUint(b, 10, 63)
			if err1 != nil || err2 != nil {
				return fail(malformed("shm hello region %q", r))
			}
			specs = append(specs, [2]uint64{id, size})
		}
	}
	if wid == 0 || slots == 0 || len(fds) != len(specs)+1 {
		return fail(malformed("shm hello: wid %d, %d slots, %d regions, %d fds", wid, slots, len(specs), len(fds)))
	}
	table, err := mapShared(fds[0], int64(slots*slotSize))
	if err != nil {
		return fail(err)
	}
	regions := make(map[RegionID][]byte, len(specs))
	for i, sp := range specs {
		mem, err := mapShared(fds[i+1], int64(sp[1]))
		if err != nil {
			freeShared(table, -1)
			for _, m := range regions {
				freeShared(m, -1)
			}
			return fail(err)
		}
		regions[RegionID(sp[0])] = mem
	}
	_ = uc.SetDeadline(time.Time{})
	l.conn, l.wid, l.table, l.n, l.regions, l.broken = uc, wid, table, int(slots), regions, false
	l.connRef.Store(uc)
	return nil
}

// unmapLocked drops the connection and mappings; l.mu and l.copying (W)
// are held, in that order (the lock order of shmLink).
func (l *shmLink) unmapLocked() {
	releaseShm(l.conn, l.table, l.regions)
	l.conn, l.table = nil, nil
	l.connRef.Store(nil)
	clear(l.regions)
}

// releaseShm closes a control connection and unmaps what it mapped (any may
// be nil).
func releaseShm(conn *net.UnixConn, table []byte, regions map[RegionID][]byte) {
	if conn != nil {
		conn.Close()
	}
	if table != nil {
		freeShared(table, -1)
	}
	for _, m := range regions {
		freeShared(m, -1)
	}
}

func (l *shmLink) close() {
	l.closed.Store(true)
	// Let copies in flight end (each checks closed at its next bracket):
	// only then may the receiver see the control socket close and treat
	// this writer as gone. The write lock is taken only to wait for the
	// copies' read locks; it cannot be held on (l.mu comes first).
	l.copying.Lock()
	l.copying.Unlock() //lint:ignore SA2001 a barrier: waits for the copies in flight
	if c := l.connRef.Load(); c != nil {
		c.Close() // unblocks a commit exchange holding l.mu
	}
	l.mu.Lock()
	l.copying.Lock()
	l.unmapLocked()
	l.copying.Unlock()
	l.mu.Unlock()
	l.genMu.Lock()
	retired := l.retired
	l.retired = make(map[uint64]*shmConn)
	l.genMu.Unlock()
	for _, r := range retired {
		releaseShm(r.conn, r.table, r.regions)
	}
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

// ready reconnects after a broken control connection or when the ticket
// names a region registered after the hello.
func (l *shmLink) ready(ctx context.Context, t *Ticket) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	need := l.conn == nil || l.broken
	if !need {
		for _, x := range t.Extents {
			if _, ok := l.regions[x.Region]; !ok {
				need = true
				break
			}
		}
	}
	if !need {
		return nil
	}
	return l.reconnectLocked(ctx)
}

// reconnectLocked replaces the control connection; l.mu is held. The old
// one stays open until the writes that copied under its writer id are done.
func (l *shmLink) reconnectLocked(ctx context.Context) error {
	l.copying.Lock()
	if l.closed.Load() {
		l.copying.Unlock()
		return ErrClosed
	}
	// Connect first, then let the old control socket go: the receiver
	// reads a writer with no connection left as gone (OnWriterGone).
	old, wid := &shmConn{l.conn, l.table, l.regions}, l.wid
	if err := l.connect(ctx); err != nil {
		// connect changed nothing: a broken link stays broken, retried on
		// the next write.
		l.copying.Unlock()
		return err
	}
	l.retire(wid, old)
	l.copying.Unlock()
	return nil
}

func (l *shmLink) write(ctx context.Context, op *writeOp) error {
	release, copyErr := l.copyOp(ctx, op)
	defer release()
	if copyErr != nil && !errors.Is(copyErr, errSlotRefused) {
		if errors.Is(copyErr, ErrOutOfRange) {
			// Right token, wrong extents: tell the receiver, which fails the grant.
			return l.abort(ctx, op, copyErr)
		}
		if ctx.Err() != nil {
			// Cancelled mid-copy: the grant holds part of the data; tell the
			// receiver now rather than let it wait for the deadline.
			actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			_ = l.abort(actx, op, fmt.Errorf("%w: writer cancelled: %w", ErrPeerClosed, copyErr))
			cancel()
		}
		return copyErr
	}
	if op.partial {
		if copyErr == nil {
			return nil // copied; a Stream commits once every part is in
		}
		// The slot no longer admits this writer: ask the receiver why. An
		// abort changes nothing on a grant that failed or committed, and
		// fails one that is somehow still open, which a stream that cannot
		// write any more wants anyway.
		return l.abort(ctx, op, fmt.Errorf("%w: grant %d refused a streamed write", ErrRevoked, op.t.Grant))
	}
	// The commit gives the receiver's verdict; after a slot refusal nothing
	// was copied and the receiver names the precise reason.
	return l.commit(ctx, op)
}

// copyOp readies the link and copies op into the peer's memory. Until
// release is called, the control connection of the writer id it copied
// under stays open, even if another write reconnects meanwhile.
func (l *shmLink) copyOp(ctx context.Context, op *writeOp) (release func(), err error) {
	if err := l.ready(ctx, op.t); err != nil {
		return func() {}, err
	}
	l.copying.RLock()
	defer l.copying.RUnlock()
	if l.closed.Load() || l.table == nil {
		return func() {}, ErrClosed
	}
	wid := l.wid
	l.hold(wid)
	return func() { l.unhold(wid) }, l.copyAll(ctx, op)
}

// errSlotRefused: the slot does not admit this ticket; ask the receiver why.
var errSlotRefused = errors.New("rdma: shm slot refused the ticket")

// copyAll copies op's pieces into the mapped destination, CAS-bracketed,
// and sums each destination chunk right after copying it.
func (l *shmLink) copyAll(ctx context.Context, op *writeOp) error {
	t := op.t
	sl := slotAt(l.table, int(t.Grant%uint64(l.n)))
	w := sl.state().Load()
	ok := wordState(w) == slotOpen && wordEpoch(w) == t.Epoch&slotEpochMask &&
		sl.grant().Load() == t.Grant &&
		sl.token0().Load() == binary.LittleEndian.Uint64(t.Token[0:]) &&
		sl.token1().Load() == binary.LittleEndian.Uint64(t.Token[8:])
	if !ok {
		return errSlotRefused
	}
	digest := sl.digest().Load()
	if sl.state().Load() != w {
		return errSlotRefused
	}
	if digest != extentsDigest(t.Extents) {
		return fmt.Errorf("%w: ticket extents differ from grant %d's", ErrOutOfRange, t.Grant)
	}
	for i, x := range t.Extents {
		mem := l.regions[x.Region]
		if x.Offset > uint64(len(mem)) || x.Length > uint64(len(mem))-x.Offset {
			return fmt.Errorf("%w: ticket extent %d outside peer region %d", ErrOutOfRange, i, x.Region)
		}
	}
	open := slotWord(slotOpen, 0, t.Epoch)
	writing := slotWord(slotWriting, l.wid, t.Epoch)

	c := shmCursor{l: l, op: op, pieces: op.pieces}
	for first := true; c.more(); first = false {
		if err := ctx.Err(); err != nil {
			return err
		}
		if l.closed.Load() {
			return ErrClosed
		}
		if !sl.state().CompareAndSwap(open, writing) {
			return errSlotRefused
		}
		if first {
			// Tagged inside the bracket, where the slot cannot be fenced
			// and handed to another grant: this writer's departure fails
			// this grant only (shmRxState.closed).
			sl.writer().Store(l.wid)
		}
		n := c.step(shmBracket)
		sl.copied().Add(n)
		if !sl.state().CompareAndSwap(writing, open) {
			// A fence asked this bracket to be the last: close the slot
			// for it, and copy no more.
			sl.state().CompareAndSwap(slotWord(slotFencing, l.wid, t.Epoch), slotWord(slotClosed, 0, t.Epoch))
			return errSlotRefused
		}
	}
	return nil
}

// shmCursor walks op's pieces, copying each into the mapped destination
// and summing the bytes as they are copied.
type shmCursor struct {
	l      *shmLink
	op     *writeOp
	pieces []piece
	pi     int    // current piece
	off    uint64 // bytes of it done
	region RegionID
	mem    []byte // l.regions[region]; nil until the first lookup
}

func (c *shmCursor) more() bool { return c.pi < len(c.pieces) }

// step copies up to budget bytes (whole pieces' remainders or chunks of
// them) and returns how many it copied.
func (c *shmCursor) step(budget int) uint64 {
	var done uint64
	t := c.op.t
	for c.pi < len(c.pieces) && done < uint64(budget) {
		p := &c.pieces[c.pi]
		x := t.Extents[p.ext]
		if c.mem == nil || x.Region != c.region {
			c.region, c.mem = x.Region, c.l.regions[x.Region]
		}
		mem := c.mem
		n := min(uint64(len(p.src))-c.off, shmSubCopy, uint64(budget)-done)
		base := x.Offset + p.off + c.off
		dst := mem[base : base+n : base+n]
		c.op.copySum(p, dst, p.src[c.off:c.off+n])
		done += n
		c.off += n
		if c.off == uint64(len(p.src)) {
			c.pi, c.off = c.pi+1, 0
		}
	}
	return done
}

// commit sends the commit frame over the control socket and reads the verdict.
func (l *shmLink) commit(ctx context.Context, op *writeOp) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := len(op.manifest.Bytes)
	need := headerSize + m*manifestEntrySize
	if cap(l.cbuf) < need {
		l.cbuf = make([]byte, need)
	}
	b := l.cbuf[:need]
	h := header{typ: frameCommit, flags: op.commitFlags(), index: uint32(m), grant: op.t.Grant, epoch: op.t.Epoch, token: op.t.Token, length: uint64(m * manifestEntrySize)}
	h.put(b)
	putManifest(b[headerSize:], op.manifest)
	return l.exchangeLocked(ctx, b)
}

// abort asks the receiver to fail the grant with reason.
func (l *shmLink) abort(ctx context.Context, op *writeOp, reason error) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	msg := reason.Error()
	if len(msg) > maxMsgLen {
		msg = msg[:maxMsgLen]
	}
	h := header{typ: frameAbort, index: codeOf(reason), grant: op.t.Grant, epoch: op.t.Epoch, token: op.t.Token, length: uint64(len(msg))}
	b := make([]byte, headerSize, headerSize+len(msg))
	h.put(b)
	err := l.exchangeLocked(ctx, append(b, msg...))
	if err == nil {
		return reason
	}
	return err
}

// exchangeLocked sends one frame and reads the reply; l.mu is held. A
// connection that may be out of step (an exchange cut by its context, a
// failed read or write, a reply that answers another frame) is never used
// again: the next exchange reconnects first, so no write reads an earlier
// exchange's verdict as its own. The reply must name the grant and epoch of
// the frame sent.
func (l *shmLink) exchangeLocked(ctx context.Context, b []byte) error {
	if l.closed.Load() {
		return ErrClosed
	}
	if l.conn == nil || l.broken {
		if err := l.reconnectLocked(ctx); err != nil {
			return err
		}
	}
	var sent header
	sent.grant = binary.LittleEndian.Uint64(b[16:])
	sent.epoch = binary.LittleEndian.Uint64(b[24:])
	if dl, ok := ctx.Deadline(); ok {
		_ = l.conn.SetDeadline(dl)
		defer l.conn.SetDeadline(time.Time{})
	}
	if ctx.Done() != nil {
		conn := l.conn
		stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(aLongTimeAgo) })
		defer func() {
			if !stop() {
				// ctx ended as the exchange did: its past deadline may
				// land after any reset, so the connection is not reused.
				l.broken = true
			}
		}()
	}
	if _, err := l.conn.Write(b); err != nil {
		l.broken = true
		if cerr := ctxErr(ctx); cerr != nil {
			return cerr
		}
		return fmt.Errorf("%w: shm commit to %s: %w", ErrPeerClosed, l.peer.Agent, err)
	}
	rh, msg, err := readReply(l.conn, l.rbuf[:])
	if err != nil {
		l.broken = true
		if cerr := ctxErr(ctx); cerr != nil {
			return cerr
		}
		return fmt.Errorf("rdma: shm reply from %s: %w", l.peer.Agent, err)
	}
	if rh.typ != frameReply {
		l.broken = true
		return malformed("shm: expected a reply, got frame type %d", rh.typ)
	}
	if rh.grant != sent.grant || rh.epoch != sent.epoch {
		l.broken = true
		return malformed("shm: reply for grant %d epoch %d answers a frame for grant %d epoch %d", rh.grant, rh.epoch, sent.grant, sent.epoch)
	}
	if rh.index != codeOK {
		return &RemoteError{Agent: l.peer.Agent, Code: rh.index, Msg: string(msg)}
	}
	return nil
}
