package rdma

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"

	"github.com/handoff-io/handoff/internal/crc32c"
	"github.com/handoff-io/handoff/internal/cuda"
)

// Device memory. A device region (RegisterDevice) is a CUDA allocation, a
// cuda.Arena, instead of a memfd. Grants, extents, Forbid and the busy
// spans are offsets and work on it unchanged, so the reserved rows are
// refused at the data plane exactly as for host memory. What differs is how
// bytes reach it, per transport (this file holds that one concern for
// every transport: registration, staging, and each transport's device
// path):
//
//   - inproc: device to host and host to device are synchronous copies
//     through the driver, device to device one chunked copy on the
//     destination's device.
//   - tcp: a device source is staged chunk by chunk through two pinned host
//     buffers (the device-to-host copy of chunk i+1 runs while chunk i is on
//     the socket) and sent as ordinary data frames; a device destination is
//     read into pinned buffers and copied to the device while the next
//     chunk is read, and a landing ends only once its bytes are on the
//     device, so a commit or flush is answered only after them.
//   - cuda-ipc (same host, same IPC namespace, the writer's device visible
//     to the receiver): the connection is tcp's, but a device-to-device
//     piece travels as a pull frame naming the writer's exported
//     allocation; the receiver opens its handle once (cached by exporter
//     pid, device and base, reopened when the buffer id changes) and copies
//     device to device itself, in chunks on its non-blocking stream, each
//     waited on by event polling. Since the receiver makes every copy, the
//     fence is tcp's: a landing is counted in flight, Revoke stops the copy
//     before its next chunk and waits for the one in flight; nothing lands
//     after Revoke returned, whatever the writer does, and a writer that is
//     stopped or killed cannot hold a fence (there is no quarantine).
//   - shm maps memfds: it is not used when either side has device regions.
//
// Integrity: bytes that pass through host memory (staged tcp, inproc to or
// from the host) are summed there as they pass. Device-to-device bytes never
// do: the writer sums its source and the receiver its destination each by
// a staged read (device to host), unless SkipCRC; a crc kernel on the
// device would make that free and is left for when a GPU can measure it.

// Memory is where a region lives.
type Memory string

const (
	// MemoryHost is a memfd mapped in this process (Register).
	MemoryHost Memory = "host"
	// MemoryCUDA is a CUDA device allocation (RegisterDevice).
	MemoryCUDA Memory = "cuda"
)

// stageChunk is the staging buffers' size: the unit of a staged copy.
const stageChunk = cuda.DefaultStageChunk

// maxIdleStagers bounds the staging buffer pairs an engine keeps per
// device between transfers (two pinned buffers of stageChunk each).
const maxIdleStagers = 8

// featureCUDAIPC is announced in a tcp receiver's hello when it accepts
// pull frames: it has device regions and serves cuda-ipc.
const featureCUDAIPC = "cuda-ipc"

// devSpan is a place in device memory: offset off of arena a (nil a: none).
type devSpan struct {
	a   *cuda.Arena
	off uint64
}

func (s devSpan) ptr() cuda.DevicePtr { return s.a.Ptr() + cuda.DevicePtr(s.off) }

// devState is what an engine knows about its devices: those its device
// regions live on, the devices this process sees (whose exports it can
// open), and idle staging buffers. Lock order: Engine.mu -> devState.mu.
type devState struct {
	mu      sync.Mutex
	devices []*cuda.Device
	visible []string // UUIDs, as cuda.UUID.String prints them
	ns      string   // IPC namespace
	idle    map[*cuda.Device][]*cuda.Stager
	closed  bool
}

// add records a device that a region lives on.
func (s *devState) add(d *cuda.Device) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if slices.Contains(s.devices, d) {
		return nil
	}
	if s.visible == nil {
		var us []cuda.UUID
		err := d.Do(func(drv cuda.Driver) (err error) {
			us, err = cuda.VisibleDevices(drv)
			return err
		})
		if err != nil {
			return fmt.Errorf("rdma: listing the visible CUDA devices: %w", err)
		}
		s.visible = make([]string, len(us))
		for i, u := range us {
			s.visible[i] = u.String()
		}
		s.ns = cuda.IPCNamespace()
	}
	s.devices = append(s.devices, d)
	return nil
}

