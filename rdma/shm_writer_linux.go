//go:build linux

package rdma

// The shm writer: a shmLink maps a same-host peer's regions and slot table
// and copies a grant's pieces straight into them, inside the slot's CAS
// brackets (shm_slot_linux.go); commits and aborts travel over its control
// socket.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

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
	// streams holds, per grant of a Stream that copied and has not
	// committed or aborted, the writer id its last part copied under: a
	// stream commits in a later write, maybe after a reconnect.
	streams map[uint64]streamHold
}

// shmConn is one control connection and the mappings its hello gave.
type shmConn struct {
	conn    *net.UnixConn
	table   []byte
	regions map[RegionID][]byte
}

func dialSHM(ctx context.Context, e *Engine, peer Descriptor) (link, error) {
	l := &shmLink{e: e, peer: peer, users: make(map[uint64]int), retired: make(map[uint64]*shmConn), streams: make(map[uint64]streamHold)}
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
	dl := time.Now().Add(helloTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl = d
	}
	_ = uc.SetDeadline(dl)
	// ctx ending cuts the hello too, not only its deadline: a caller that
	// cancels (a send past its grant, a closing engine) must not wait out
	// helloTimeout on a receiver that stopped answering.
	stop := func() bool { return true }
	if ctx.Done() != nil {
		stop = context.AfterFunc(ctx, func() { _ = uc.SetDeadline(aLongTimeAgo) })
	}
	fail := func(err error) error {
		stop()
		uc.Close()
		if cerr := ctxErr(ctx); cerr != nil {
			return fmt.Errorf("shm hello with %s: %w", l.peer.Agent, cerr)
		}
		return err
	}
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
	if (h.typ != frameHello && h.typ != frameReply) || h.length > maxMsgLen {
		// Checked before the message is read into buf, which holds
		// maxMsgLen: a data or commit header may claim far more.
		return fail(malformed("shm hello answered with frame type %d of %d bytes", h.typ, h.length))
	}
	want := headerSize + int(h.length)
	if n < want {
		if _, err := io.ReadFull(uc, buf[n:want]); err != nil {
			return fail(fmt.Errorf("%w: shm hello from %s: %w", ErrPeerClosed, l.peer.Agent, err))
		}
	}
	if !stop() {
		// ctx ended as the hello did: its past deadline may land after
		// the reset below, so the connection is not used.
		return fail(fmt.Errorf("shm hello with %s: %w", l.peer.Agent, ctx.Err()))
	}
	msg := string(buf[headerSize:want])
	if h.typ == frameReply {
		return fail(&RemoteError{Agent: l.peer.Agent, Code: h.index, Msg: msg})
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
	l.streams = make(map[uint64]streamHold)
	l.genMu.Unlock()
	for _, r := range retired {
		releaseShm(r.conn, r.table, r.regions)
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
	// Streams given up (no commit, no abort) hold the old writer id no
	// longer: only the open ones keep its connection.
	l.genMu.Lock()
	stale := l.staleStreamsLocked(true)
	l.genMu.Unlock()
	for _, r := range stale {
		r()
	}
	l.retire(wid, old)
	l.copying.Unlock()
	return nil
}

func (l *shmLink) write(ctx context.Context, op *writeOp) error {
	if err := l.ready(ctx, op.t); err != nil {
		// Nothing was copied, and the control connection an abort would
		// go by did not come up: a frozen receiver would hold the abort
		// too.
		l.endStream(op.t.Grant)
		return err
	}
	release, wid, copyErr := l.copyOp(ctx, op)
	if op.partial && copyErr == nil {
		l.holdStream(op.t, wid, release)
		return nil // copied; a Stream commits once every part is in
	}
	// A whole write, a stream's commit, or a part that failed: what
	// follows ends the grant's exchange with the receiver, and any
	// stream's hold with it.
	defer l.endStream(op.t.Grant)
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

// copyOp copies op into the peer's memory over a ready link. Until
// release is called, the control connection of the writer id it copied
// under stays open, even if another write reconnects meanwhile.
func (l *shmLink) copyOp(ctx context.Context, op *writeOp) (release func(), wid uint64, err error) {
	l.copying.RLock()
	defer l.copying.RUnlock()
	if l.closed.Load() || l.table == nil {
		return func() {}, 0, ErrClosed
	}
	wid = l.wid
	l.hold(wid)
	return func() { l.unhold(wid) }, wid, l.copyAll(ctx, op)
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
	var done uint64
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
		if f := op.testHooks().writing; f != nil {
			f(t, done)
		}
		n := c.step(shmBracket)
		done += n
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
	if f := op.testHooks().commit; f != nil {
		f(op.t)
	}
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
	if f := l.e.testHooks().sent; f != nil {
		f(sent.grant)
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
