//go:build linux && cgo && ucx

package ucx

// Sends: an Op per active message posted, and its completion.

/*
#include "shim.h"
*/
import "C"

import (
	"context"
	"fmt"
	"runtime"
	"unsafe"
)

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
