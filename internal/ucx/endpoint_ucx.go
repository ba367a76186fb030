//go:build linux && cgo && ucx

package ucx

// Endpoints: made by Connect, closed by CloseEndpoint, by a peer's failure
// or by a cut, and forgotten once UCX completed the close.

/*
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"context"
	"fmt"
	"unsafe"
)

type endpoint struct {
	id       EndpointID
	h        C.ucp_ep_h    // not to be used once closing: UCX may free it
	failed   error         // the peer failed: sends fail with this
	closing  bool          // ucp_ep_close_nbx was called
	released bool          // CloseEndpoint was called: its id is the caller's no more
	closed   chan struct{} // closed once that close completed
	err      error         // its status, set before closed is closed
}

type epFailure struct {
	id     EndpointID
	status Status
}

// Connect makes an endpoint to the worker whose Address is addr, in peer
// error-handling mode (UCP_ERR_HANDLING_MODE_PEER: only transports that
// detect a dead peer; keepalive every UCX_KEEPALIVE_INTERVAL, 20 s by
// default). UCX connects lazily: an unreachable peer shows as the first
// Post failing, or as OnPeerError. If ctx ends first, an endpoint made
// meanwhile is closed at once.
func (w *Worker) Connect(ctx context.Context, addr []byte) (EndpointID, error) {
	if len(addr) == 0 {
		return 0, fmt.Errorf("ucx: connect: empty address: %w", ErrInvalidParam)
	}
	a := append([]byte(nil), addr...)
	var made *endpoint
	err := w.callUndo(ctx, func() error {
		w.nextEP++
		e := &endpoint{id: w.nextEP, closed: make(chan struct{})}
		if st := C.hx_ep_create(w.uw, unsafe.Pointer(&a[0]), w.ud(uint64(e.id)), &e.h); st != C.UCS_OK {
			return fmt.Errorf("ucx: ucp_ep_create: %w", Status(st))
		}
		w.eps[e.id] = e
		w.byH[e.h] = e
		w.st.endpoints.Add(1)
		made = e
		return nil
	}, func() {
		// ctx ended before the caller heard of it: closed at once, not
		// left until Close.
		made.released = true
		w.closeEP(made, true)
	})
	if err != nil {
		return 0, err
	}
	return made.id, nil // f's write came before callUndo's receive of its result
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
			if _, ok := w.dead[ep]; !ok {
				return ErrUnknownEndpoint
			}
			w.forget(ep) // closed when its peer failed: the caller is done with it
			return nil
		}
		e.released = true
		if !e.closing {
			w.closeEP(e, mode == CloseForce)
		}
		return nil
	})
	if err != nil || e == nil {
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
	if e.failed != nil && !e.released {
		w.dead[e.id] = e.failed // Posts on it name the failure until CloseEndpoint
	} else {
		w.st.endpoints.Add(-1)
	}
	close(e.closed)
}

// forget drops a dead endpoint's id: from here on it is unknown.
func (w *Worker) forget(ep EndpointID) {
	delete(w.dead, ep)
	w.st.endpoints.Add(-1)
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