// any reports whether the engine has device regions.
func (s *devState) any() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.devices) > 0
}

// describe adds what cuda-ipc selection needs to d.
func (s *devState) describe(d *Descriptor) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.devices) == 0 {
		return
	}
	d.IPCNamespace = s.ns
	d.CUDADevices = slices.Clone(s.visible)
}

// stager takes an idle staging buffer pair of d, or allocates one.
func (s *devState) stager(d *cuda.Device) (*cuda.Stager, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, ErrClosed
	}
	if l := s.idle[d]; len(l) > 0 {
		st := l[len(l)-1]
		s.idle[d] = l[:len(l)-1]
		s.mu.Unlock()
		return st, nil
	}
	s.mu.Unlock()
	st, err := cuda.NewStager(d, stageChunk)
	if err != nil {
		return nil, fmt.Errorf("rdma: staging buffers: %w", err)
	}
	return st, nil
}

// put returns a staging buffer pair taken by stager.
func (s *devState) put(d *cuda.Device, st *cuda.Stager) {
	s.mu.Lock()
	if s.closed || len(s.idle[d]) >= maxIdleStagers {
		s.mu.Unlock()
		_ = st.Close()
		return
	}
	if s.idle == nil {
		s.idle = make(map[*cuda.Device][]*cuda.Stager)
	}
	s.idle[d] = append(s.idle[d], st)
	s.mu.Unlock()
}

// close frees the idle staging buffers; later stager calls fail.
func (s *devState) close() {
	s.mu.Lock()
	s.closed = true
	idle := s.idle
	s.idle = nil
	s.mu.Unlock()
	for _, l := range idle {
		for _, st := range l {
			_ = st.Close()
		}
	}
}

// RegisterDevice registers a device allocation as a region. The engine
// does not own it: free the arena only after Engine.Close. The arena is
// exported for CUDA IPC here, once (a driver that cannot export it leaves
// the region reachable by tcp only). Register device regions at start-up,
// before the Descriptor is published.
func (e *Engine) RegisterDevice(name string, a *cuda.Arena) (*Region, error) {
	if a == nil || a.Size() == 0 {
		return nil, fmt.Errorf("%w: device region %q of 0 bytes", ErrOutOfRange, name)
	}
	if err := e.devs.add(a.Device()); err != nil {
		return nil, err
	}
	ipc, xerr := a.Export()
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, ErrClosed
	}
	r := &Region{id: RegionID(len(e.regions) + 1), name: name, dev: a, size: a.Size(), fd: -1}
	if xerr == nil {
		r.ipc = &ipc
	} else {
		e.log.Warn("rdma: device region not exported for cuda-ipc; peers reach it by tcp", "name", name, "err", xerr)
	}
	e.regions[r.id] = r
	e.log.Info("rdma: region registered", "region", r.id, "name", name, "bytes", a.Size(), "memory", string(MemoryCUDA), "device", a.Device().UUID().String(), "ipc", xerr == nil)
	return r, nil
}

// hasDeviceRegions reports whether a descriptor lists a device region.
func hasDeviceRegions(d Descriptor) bool {
	for _, r := range d.Regions {
		if r.Memory == MemoryCUDA {
			return true
		}
	}
	return false
}

// ipcReach reports whether this engine's device regions can be pulled by
// peer through CUDA IPC: same host and IPC namespace, every device of ours
// visible to it, and every region exported.
func (e *Engine) ipcReach(peer Descriptor) (bool, string) {
	if peer.Host != e.cfg.Host {
		return false, "peer is on another host"
	}
	e.mu.RLock()
	var uuids []string
	for _, r := range e.regions {
		if r.dev == nil {
			continue
		}
		if r.ipc == nil {
			e.mu.RUnlock()
			return false, fmt.Sprintf("region %q is not exported", r.name)
		}
		uuids = append(uuids, r.dev.Device().UUID().String())
	}
	e.mu.RUnlock()
	if len(uuids) == 0 {
		return false, "no device regions here"
	}
	if !hasDeviceRegions(peer) {
		return false, "peer has no device regions"
	}
	e.devs.mu.Lock()
	ns := e.devs.ns
	e.devs.mu.Unlock()
	if ns == "" || peer.IPCNamespace != ns {
		return false, fmt.Sprintf("IPC namespace %q here, %q there", ns, peer.IPCNamespace)
	}
	for _, u := range uuids {
		if !slices.Contains(peer.CUDADevices, u) {
			return false, "device " + u + " is not visible to the peer"
		}
	}
	return true, "peer is on this host, in this IPC namespace, and sees our devices"
}

