//go:build linux && cgo && ucx

package ucx

// Receives: admission inside UCX's active-message callback, the pull of
// a payload into the admitted destination, and the fences by token.

/*
#include "shim.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"
	"slices"
	"sync"
	"unsafe"
)

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
	leaked  bool         // Close left one of them in flight
	waiters []chan error // Fences: ErrLeaked (or nothing), then closed
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

// Fence waits until every receive filed under tok has ended (landed or
// failed, and its Done returned), or ctx ends. It counts every admission
// that ran before Fence was called: if the caller first makes Admit refuse
// tok (a revoked grant) and then calls Fence, then when Fence returns nil
// no byte of tok's messages is in flight and none will land. After Close
// it returns nil: nothing is in flight; or ErrLeaked, when Close left one
// of tok's receives in flight. A receive whose sender stopped
// progressing (tcp fragments from a frozen process) holds Fence until the
// sender resumes or is found dead (keepalive, a reset connection), or ctx.
func (w *Worker) Fence(ctx context.Context, tok Token) error {
	if w.onOwner() {
		return ErrOwner
	}
	ch := make(chan error, 1)
	err := w.submit(func(closing bool) {
		g := w.groups[tok]
		if closing || g == nil {
			if closing && w.leakedToks[tok] {
				ch <- ErrLeaked
			}
			close(ch)
			return
		}
		g.waiters = append(g.waiters, ch)
	})
	if err != nil {
		select { // closing: everything ends with the owner
		case <-w.done:
			if w.leakedToks[tok] { // shutdown's writes came before done
				return ErrLeaked
			}
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	select {
	case err := <-ch:
		return err
	case <-ctx.Done():
		// No longer waited for: a group that never drains (a stalled
		// receive, fenced again and again) must not gather channels.
		_ = w.submit(func(bool) {
			if g := w.groups[tok]; g != nil {
				g.waiters = slices.DeleteFunc(g.waiters, func(c chan error) bool { return c == ch })
			}
		})
		return ctx.Err()
	}
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
	if errors.Is(err, ErrLeaked) {
		r.done = nil // leakedRecvs keeps dest and pin, not what Done held
		g.leaked = true
	}
	g.n--
	if g.n == 0 {
		for _, ch := range g.waiters {
			if g.leaked {
				ch <- ErrLeaked
			}
			close(ch)
		}
		delete(w.groups, r.token)
	}
}
