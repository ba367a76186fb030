//go:build linux && cgo && ucx

package ucx

// The Worker: its UCP context and worker, made and torn down on the owner
// goroutine (owner_ucx.go), and the registry that UCX's callbacks find it
// by.

/*
#cgo LDFLAGS: -lucp -lucs
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"os"
	"runtime"
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
		endpoints                                              atomic.Int64
	}

	// Owner-only.
	uctx     C.ucp_context_h
	uw       C.ucp_worker_h
	efd      C.int
	seq      uint64
	nextEP   EndpointID
	eps      map[EndpointID]*endpoint
	dead     map[EndpointID]error // endpoints closed after their peer failed, until CloseEndpoint
	sends    map[uint64]*Op
	recvs    map[uint64]*recv
	closes   map[uint64]*endpoint
	groups   map[Token]*group
	later    []func() // completions, delivered outside UCX's callbacks
	failed   []epFailure
	byH      map[C.ucp_ep_h]*endpoint // our endpoints not yet closing, by handle
	panicked any
	leaked   int // receives still in flight when Close gave up
	// The tokens of those receives: Fence's answer after Close. Written
	// by shutdown, read by Fence once done is closed.
	leakedToks map[Token]bool
}

// New creates a worker and starts its owner goroutine. Call Close to stop
// it and free its UCX resources.
func New(cfg Config) (*Worker, error) {
	w := &Worker{
		cfg:        cfg,
		maxSleep:   int((cfg.MaxSleep + time.Millisecond - 1) / time.Millisecond),
		done:       make(chan struct{}),
		eps:        map[EndpointID]*endpoint{},
		dead:       map[EndpointID]error{},
		sends:      map[uint64]*Op{},
		recvs:      map[uint64]*recv{},
		closes:     map[uint64]*endpoint{},
		groups:     map[Token]*group{},
		byH:        map[C.ucp_ep_h]*endpoint{},
		leakedToks: map[Token]bool{},
		wakefd:     -1,
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
		Endpoints: w.st.endpoints.Load(),
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
		w.leakedToks[r.token] = true
		leakedRecvs.Lock()
		leakedRecvs.rs = append(leakedRecvs.rs, r)
		leakedRecvs.Unlock()
		w.later = append(w.later, func() { w.endRecv(r, ErrLeaked) })
	}
	for seq, e := range w.closes {
		delete(w.closes, seq)
		e.released = true // the worker is gone: nothing is kept for the caller
		w.closedEP(e, C.UCS_OK)
	}
	for _, e := range w.eps {
		e.released = true
		w.closedEP(e, C.UCS_OK)
	}
	for ep := range w.dead {
		w.forget(ep)
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