// rxFeatures are the optional frames this receiver announces in its tcp
// hello answer.
func (e *Engine) rxFeatures() []string {
	// cfg, not served: a writer may connect while New is still starting
	// the other transports.
	if slices.Contains(e.cfg.Transports, TransportCUDAIPC) && e.devs.any() {
		return append(slices.Clone(tcpFeatures), featureCUDAIPC)
	}
	return tcpFeatures
}

// dialIPC connects the cuda-ipc transport: a tcp link whose receiver
// announced that it accepts pull frames.
func dialIPC(ctx context.Context, e *Engine, peer Descriptor) (link, error) {
	l := &tcpLink{e: e, peer: peer, ipc: true, busy: make(map[*txConn]struct{})}
	tc, err := l.dial(ctx)
	if err != nil {
		return nil, err
	}
	l.put(tc)
	return l, nil
}

// size returns the bytes of a piece.
func (p *piece) size() uint64 {
	if p.dev.a != nil {
		return p.dn
	}
	return uint64(len(p.src))
}

// splitDevice cuts source extent s of device arena a into pieces at the
// destination's extent boundaries, continuing at (*di, *doff).
func splitDevice(op *writeOp, a *cuda.Arena, s Extent, di *int, doff *uint64) {
	dst := op.t.Extents
	op.dev = true
	for off := uint64(0); off < s.Length; {
		n := min(s.Length-off, dst[*di].Length-*doff)
		op.pieces = append(op.pieces, piece{ext: uint32(*di), off: *doff, dev: devSpan{a: a, off: s.Offset + off}, dn: n})
		off += n
		*doff += n
		if *doff == dst[*di].Length {
			*di, *doff = *di+1, 0
		}
	}
}

// smallRead is the size up to which sumDevice reads device bytes with one
// synchronous copy into a pooled host buffer: one executor round trip
// instead of a staged pipeline's queue-and-wait per chunk.
const smallRead = 256 << 10

var smallBufs = sync.Pool{New: func() any { return new([smallRead]byte) }}

// sumDevice extends *crc with n device bytes at s, read through staging
// buffers (or, when few, one synchronous copy).
func (e *Engine) sumDevice(ctx context.Context, s devSpan, n uint64, crc *uint32) error {
	if n <= smallRead {
		b := smallBufs.Get().(*[smallRead]byte)
		defer smallBufs.Put(b)
		if _, err := s.a.ReadAt(b[:n], int64(s.off)); err != nil {
			return err
		}
		*crc = crc32c.Update(*crc, b[:n])
		return nil
	}
	d := s.a.Device()
	st, err := e.devs.stager(d)
	if err != nil {
		return err
	}
	defer e.devs.put(d, st)
	return st.Each(ctx, s.ptr(), n, func(_ uint64, b []byte) error {
		*crc = crc32c.Update(*crc, b)
		return nil
	})
}

// deviceCRC returns the crc32c of n device bytes at s.
func (e *Engine) deviceCRC(s devSpan, n uint64) (uint32, error) {
	var crc uint32
	err := e.sumDevice(context.Background(), s, n, &crc)
	return crc, err
}

// ----- inproc -----

