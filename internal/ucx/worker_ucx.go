//go:build linux && cgo && ucx

package ucx

/*
#cgo LDFLAGS: -lucp -lucs
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Available reports whether this build has UCX.
const Available = true

// amID is the one active-message id a Worker sends and handles.
const amID = 1

// shutdownGrace bounds how long Close progresses the force closes of the
// worker's endpoints before it destroys the worker anyway.
const shutdownGrace = 2 * time.Second

// progressBurst bounds the ucp_worker_progress calls between two looks at
// the submission queue, so a busy worker still serves its callers.
const progressBurst = 64

// Version returns the UCX library's version string ("1.13.1").
func Version() string { return C.GoString(C.ucp_get_version_string()) }

// registry maps the worker ids that UCX callbacks carry (in their arg and
// user_data, never a Go pointer) to workers.
var registry struct {
	sync.RWMutex
	next uint32
	m    map[uint32]*Worker
}

func lookup(ud C.uintptr_t) (*Worker, uint64) {
	registry.RLock()
	w := registry.m[uint32(uint64(ud)>>seqBits)]
	registry.RUnlock()
	return w, uint64(ud) & (1<<seqBits - 1)
}

// seqBits is how much of a callback's user data names the operation; the
// bits above name the worker.
const seqBits = 40

// Worker is one UCP context and worker (UCS_THREAD_MODE_SINGLE), owned by
// one goroutine locked to its OS thread: every UCP call and callback runs
// there. The methods may be called from any goroutine; they hand their work
// to the owner through a queue and wake it.
type Worker struct {
	id       uint32
	cfg      Config
	maxSleep int // ms

	// Set before New returns, then read-only.
	addr      []byte
	maxHeader int
	tid       int // the owner's thread

	mu     sync.Mutex
	queue  []func(closing bool)
	closed bool
	wakefd int

	done chan struct{} // the owner goroutine has ended

	st struct {
		sleeps, sleepTimeouts, progress, sent, sendFailed      atomic.Uint64
		admitted, refused, received, receiveFailed, peerErrors atomic.Uint64
	}

	// Owner-only.
	uctx     C.ucp_context_h
	uw       C.ucp_worker_h
	efd      C.int
	seq      uint64
	nextEP   EndpointID
	eps      map[EndpointID]*endpoint
	dead     map[EndpointID]error // endpoints closed after their peer failed
	sends    map[uint64]*Op
	recvs    map[uint64]*recv
	closes   map[uint64]*endpoint
	groups   map[Token]*group
	later    []func() // completions, delivered outside UCX's callbacks
	failed   []epFailure
	byH      map[C.ucp_ep_h]*endpoint // our endpoints not yet closing, by handle
	panicked any
	leaked   int // receives still in flight when Close gave up
}

type endpoint struct {
	id      EndpointID
	h       C.ucp_ep_h    // not to be used once closing: UCX may free it
	failed  error         // the peer failed: sends fail with this
	closing bool          // ucp_ep_close_nbx was called
	closed  chan struct{} // closed once that close completed
	err     error         // its status, set before closed is closed
}

type epFailure struct {
	id     EndpointID
	status Status
}

type recv struct {
	dest  []byte
	token Token
	done  func(error)
	via   *endpoint // ours, when the message came by it (nil: by one UCX made)
	pin   runtime.Pinner
}

// leakedRecvs holds the receives a Close left in flight, pinned, for the
// life of the process: UCX may still write their destinations.
var leakedRecvs struct {
	sync.Mutex
	rs []*recv
}

type group struct {
	n       int
	waiters []chan struct{}
}

// Op is a message in flight from Post. Its header and payload stay in use
// by UCX until Done is closed.
type Op struct {
	ep      EndpointID
	hdr     []byte
	payload []byte
	pin     runtime.Pinner
	done    chan struct{}
	err     error
}

// Done is closed when the operation completed: the receiver took the
// payload, refused it, or the operation failed. Only then may the payload
// be reused. A send's completion is not delivery: the receiver's own
// answer (a commit ack) is.
func (o *Op) Done() <-chan struct{} { return o.done }

// Err returns the operation's outcome once Done is closed (nil before):
// nil, ErrRejected when the receiver refused it, ErrCanceled after a force
// close, an error wrapping ErrPeerFailed, or ErrClosed.
func (o *Op) Err() error {
	select {
	case <-o.done:
		return o.err
	default:
		return nil
	}
}

// Wait waits for the operation and returns Err, or ctx's error first. An
// operation Wait gave up on is still in flight: its payload stays in use
// until Done; a force close of its endpoint (CloseEndpoint) ends it.
func (o *Op) Wait(ctx context.Context) error {
	select {
	case <-o.done:
		return o.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (o *Op) finish(w *Worker, err error) {
	o.pin.Unpin()
	o.err = err
	if err == nil {
		w.st.sent.Add(1)
	} else {
		w.st.sendFailed.Add(1)
	}
	close(o.done)
}

// New creates a worker and starts its owner goroutine. Call Close to stop
// it and free its UCX resources.
func New(cfg Config) (*Worker, error) {
	w := &Worker{
		cfg:      cfg,
		maxSleep: int((cfg.MaxSleep + time.Millisecond - 1) / time.Millisecond),
		done:     make(chan struct{}),
		eps:      map[EndpointID]*endpoint{},
		dead:     map[EndpointID]error{},
		sends:    map[uint64]*Op{},
		recvs:    map[uint64]*recv{},
		closes:   map[uint64]*endpoint{},
		groups:   map[Token]*group{},
		byH:      map[C.ucp_ep_h]*endpoint{},
		wakefd:   -1,
	}
	if cfg.MaxSleep <= 0 {
		w.maxSleep = 100
	}
	registry.Lock()
	if registry.m == nil {
		registry.m = map[uint32]*Worker{}
	}
	registry.next++
	w.id = registry.next
	registry.m[w.id] = w
	registry.Unlock()
	if w.id >= 1<<(64-seqBits) {
		panic("ucx: too many workers in one process")
	}

	ready := make(chan error, 1)
	go w.run(ready)
	if err := <-ready; err != nil {
		<-w.done
		return nil, err
	}
	return w, nil
}

func (w *Worker) run(ready chan<- error) {
	runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
	defer close(w.done)
	w.tid = unix.Gettid()
	if err := w.init(); err != nil {
		w.free()
		ready <- err
		return
	}
	ready <- nil
	w.loop()
}

// initMu serialises workers' UCX initialisation: it reads the process
// environment, which the first one may set (envKeys).
var initMu sync.Mutex

func (w *Worker) init() error {
	initMu.Lock()
	defer initMu.Unlock()
	modify, env := settings(w.cfg.Options, os.LookupEnv)
	for _, kv := range env {
		if err := os.Setenv(kv[0], kv[1]); err != nil {
			return fmt.Errorf("ucx: setenv %s: %w", kv[0], err)
		}
	}
	var cfg *C.ucp_config_t
	if st := C.ucp_config_read(nil, nil, &cfg); st != C.UCS_OK {
		return fmt.Errorf("ucx: ucp_config_read: %w", Status(st))
	}
	defer C.ucp_config_release(cfg)
	for _, kv := range modify {
		k, v := C.CString(kv[0]), C.CString(kv[1])
		st := C.ucp_config_modify(cfg, k, v)
		C.free(unsafe.Pointer(k))
		C.free(unsafe.Pointer(v))
		if st != C.UCS_OK {
			return fmt.Errorf("ucx: option %s=%s: %w", kv[0], kv[1], Status(st))
		}
	}
	name := C.CString(w.cfg.Name)
	defer C.free(unsafe.Pointer(name))
	if st := C.hx_init(cfg, name, &w.uctx); st != C.UCS_OK {
		return fmt.Errorf("ucx: ucp_init: %w", Status(st))
	}
	if st := C.hx_worker_create(w.uctx, name, &w.uw); st != C.UCS_OK {
		return fmt.Errorf("ucx: ucp_worker_create: %w", Status(st))
	}
	if st := C.ucp_worker_get_efd(w.uw, &w.efd); st != C.UCS_OK {
		return fmt.Errorf("ucx: ucp_worker_get_efd: %w", Status(st))
	}
	var a *C.ucp_address_t
	var n C.size_t
	if st := C.ucp_worker_get_address(w.uw, &a, &n); st != C.UCS_OK {
		return fmt.Errorf("ucx: ucp_worker_get_address: %w", Status(st))
	}
	w.addr = C.GoBytes(unsafe.Pointer(a), C.int(n))
	C.ucp_worker_release_address(w.uw, a)
	var mh C.size_t
	if st := C.hx_max_am_header(w.uw, &mh); st != C.UCS_OK {
		return fmt.Errorf("ucx: ucp_worker_query: %w", Status(st))
	}
	w.maxHeader = int(mh)
	if st := C.hx_set_am_handler(w.uw, amID, C.uintptr_t(uint64(w.id)<<seqBits)); st != C.UCS_OK {
		return fmt.Errorf("ucx: ucp_worker_set_am_recv_handler: %w", Status(st))
	}
	fd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		return fmt.Errorf("ucx: eventfd: %w", err)
	}
	w.wakefd = fd
	return nil
}

// free releases what init made, in reverse; the worker must have no
// endpoints left.
func (w *Worker) free() {
	if w.uw != nil {
		C.ucp_worker_destroy(w.uw)
		w.uw = nil
	}
	if w.uctx != nil {
		C.ucp_cleanup(w.uctx)
		w.uctx = nil
	}
	w.mu.Lock()
	if w.wakefd >= 0 {
		unix.Close(w.wakefd)
		w.wakefd = -1
	}
	w.mu.Unlock()
	registry.Lock()
	delete(registry.m, w.id)
	registry.Unlock()
}

// Address returns the worker's UCX address, for a peer's Connect. It holds
// the worker's transport addresses (tcp interfaces and ports, this
// process's id for cma): carry it over the control plane.
func (w *Worker) Address() []byte { return append([]byte(nil), w.addr...) }

// MaxHeader returns the largest header Post accepts (UCX's max_am_header,
// about 8 KiB on tcp).
func (w *Worker) MaxHeader() int { return w.maxHeader }

// Stats returns the worker's counters.
func (w *Worker) Stats() Stats {
	return Stats{
		Sleeps: w.st.sleeps.Load(), SleepTimeouts: w.st.sleepTimeouts.Load(),
		Progress: w.st.progress.Load(), Sent: w.st.sent.Load(), SendFailed: w.st.sendFailed.Load(),
		Admitted: w.st.admitted.Load(), Refused: w.st.refused.Load(), Received: w.st.received.Load(),
		ReceiveFailed: w.st.receiveFailed.Load(), PeerErrors: w.st.peerErrors.Load(),
	}
}

// onOwner reports whether the caller runs on the owner goroutine: its
// thread is locked, so while it runs its thread id names it (once it has
// ended, the id may come back for another thread).
func (w *Worker) onOwner() bool {
	select {
	case <-w.done:
		return false
	default:
		return unix.Gettid() == w.tid
	}
}

// submit queues f for the owner and wakes it. f runs with closing false,
// or with closing true (do nothing but fail) once the worker is torn down.
func (w *Worker) submit(f func(closing bool)) error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return ErrClosed
	}
	w.queue = append(w.queue, f)
	w.wake()
	w.mu.Unlock()
	return nil
}

// wake makes the owner's sleep return. w.mu is held: the owner closes the
// eventfd under it.
func (w *Worker) wake() {
	if w.wakefd < 0 {
		return
	}
	one := [8]byte{1}
	unix.Write(w.wakefd, one[:]) //nolint:errcheck // EAGAIN: already awake
}

// call runs f on the owner and returns its result, or ctx's error first.
func (w *Worker) call(ctx context.Context, f func() error) error {
	if w.onOwner() {
		return ErrOwner
	}
	res := make(chan error, 1)
	err := w.submit(func(closing bool) {
		switch {
		case closing:
			res <- ErrClosed
		case ctx.Err() != nil:
			res <- ctx.Err()
		default:
			res <- f()
		}
	})
	if err != nil {
		return err
	}
	select {
	case err := <-res:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (w *Worker) nextSeq() uint64 {
	w.seq++
	return w.seq
}

func (w *Worker) ud(seq uint64) C.uintptr_t { return C.uintptr_t(uint64(w.id)<<seqBits | seq) }

// Connect makes an endpoint to the worker whose Address is addr, in peer
// error-handling mode (UCP_ERR_HANDLING_MODE_PEER: only transports that
// detect a dead peer; keepalive every UCX_KEEPALIVE_INTERVAL, 20 s by
// default). UCX connects lazily: an unreachable peer shows as the first
// Post failing, or as OnPeerError. If ctx ends first, an endpoint made
// meanwhile is closed with the worker.
func (w *Worker) Connect(ctx context.Context, addr []byte) (EndpointID, error) {
	if len(addr) == 0 {
		return 0, fmt.Errorf("ucx: connect: empty address: %w", ErrInvalidParam)
	}
	a := append([]byte(nil), addr...)
	var id EndpointID
	err := w.call(ctx, func() error {
		w.nextEP++
		e := &endpoint{id: w.nextEP, closed: make(chan struct{})}
		if st := C.hx_ep_create(w.uw, unsafe.Pointer(&a[0]), w.ud(uint64(e.id)), &e.h); st != C.UCS_OK {
			return fmt.Errorf("ucx: ucp_ep_create: %w", Status(st))
		}
		w.eps[e.id] = e
		w.byH[e.h] = e
		id = e.id
		return nil
	})
	if err != nil {
		// Not id: when ctx ended first, f may be writing it still.
		return 0, err
	}
	return id, nil // f's write came before call's receive of its result
}

// EndpointInfo returns ucp_ep_print_info's text for ep: the lanes UCX chose
// once the endpoint is wired up (UCX 1.13: "ep_cfg[0]: ... am(tcp/lo) ...",
// rma_bw lanes naming the rendezvous transports).
func (w *Worker) EndpointInfo(ctx context.Context, ep EndpointID) (string, error) {
	var s string
	err := w.call(ctx, func() error {
		e := w.eps[ep]
		if e == nil || e.closing {
			return ErrUnknownEndpoint
		}
		var n C.size_t
		p := C.hx_ep_info(e.h, &n)
		if p == nil {
			return fmt.Errorf("ucx: open_memstream: %w", ErrInvalidParam)
		}
		s = C.GoStringN(p, C.int(n))
		C.free(unsafe.Pointer(p))
		return nil
	})
	if err != nil {
		return "", err // as in Connect: s may be being written
	}
	return s, nil
}

// CloseEndpoint closes ep and waits, up to ctx, until UCX released it.
// CloseFlush first completes its operations, which needs the peer;
// CloseForce fails them (ErrCanceled). An endpoint whose peer failed is
// already being closed by force: CloseEndpoint waits for that. A flush
// close that ctx gave up on goes on; Close ends it.
func (w *Worker) CloseEndpoint(ctx context.Context, ep EndpointID, mode CloseMode) error {
	var e *endpoint
	err := w.call(ctx, func() error {
		e = w.eps[ep]
		if e == nil {
			return ErrUnknownEndpoint
		}
		if !e.closing {
			w.closeEP(e, mode == CloseForce)
		}
		return nil
	})
	if err != nil {
		return err
	}
	select {
	case <-e.closed:
		return e.err
	case <-ctx.Done():
		return ctx.Err()
	case <-w.done:
		return nil
	}
}

// closeEP starts e's close on the owner. From here on e.h is UCX's: a
// force close completes at once and UCX frees the endpoint within a few
// progress calls, even while receives that came by it go on, and may
// hand the address to a new endpoint.
func (w *Worker) closeEP(e *endpoint, force bool) {
	e.closing = true
	delete(w.byH, e.h)
	seq := w.nextSeq()
	w.closes[seq] = e
	f := C.int(0)
	if force {
		f = 1
	}
	p := C.hx_ep_close(e.h, f, w.ud(seq))
	if p == nil || C.hx_ptr_is_err(p) != 0 {
		if _, ok := w.closes[seq]; ok {
			delete(w.closes, seq)
			w.closedEP(e, C.hx_ptr_status(p))
		}
	}
}

func (w *Worker) closedEP(e *endpoint, st C.int) {
	if st != C.UCS_OK && e.failed == nil {
		e.err = Status(st)
	}
	delete(w.eps, e.id)
	if e.failed != nil {
		w.dead[e.id] = e.failed
	}
	close(e.closed)
}

// cut force-closes the endpoint r came by, when it is ours and still
// open: UCX then completes the requests on it (receives still copying
// fragments end with ErrCanceled), and the peer's endpoint fails. An
// endpoint UCX made for the peer is left alone: UCX destroys those itself
// when the peer fails, without a word, so a handle kept for one could be
// freed, or another endpoint's, by the time it was closed.
func (w *Worker) cut(r *recv) {
	if e := r.via; e != nil && !e.closing {
		w.closeEP(e, true)
	}
}

// Abort ends the receives filed under tok that are still in flight, for a
// Fence that ran out of time: it force-closes the connections they came by
// (each to its sender, who sees its endpoint fail, as after a tcp reset;
// every other receive and operation on them fails too). Only endpoints of
// this worker's are cut: a receiver that may need to Abort connects back
// to its senders before they send, and UCX then delivers their messages by
// that endpoint (it pairs the two sides' endpoints). A receive copying
// fragments (tcp) ends with ErrCanceled at once, after at most the
// fragment in hand lands; one the worker pulls itself (a cma GET) runs to
// its end, which needs nothing from the sender. Abort returns when the
// closes have started; Fence waits for the receives.
func (w *Worker) Abort(ctx context.Context, tok Token) error {
	return w.call(ctx, func() error {
		for _, r := range w.recvs {
			if r.token == tok {
				w.cut(r)
			}
		}
		return nil
	})
}

// Post sends header and payload to ep as one active message and returns at
// once; the Op says when it completed. A payload goes by rendezvous
// (UCP_AM_SEND_FLAG_RNDV): the receiver sees the header first, and its
// Admit either pulls the payload into a destination of its choosing or
// refuses it, which fails the Op with ErrRejected. A header-only message
// (empty payload) goes eagerly: it cannot be refused.
//
// UCX reads header and payload until the Op is done: they must not be
// modified until then (Go memory is pinned for that long; the payload is
// usually a registered mmap region). Failures to send (an unknown or failed
// endpoint) are reported by the Op too.
func (w *Worker) Post(ep EndpointID, header, payload []byte) (*Op, error) {
	if len(header) > w.maxHeader {
		return nil, fmt.Errorf("%w: %d > %d bytes", ErrHeaderTooLarge, len(header), w.maxHeader)
	}
	o := &Op{ep: ep, hdr: append([]byte(nil), header...), payload: payload, done: make(chan struct{})}
	if len(o.hdr) > 0 {
		o.pin.Pin(&o.hdr[0])
	}
	if len(payload) > 0 {
		o.pin.Pin(&payload[0])
	}
	if err := w.submit(func(closing bool) {
		if closing {
			o.finish(w, ErrClosed)
			return
		}
		w.startSend(o)
	}); err != nil {
		o.pin.Unpin()
		return nil, err
	}
	return o, nil
}

// Send is Post and Wait.
func (w *Worker) Send(ctx context.Context, ep EndpointID, header, payload []byte) error {
	if w.onOwner() {
		return ErrOwner
	}
	o, err := w.Post(ep, header, payload)
	if err != nil {
		return err
	}
	return o.Wait(ctx)
}

func (w *Worker) startSend(o *Op) {
	e := w.eps[o.ep]
	switch {
	case e == nil && w.dead[o.ep] != nil:
		o.finish(w, w.dead[o.ep])
		return
	case e == nil:
		o.finish(w, ErrUnknownEndpoint)
		return
	case e.failed != nil:
		o.finish(w, e.failed)
		return
	case e.closing:
		o.finish(w, fmt.Errorf("%w: closing", ErrUnknownEndpoint))
		return
	}
	var hp, pp unsafe.Pointer
	if len(o.hdr) > 0 {
		hp = unsafe.Pointer(&o.hdr[0])
	}
	rndv := C.int(0)
	if len(o.payload) > 0 {
		pp = unsafe.Pointer(&o.payload[0])
		rndv = 1
	}
	seq := w.nextSeq()
	w.sends[seq] = o
	p := C.hx_am_send(e.h, amID, hp, C.size_t(len(o.hdr)), pp, C.size_t(len(o.payload)), rndv, w.ud(seq))
	if p == nil || C.hx_ptr_is_err(p) != 0 {
		if _, ok := w.sends[seq]; ok {
			delete(w.sends, seq)
			o.finish(w, statusErr(C.hx_ptr_status(p)))
		}
	}
}

func statusErr(st C.int) error {
	if st == C.UCS_OK {
		return nil
	}
	return Status(st)
}

// Fence waits until every receive filed under tok has ended (landed or
// failed, and its Done returned), or ctx ends. It counts every admission
// that ran before Fence was called: if the caller first makes Admit refuse
// tok (a revoked grant) and then calls Fence, then when Fence returns nil
// no byte of tok's messages is in flight and none will land. After Close
// it returns nil: nothing is in flight. A receive whose sender stopped
// progressing (tcp fragments from a frozen process) holds Fence until the
// sender resumes or is found dead (keepalive, a reset connection), or ctx.
func (w *Worker) Fence(ctx context.Context, tok Token) error {
	if w.onOwner() {
		return ErrOwner
	}
	ch := make(chan struct{})
	err := w.submit(func(closing bool) {
		g := w.groups[tok]
		if closing || g == nil {
			close(ch)
			return
		}
		g.waiters = append(g.waiters, ch)
	})
	if err != nil {
		ch = w.done // closing: everything ends with the owner
	}
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

//export hxSendDone
func hxSendDone(ud C.uintptr_t, st C.int) {
	w, seq := lookup(ud)
	if w == nil {
		return
	}
	if o, ok := w.sends[seq]; ok {
		delete(w.sends, seq)
		err := statusErr(st)
		if err == nil {
			o.finish(w, nil)
			return
		}
		// After the error handlers of this progress call ran (deliver runs
		// them first), so a peer's failure names itself.
		w.later = append(w.later, func() {
			if e := w.eps[o.ep]; e != nil && e.failed != nil {
				err = fmt.Errorf("%w (op: %w)", e.failed, err)
			} else if d := w.dead[o.ep]; d != nil {
				err = fmt.Errorf("%w (op: %w)", d, err)
			}
			o.finish(w, err)
		})
	}
}

//export hxCloseDone
func hxCloseDone(ud C.uintptr_t, st C.int) {
	w, seq := lookup(ud)
	if w == nil {
		return
	}
	if e, ok := w.closes[seq]; ok {
		delete(w.closes, seq)
		w.closedEP(e, st)
	}
}

//export hxEpError
func hxEpError(ud C.uintptr_t, st C.int) {
	w, id := lookup(ud)
	if w == nil {
		return
	}
	w.failed = append(w.failed, epFailure{EndpointID(id), Status(st)})
}

//export hxRecvDone
func hxRecvDone(ud C.uintptr_t, st C.int, length C.size_t) {
	w, seq := lookup(ud)
	if w == nil {
		return
	}
	r, ok := w.recvs[seq]
	if !ok {
		return
	}
	delete(w.recvs, seq)
	err := statusErr(st)
	if err == nil && int(length) != len(r.dest) {
		err = fmt.Errorf("%w: %d of %d bytes", ErrTruncated, int(length), len(r.dest))
	}
	w.later = append(w.later, func() { w.endRecv(r, err) })
}

//export hxAMRecv
func hxAMRecv(arg C.uintptr_t, hdr unsafe.Pointer, hdrLen C.size_t, data unsafe.Pointer, n C.size_t, attr C.uint64_t, reply unsafe.Pointer) C.int {
	w, _ := lookup(arg)
	if w == nil {
		return C.UCS_ERR_REJECTED
	}
	return w.onMessage(hdr, int(hdrLen), data, int(n), attr&C.UCP_AM_RECV_ATTR_FLAG_RNDV != 0, C.ucp_ep_h(reply))
}

// onMessage admits or refuses one arriving message, inside UCX's AM
// callback.
func (w *Worker) onMessage(hdr unsafe.Pointer, hdrLen int, data unsafe.Pointer, n int, rndv bool, reply C.ucp_ep_h) C.int {
	m := Message{Length: n, Rendezvous: rndv}
	if hdrLen > 0 {
		m.Header = unsafe.Slice((*byte)(hdr), hdrLen)
	}
	adm, err := w.admit(m)
	if err == nil && len(adm.Dest) < n {
		err = fmt.Errorf("%w: destination %d < payload %d bytes", ErrTruncated, len(adm.Dest), n)
	}
	if err != nil {
		w.st.refused.Add(1)
		if !rndv {
			// An eager message is dropped: its sender completed already,
			// and an error returned for one fails an assertion that
			// aborts the process in UCX 1.13 (ucp_am.c:1296,
			// ucp_am_handler and ucp_am_handler_reply).
			return C.UCS_OK
		}
		if s := Status(0); errors.As(err, &s) && s < 0 {
			return C.int(s)
		}
		return C.UCS_ERR_REJECTED
	}
	w.st.admitted.Add(1)
	r := &recv{dest: adm.Dest[:n:n], token: adm.Token, done: adm.Done, via: w.byH[reply]}
	g := w.groups[r.token]
	if g == nil {
		g = &group{}
		w.groups[r.token] = g
	}
	g.n++
	if n == 0 || !rndv {
		if n > 0 {
			copy(r.dest, unsafe.Slice((*byte)(data), n))
		}
		w.later = append(w.later, func() { w.endRecv(r, nil) })
		return C.UCS_OK
	}
	r.pin.Pin(&r.dest[0])
	seq := w.nextSeq()
	w.recvs[seq] = r
	p := C.hx_am_recv_data(w.uw, data, unsafe.Pointer(&r.dest[0]), C.size_t(n), w.ud(seq))
	if p == nil || C.hx_ptr_is_err(p) != 0 {
		if _, ok := w.recvs[seq]; ok {
			delete(w.recvs, seq)
			err := statusErr(C.hx_ptr_status(p))
			w.later = append(w.later, func() { w.endRecv(r, err) })
		}
	}
	// A receive started in the callback is UCX's from here on, whatever we
	// return (an error here trips an assertion in ucp_am_rndv_process_rts).
	// One that failed to start (no memory) keeps its descriptor and sends
	// the sender no answer: the sender's operation ends with its deadline
	// or a force close.
	return C.UCS_OK
}

// admit calls Config.Admit, turning a panic into a refusal; the owner
// re-raises it once UCX's callback has returned.
func (w *Worker) admit(m Message) (adm Admission, err error) {
	if w.cfg.Admit == nil {
		return adm, ErrRejected
	}
	defer func() {
		if r := recover(); r != nil {
			if w.panicked == nil {
				w.panicked = fmt.Sprintf("ucx: Admit panicked: %v\n%s", r, debug.Stack())
			}
			err = ErrRejected
		}
	}()
	return w.cfg.Admit(m)
}

// endRecv ends a receive on the owner, outside UCX's callbacks. A leaked
// one stays pinned.
func (w *Worker) endRecv(r *recv, err error) {
	if !errors.Is(err, ErrLeaked) {
		r.pin.Unpin()
	}
	if err == nil {
		w.st.received.Add(1)
	} else {
		w.st.receiveFailed.Add(1)
	}
	if r.done != nil {
		r.done(err)
	}
	g := w.groups[r.token]
	g.n--
	if g.n == 0 {
		for _, ch := range g.waiters {
			close(ch)
		}
		delete(w.groups, r.token)
	}
}

// loop is the owner's: run submitted work, progress UCX, deliver
// completions, then arm the worker and sleep on its event fd and the wake
// eventfd until either is readable (or MaxSleep).
func (w *Worker) loop() {
	for {
		w.mu.Lock()
		q, closed := w.queue, w.closed
		w.queue = nil
		w.mu.Unlock()
		for _, f := range q {
			f(false)
		}
		w.progress()
		if closed {
			w.shutdown()
			return
		}
		w.mu.Lock()
		more := len(w.queue) > 0 || w.closed
		w.mu.Unlock()
		if more {
			continue
		}
		if st := C.ucp_worker_arm(w.uw); st == C.UCS_ERR_BUSY {
			continue
		}
		w.sleep()
	}
}

// progress calls ucp_worker_progress until it reports nothing done (or a
// burst), then delivers what the callbacks left for later.
func (w *Worker) progress() {
	for i := 0; i < progressBurst; i++ {
		w.st.progress.Add(1)
		if C.ucp_worker_progress(w.uw) == 0 {
			break
		}
	}
	if w.panicked != nil {
		panic(w.panicked)
	}
	w.deliver()
}

func (w *Worker) deliver() {
	for len(w.later) > 0 || len(w.failed) > 0 {
		for _, f := range w.failed {
			w.peerFailed(f)
		}
		w.failed = w.failed[:0]
		later := w.later
		w.later = nil
		for _, f := range later {
			f()
		}
	}
}

func (w *Worker) peerFailed(f epFailure) {
	e := w.eps[f.id]
	if e == nil || e.failed != nil {
		return
	}
	w.st.peerErrors.Add(1)
	e.failed = fmt.Errorf("%w: %w", ErrPeerFailed, f.status)
	if !e.closing {
		w.closeEP(e, true)
	}
	if cb := w.cfg.OnPeerError; cb != nil {
		err := e.failed
		w.later = append(w.later, func() { cb(f.id, err) })
	}
}

func (w *Worker) sleep() {
	fds := []unix.PollFd{{Fd: int32(w.efd), Events: unix.POLLIN}, {Fd: int32(w.wakefd), Events: unix.POLLIN}}
	w.st.sleeps.Add(1)
	n, err := unix.Poll(fds, w.maxSleep)
	if err == nil && n == 0 {
		w.st.sleepTimeouts.Add(1)
	}
	if fds[1].Revents != 0 {
		var b [8]byte
		unix.Read(w.wakefd, b[:]) //nolint:errcheck // nonblocking; EAGAIN is fine
	}
}

// shutdown tears the worker down on the owner: force-closes its endpoints,
// which cuts the receives in flight that came by them (ucp_worker_destroy
// must find no request in flight: UCX asserts it), progresses until they
// are closed and the receives ended, destroys the worker (after which UCX
// touches no buffer of ours), fails what is left, then the queued work.
func (w *Worker) shutdown() {
	for _, r := range w.recvs {
		w.cut(r)
	}
	for _, e := range w.eps {
		if !e.closing {
			w.closeEP(e, true)
		}
	}
	deadline := time.Now().Add(shutdownGrace)
	for len(w.closes)+len(w.recvs) > 0 && time.Now().Before(deadline) {
		w.progress()
		if len(w.closes)+len(w.recvs) > 0 && C.ucp_worker_arm(w.uw) == C.UCS_OK {
			w.sleep()
		}
	}
	if w.leaked = len(w.recvs); w.leaked == 0 {
		C.ucp_worker_destroy(w.uw)
		C.ucp_cleanup(w.uctx)
	}
	// Else a receive came by an endpoint UCX made, which Close does not cut
	// (cut), and never ended: the worker is left as it is, never progressed
	// again. An RDMA read already posted may still land in its destination,
	// which therefore stays pinned and UCX's for good (ErrLeaked).
	w.uw, w.uctx = nil, nil
	for seq, o := range w.sends {
		delete(w.sends, seq)
		o.finish(w, ErrClosed)
	}
	for seq, r := range w.recvs {
		delete(w.recvs, seq)
		leakedRecvs.Lock()
		leakedRecvs.rs = append(leakedRecvs.rs, r)
		leakedRecvs.Unlock()
		w.later = append(w.later, func() { w.endRecv(r, ErrLeaked) })
	}
	for seq, e := range w.closes {
		delete(w.closes, seq)
		w.closedEP(e, C.UCS_OK)
	}
	for _, e := range w.eps {
		w.closedEP(e, C.UCS_OK)
	}
	w.failed = nil
	w.deliver()
	w.free()
	w.mu.Lock()
	q := w.queue
	w.queue = nil
	w.mu.Unlock()
	for _, f := range q {
		f(true)
	}
}

// Close stops the owner goroutine and frees the worker: endpoints are
// closed by force, and operations and receives still in flight end with
// ErrClosed (their Done callbacks run) before Close returns. After Close
// UCX reads and writes no memory given to this worker. Close is
// idempotent; it must not be called from a callback (ErrOwner).
func (w *Worker) Close() error {
	if w.onOwner() {
		return ErrOwner
	}
	w.mu.Lock()
	w.closed = true
	w.wake()
	w.mu.Unlock()
	<-w.done
	if w.leaked > 0 {
		return fmt.Errorf("ucx: close: %d receives never ended; the UCX worker was left allocated", w.leaked)
	}
	return nil
}