// landDevice lands piece p through ld when either is in device memory.
func (l *inprocLink) landDevice(ctx context.Context, op *writeOp, p *piece, ld *landing) error {
	switch {
	case p.dev.a == nil: // host to device
		for off := 0; off < len(p.src); off += stageChunk {
			s := p.src[off:min(off+stageChunk, len(p.src))]
			if _, err := ld.dev.a.WriteAt(s, int64(ld.dev.off)+int64(off)); err != nil {
				return err
			}
			sumBoth(op, p, ld, s)
		}
		return nil
	case ld.dev.a == nil: // device to host
		for off := uint64(0); off < p.dn; off += stageChunk {
			d := ld.dst[off:min(off+stageChunk, p.dn)]
			if _, err := p.dev.a.ReadAt(d, int64(p.dev.off+off)); err != nil {
				return err
			}
			sumBoth(op, p, ld, d)
		}
		return nil
	}
	// Device to device: the bytes never pass the host; the commit sums the
	// destination, the writer its source.
	ld.nosum = true
	if _, err := ld.dev.a.Device().CopyChunked(ctx, ld.dev.ptr(), p.dev.ptr(), p.dn, 0, nil); err != nil {
		return err
	}
	if op.noCRC {
		return nil
	}
	return l.tx.sumDevice(ctx, p.dev, p.dn, op.crcFor(p))
}

// sumBoth folds b, the next host bytes of p that landed through ld, into
// the writer's crc and the landing's, chunk by chunk while they are in
// cache.
func sumBoth(op *writeOp, p *piece, ld *landing, b []byte) {
	for off := 0; off < len(b); off += landChunk {
		c := b[off:min(off+landChunk, len(b))]
		ld.fill(c)
		op.sum(p, c)
	}
}

// ----- tcp and cuda-ipc, writer -----

// writeDevice is tcpLink.write for an op with device pieces: on one
// connection, host pieces as usual, device pieces staged (tcp) or as pull
// frames (cuda-ipc, into a device destination), then the commit (or, for a
// part of a Stream, a flush).
func (l *tcpLink) writeDevice(ctx context.Context, op *writeOp) error {
	end := uint8(frameCommit)
	if op.partial {
		if !l.stripes.Load() {
			return fmt.Errorf("%w: receiver %s predates the flush frame a streamed write needs", ErrUnsupported, l.peer.Agent)
		}
		end = frameFlush
	}
	tc, err := l.get(ctx)
	if err != nil {
		return err
	}
	tc.bind(ctx)
	werr := l.sendDevice(ctx, tc, op)
	if werr == nil {
		werr = tc.send(op, nil, end)
	}
	return l.finish(ctx, tc, op.t, werr)
}

func (l *tcpLink) sendDevice(ctx context.Context, tc *txConn, op *writeOp) error {
	for i := 0; i < len(op.pieces); {
		if op.pieces[i].dev.a == nil {
			j := i + 1
			for j < len(op.pieces) && op.pieces[j].dev.a == nil {
				j++
			}
			if err := tc.send(op, op.pieces[i:j], 0); err != nil {
				return err
			}
			i = j
			continue
		}
		p := &op.pieces[i]
		var err error
		if l.ipc && l.peerDevice(op.t.Extents[p.ext].Region) {
			err = l.sendPull(ctx, tc, op, p)
		} else {
			err = l.sendStaged(ctx, tc, op, p)
		}
		if err != nil {
			return err
		}
		i++
	}
	return nil
}

// peerDevice reports whether the peer's region id is in device memory.
func (l *tcpLink) peerDevice(id RegionID) bool {
	for _, r := range l.peer.Regions {
		if r.ID == id {
			return r.Memory == MemoryCUDA
		}
	}
	return false
}

// sendStaged sends device piece p as data frames of one staging chunk
// each, summing each chunk in its pinned buffer right after it was sent.
func (l *tcpLink) sendStaged(ctx context.Context, tc *txConn, op *writeOp, p *piece) error {
	if p.dn <= smallRead { // one chunk: nothing to overlap, one synchronous copy
		b := smallBufs.Get().(*[smallRead]byte)
		defer smallBufs.Put(b)
		if _, err := p.dev.a.ReadAt(b[:p.dn], int64(p.dev.off)); err != nil {
			return err
		}
		var hdr [headerSize]byte
		h := header{typ: frameData, index: p.ext, grant: op.t.Grant, epoch: op.t.Epoch, token: op.t.Token, offset: p.off, length: p.dn}
		h.put(hdr[:])
		if err := tc.flush(append(tc.iov[:0], hdr[:], b[:p.dn])); err != nil {
			return err
		}
		op.sum(p, b[:p.dn])
		l.e.stats.bytesStaged.Add(p.dn)
		return nil
	}
	d := p.dev.a.Device()
	st, err := l.e.devs.stager(d)
	if err != nil {
		return err
	}
	defer l.e.devs.put(d, st)
	var hdr [headerSize]byte
	h := header{typ: frameData, index: p.ext, grant: op.t.Grant, epoch: op.t.Epoch, token: op.t.Token}
	return st.Each(ctx, p.dev.ptr(), p.dn, func(off uint64, b []byte) error {
		h.offset, h.length = p.off+off, uint64(len(b))
		h.put(hdr[:])
		if err := tc.flush(append(tc.iov[:0], hdr[:], b)); err != nil {
			return err
		}
		op.sum(p, b)
		l.e.stats.bytesStaged.Add(uint64(len(b)))
		return nil
	})
}

// sendPull asks the receiver to copy device piece p out of our exported
// allocation, then sums the source while it copies.
func (l *tcpLink) sendPull(ctx context.Context, tc *txConn, op *writeOp, p *piece) error {
	r, ok := l.e.Region(l.e.regionOf(p.dev.a))
	if !ok || r.ipc == nil {
		return l.sendStaged(ctx, tc, op, p)
	}
	var b [headerSize + pullSize]byte
	h := header{typ: framePull, index: p.ext, grant: op.t.Grant, epoch: op.t.Epoch, token: op.t.Token, offset: p.off, length: pullSize}
	h.put(b[:])
	putPull(b[headerSize:], &pull{buf: *r.ipc, off: r.ipc.Offset + p.dev.off, n: p.dn})
	if err := tc.flush(append(tc.iov[:0], b[:])); err != nil {
		return err
	}
	if op.noCRC {
		return nil
	}
	return l.e.sumDevice(ctx, p.dev, p.dn, op.crcFor(p))
}

// regionOf returns the id of the device region of arena a (0: none).
func (e *Engine) regionOf(a *cuda.Arena) RegionID {
	e.mu.RLock()
	defer e.mu.RUnlock()
	for id, r := range e.regions {
		if r.dev == a {
			return id
		}
	}
	return 0
}

// ----- tcp and cuda-ipc, receiver -----

// landStaged reads a data frame's payload for a device destination through
// staging buffers: each chunk is summed in its pinned buffer and copied to
// the device while the next is read; it returns once every copy is done.
func (c *rxConn) landStaged(ld *landing) error {
	if ld.n <= smallRead { // one chunk: nothing to overlap, one synchronous copy
		b := smallBufs.Get().(*[smallRead]byte)
		defer smallBufs.Put(b)
		p := b[:ld.n]
		n, err := io.ReadFull(c.br, p)
		for s := 0; s < n; s += landChunk {
			ld.fill(p[s:min(s+landChunk, n)])
		}
		if err != nil {
			return err
		}
		if _, err := ld.dev.a.WriteAt(p, int64(ld.dev.off)); err != nil {
			return err
		}
		c.e.stats.bytesStaged.Add(ld.n)
		return nil
	}
	d := ld.dev.a.Device()
	st, err := c.e.devs.stager(d)
	if err != nil {
		// Nothing was read: skip the payload, the landing fails.
		if _, derr := c.br.Discard(int(ld.n)); derr != nil {
			return fmt.Errorf("%w: skipping a payload: %w", ErrPeerClosed, derr)
		}
		return err
	}
	defer c.e.devs.put(d, st)
	return st.Fill(context.Background(), ld.dev.ptr(), ld.n, func(_ uint64, b []byte) error {
		c.e.stats.bytesStaged.Add(uint64(len(b)))
		for off := 0; off < len(b); {
			end := min(off+rxReadChunk, len(b))
			n, err := io.ReadFull(c.br, b[off:end])
			for s := off; s < off+n; s += landChunk {
				ld.fill(b[s:min(s+landChunk, off+n)])
			}
			if err != nil {
				return err
			}
			off += n
		}
		return nil
	})
}

// pull lands a pull frame: the receiver copies the bytes out of the
// writer's exported allocation into its own device memory.
func (c *rxConn) pull(h *header) error {
	var b [pullSize]byte
	if _, err := io.ReadFull(c.br, b[:]); err != nil {
		return fmt.Errorf("%w: reading a pull frame: %w", ErrPeerClosed, err)
	}
	pr, err := decodePull(b[:])
	if err != nil {
		return err
	}
	if h.offset > maxDataLen-pr.n {
		return malformed("pull offset %d + length %d overflows", h.offset, pr.n)
	}
	g, err := c.grant(h.grant)
	var ld landing
	if err == nil {
		ld, err = g.beginLand(h.epoch, &h.token, h.index, h.offset, pr.n, c)
	}
	if err != nil {
		c.e.stats.framesRefused.Add(1)
		c.refuse(h.grant, err)
		return nil
	}
	var lerr error
	if ld.dev.a == nil {
		lerr = fmt.Errorf("%w: pull into host memory (extent %d of grant %d)", ErrUnsupported, h.index, g.id)
	} else {
		ld.nosum = true
		d := ld.dev.a.Device()
		var src cuda.DevicePtr
		c.imported(d, pr.buf.PID) // before Import: a mapping is not closed under it
		if src, lerr = d.Import(pr.buf); lerr == nil {
			var n uint64
			n, lerr = d.CopyChunked(context.Background(), ld.dev.ptr(), src+cuda.DevicePtr(pr.off), pr.n, 0, pullFence{c})
			c.e.stats.bytesPulled.Add(n)
		}
	}
	g.endLand(&ld, lerr == nil, c)
	if len(c.touched) == 0 || c.touched[len(c.touched)-1] != g {
		c.touched = append(c.touched, g)
	}
	if c.aborted.Swap(false) {
		_ = c.c.SetReadDeadline(time.Time{})
	}
	if lerr != nil {
		// The payload was read whole: the stream is in step, so the
		// connection goes on; the grant fails (a fence failed it already)
		// and its commit is refused with the reason.
		if !errors.Is(lerr, errFenced) {
			lerr = fmt.Errorf("rdma: cuda-ipc copy into grant %d: %w", g.id, lerr)
			g.terminate(lerr)
		} else if gerr := g.Err(); gerr != nil {
			lerr = gerr
		}
		c.refuse(h.grant, lerr)
	}
	return nil
}

// pullFence stops a pull's chunked copy once a fence aborted the
// connection's landing: Begin runs before each chunk is queued, and the
// fence waits for the landing (the chunk in flight) to end.
type pullFence struct{ c *rxConn }

func (f pullFence) Begin() error {
	if f.c.aborted.Load() {
		return errFenced
	}
	return nil
}

func (f pullFence) End() error { return nil }

var _ cuda.Bracket = pullFence{}

// pulledFrom is a device this connection imported allocations of process
// pid on.
type pulledFrom struct {
	d   *cuda.Device
	pid int
}

// imported notes that this connection opens allocations of process pid on
// d: d keeps them mapped until every connection that did so (of any engine
// sharing d, as an agent's engines do) has ended.
func (c *rxConn) imported(d *cuda.Device, pid int) {
	k := pulledFrom{d, pid}
	if slices.Contains(c.pulled, k) {
		return
	}
	c.pulled = append(c.pulled, k)
	d.RetainPeer(pid)
}

// forgetGone runs when the connection ends: the writers it pulled from that
// no other connection pulls from any more lose their cached mappings here.
func (c *rxConn) forgetGone() {
	for _, k := range c.pulled {
		if err := k.d.ReleasePeer(k.pid); err != nil && !errors.Is(err, cuda.ErrClosed) {
			c.e.log.Warn("rdma: closing a writer's cuda-ipc mappings", "pid", k.pid, "err", err)
		}
	}
	c.pulled = nil
}
