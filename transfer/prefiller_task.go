package transfer

// The prefiller's per-request driver: a task runs one request's WriteSession.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/micro"
	"go.opentelemetry.io/otel/trace"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/transfer/wire"
)

// task is one admitted request's driver state, owned by its goroutine.
type task struct {
	p      *Prefiller
	next   *task  // the next task of the same request id (under Prefiller.mu)
	reply  string // reply subject
	msg    wire.PrefillRequest
	peer   rdma.Descriptor // msg.Peer's
	ticket rdma.Ticket
	sess   session.WriteSession
	lease  AdmittedJob
	lw     *streamer // the cache's stream while prefill computes (layerwise), else nil
	early  uint64    // bytes lw's pieces wrote: the parts prefill finished while computing

	ctx    context.Context    // the task's context, done at its deadline or on abort
	stop   context.CancelFunc // ctx's
	start  time.Time          // when the request was taken: a monotonic reading, see now
	aborts atomic.Uint32      // external abort code, first one wins

	out      Prefilled
	src      [4]rdma.Extent // room for out.Source's extents
	manifest rdma.Manifest
	pf, wr   time.Duration
	cause    error
	span     trace.Span // the request's span when traced, else nil
}

// newTask returns a zero task: one a finished request left, or a new one.
func (p *Prefiller) newTask() *task {
	if t, ok := p.free.Get().(*task); ok {
		return t
	}
	return new(task)
}

// freeTask keeps t for a later request, once it is out of p.tasks and done
// with: no abort reaches it any more, its lease was released and the caller
// of run does not touch it.
func (p *Prefiller) freeTask(t *task) {
	*t = task{}
	p.free.Put(t)
}

// removeTaskLocked drops t from the tasks of its request id. p.mu is held.
func (p *Prefiller) removeTaskLocked(t *task) {
	id := t.msg.RequestID
	for at := p.tasks[id]; at != nil; at = at.next {
		switch {
		case at == t && at == p.tasks[id]:
			if t.next == nil {
				delete(p.tasks, id)
			} else {
				p.tasks[id] = t.next
			}
		case at.next == t:
			at.next = t.next
		default:
			continue
		}
		t.next = nil
		return
	}
}

// now reads the clock as the monotonic time since the task's start: half the
// cost of time.Now (one clock read, not two).
func (t *task) now() time.Time { return t.start.Add(time.Since(t.start)) }

func (t *task) abort(code session.Code) {
	if t.aborts.CompareAndSwap(0, uint32(code)) {
		t.stop()
	}
}

// handle runs on the endpoint's dispatch goroutine: decode, check, admit, and
// either reply at once (refusals) or hand the request to a worker goroutine.
func (p *Prefiller) handle(r micro.Request) {
	p.received.Add(1)
	m, peer, err := p.peers.DecodePrefillRequest(r.Data())
	if err != nil {
		p.refused.Add(1)
		p.replyNow(r, wire.PrefillReply{Code: session.CodeBadMessage, Msg: err.Error()})
		return
	}
	tk := m.Ticket
	t := p.newTask()
	t.start = time.Now()
	if p.tracer != nil {
		t.span = p.startSpan(r, &m, t.start)
	}
	// The deadline as a monotonic reading from here on, as
	// context.WithDeadline would arm it: later checks read one clock. It is
	// the time the decoder had left (Budget) from this receipt, so a clock
	// skew between the hosts neither shortens nor stretches it; the
	// request's transit time is not counted, so it errs late by that.
	deadline := t.start.Add(time.Unix(0, m.Deadline).Sub(t.start))
	if m.Budget > 0 {
		deadline = t.start.Add(time.Duration(m.Budget))
	}
	// The ticket's deadline is the receiver's wall clock; the writer checks
	// it against its own, so it gets the local equivalent.
	tk.Deadline = deadline
	t.p, t.reply, t.msg, t.peer, t.ticket = p, r.Reply(), m, peer, tk
	t.sess.Reset(session.WriteParams{
		RequestID: m.RequestID, MaxDraftTokens: p.cfg.MaxDraftTokens, Deadline: deadline,
		Fingerprint: m.Fingerprint, Local: p.cfg.Fingerprint, KVBytes: m.KVBytes, MambaBytes: m.MambaBytes,
	})
	// The session asks to admit (session.ActAdmit); that is done inline below.
	t.sess.Step(session.Event{Kind: session.EvRequest, Now: t.start})
	if t.sess.State().Terminal() {
		p.refused.Add(1)
		p.replyNow(r, t.replyFor(t.sess.Code()))
		endSpanCode(t.span, t.sess.Code(), t.cause)
		return
	}
	// The task is one of p.tasks from before Admit: a cancel (or the
	// requester's death) that comes while the executor admits finds it, and
	// the request ends at once when admitted. Taken in after Admit, the
	// task would miss it, and hold its slot through a whole prefill.
	t.ctx, t.stop = context.WithDeadline(context.Background(), deadline)
	p.mu.Lock()
	if st := p.state; st != 1 {
		p.mu.Unlock()
		t.stop()
		p.refuseNotServing(r, t, st)
		return
	}
	t.next = p.tasks[m.RequestID]
	p.tasks[m.RequestID] = t
	p.mu.Unlock()
	lease, err := p.exec.Admit(Job{RequestID: m.RequestID, Tokens: m.Tokens, Sampling: m.Sampling, Deadline: deadline, From: m.From, TP: max(int(m.TP), 1), Span: t.span, Drafts: int(m.Drafts), Skip: int(m.Skip)})
	code := session.CodeOK
	if err != nil {
		code = codeOf(err)
		if code == session.CodePeerFailed {
			code = session.CodePrefillFailed
		}
		t.cause = err
	} else if lease == nil {
		code, t.cause = session.CodePrefillFailed, errors.New("executor admitted without a lease")
	}
	t.lease = lease
	if c := session.Code(t.aborts.Load()); c != session.CodeOK {
		// Cancelled while admitting: the session releases the lease
		// and replies with the cancel's code once it hears the outcome.
		t.sess.Step(session.Event{Kind: session.EvCancel, Code: c, Now: t.now()})
	}
	acts := t.sess.Step(session.Event{Kind: session.EvAdmitted, Code: code, Now: t.now()})
	if t.sess.State().Terminal() {
		p.mu.Lock()
		p.removeTaskLocked(t)
		p.mu.Unlock()
		t.stop()
		if t.aborts.Load() != 0 {
			p.cancelled.Add(1)
		} else {
			p.refused.Add(1)
		}
		p.replyNow(r, t.replyFor(t.sess.Code()))
		endSpanCode(t.span, t.sess.Code(), t.cause)
		if lease != nil {
			lease.Release()
		}
		return
	}
	p.mu.Lock()
	if st := p.state; st != 1 { // shut down while admitting
		p.removeTaskLocked(t)
		p.mu.Unlock()
		t.stop()
		lease.Release()
		p.refuseNotServing(r, t, st)
		return
	}
	p.inflight.Add(1)
	p.dispatchLocked(taskStart{t, acts})
	p.mu.Unlock()
}

// taskStart is a task to run and its first actions.
type taskStart struct {
	t    *task
	acts []session.Action
}

// workerIdle is how long a worker waits for a task before it exits (up to
// twice as long: the idle check runs every workerIdle, not per task).
const workerIdle = 10 * time.Second

// dispatchLocked runs s off the dispatch goroutine: on an idle worker when
// one waits, else on a new one. A steady stream of requests reuses workers,
// whose stacks are already grown; a burst gets a goroutine per task, and the
// extra workers exit once idle. p.mu is held and the prefiller is serving
// (p.quit is open).
func (p *Prefiller) dispatchLocked(s taskStart) {
	select {
	case p.work <- s:
	default:
		p.wg.Go(func() { p.worker(s) })
	}
}

// worker runs s, then the tasks dispatched to it, until a workerIdle period
// passed without one or intake stopped.
func (p *Prefiller) worker(s taskStart) {
	idle := time.NewTimer(workerIdle)
	defer idle.Stop()
	busy := false // ran a task since idle was last set
	for {
		if s.t != nil {
			s.t.run(s.acts)
			s, busy = taskStart{}, true
		}
		select {
		case s = <-p.work:
		case <-idle.C:
			if !busy {
				return
			}
			busy = false
			idle.Reset(workerIdle)
		case <-p.quit:
			return
		}
	}
}

// refuseNotServing refuses a request that reached the endpoints while the
// prefiller was starting (state 3) or shutting down: a capacity refusal,
// which the decoder retries on another worker, since nothing was written.
func (p *Prefiller) refuseNotServing(r micro.Request, t *task, state int) {
	why := "shutting down"
	if state == 3 {
		why = "starting"
	}
	t.cause = fmt.Errorf("%w: prefiller %s", ErrCapacityRefused, why)
	p.refused.Add(1)
	p.replyNow(r, t.replyFor(session.CodeCapacityRefused))
	endSpanCode(t.span, session.CodeCapacityRefused, t.cause)
}

func (p *Prefiller) replyNow(r micro.Request, rep wire.PrefillReply) {
	rep.Instance = p.cfg.Instance
	buf := getMsgBuf()
	b, err := wire.AppendPrefillReply(*buf, &rep, p.maxPayload)
	if err != nil {
		putMsgBuf(buf, *buf)
		p.cfg.Logger.Error("encode reply", "err", err)
		return
	}
	p.published.Add(1)
	if rep.Code == session.CodeOK {
		err = r.Respond(b)
	} else {
		err = r.Error(strconv.Itoa(int(rep.Code)), rep.Code.String(), b)
	}
	putMsgBuf(buf, b) // NATS copied it
	if err != nil {
		p.cfg.Logger.Warn("reply", "seq", rep.RequestID, "err", err)
	}
}

func (t *task) replyFor(code session.Code) wire.PrefillReply {
	rep := wire.PrefillReply{RequestID: t.msg.RequestID, Code: code}
	if code == session.CodeOK {
		rep.FirstToken, rep.Logprobs, rep.Cached = t.out.FirstToken, t.out.Logprobs, uint32(max(t.out.Cached, 0))
		rep.PrefillNanos, rep.WriteNanos = int64(t.pf), int64(t.wr)
		rep.Manifest = t.manifest
		rep.Drafts = t.out.Drafts[:min(len(t.out.Drafts), int(t.msg.Drafts))]
	} else if t.cause != nil {
		rep.Msg = t.cause.Error()
		rep.TooLong = code == session.CodeCapacityRefused && errors.Is(t.cause, ErrTooLong)
	} else {
		rep.Msg = codeErr(code).Error()
	}
	return rep
}

// run drives an admitted request to its reply.
func (t *task) run(acts []session.Action) {
	p := t.p
	defer func() {
		t.stopStream()
		t.stop()
		p.mu.Lock()
		p.removeTaskLocked(t)
		p.mu.Unlock()
		p.inflight.Add(-1)
		if t.span != nil { // not replied
			t.span.End()
		}
		p.freeTask(t)
	}()
	// The queue of actions to execute; a Step's actions are copied in at once
	// (the session reuses its slice).
	var queue [8]session.Action
	acts = append(queue[:0], acts...)
	var now time.Time // the end of the last step: the clock of its outcome
	for len(acts) > 0 {
		a := acts[0]
		acts = acts[1:]
		var outcome *session.Event
		switch a.Kind {
		case session.ActPrefill:
			start := t.now()
			t.startStream()
			out, err := t.lease.Prefill(t.ctx)
			now = t.now()
			t.pf = now.Sub(start)
			ev := session.Event{Kind: session.EvPrefilled}
			if err != nil {
				t.cause = err
				ev.Code = codeOf(err)
				if ev.Code == session.CodePeerFailed {
					ev.Code = session.CodePrefillFailed
				}
			} else {
				t.out = out
				ev.KVBytes, ev.MambaBytes = out.Source.bytes()
			}
			outcome = &ev
		case session.ActWrite:
			start := t.now()
			src := append(append(append(t.src[:0], t.out.Source.KV...), t.out.Source.Mamba), t.out.Source.MambaMore...)
			ws := t.startWriteSpan(start)
			var m rdma.Manifest
			var err error
			if t.lw != nil {
				// What prefill finished has left already; the rest now.
				m, t.early, err = t.lw.finish(t.ctx, src)
			} else {
				m, err = p.eng.Write(t.ctx, t.peer, t.ticket, src)
			}
			now = t.now()
			t.endWriteSpan(ws, now, err)
			t.wr = now.Sub(start)
			ev := session.Event{Kind: session.EvWritten, Manifest: session.Manifest(m)}
			if err != nil {
				t.cause = err
				ev.Code = rdmaCode(err)
			} else {
				t.manifest = m
			}
			outcome = &ev
		case session.ActAbort:
			t.stop()
		case session.ActRelease:
			t.stopStream() // no byte of the lease is read after its release
			t.lease.Release()
		case session.ActReply:
			t.sendReply(a.Code)
		}
		if outcome != nil {
			// Interruptions that happened during the step come first, so the
			// session sees the cancel or the deadline, not just a failed step.
			if c := session.Code(t.aborts.Load()); c != session.CodeOK {
				acts = append(acts, t.sess.Step(session.Event{Kind: session.EvCancel, Code: c, Now: now})...)
			}
			acts = append(acts, t.sess.Step(session.Event{Kind: session.EvTick, Now: now})...)
			outcome.Now = now
			acts = append(acts, t.sess.Step(*outcome)...)
		}
	}
}

func (t *task) sendReply(code session.Code) {
	p := t.p
	switch code {
	case session.CodeOK:
		kv, mamba := t.out.Source.bytes()
		p.kvBytes.Add(kv)
		p.mambaBytes.Add(mamba)
		p.streamed.Add(t.early)
		p.served.Add(1)
	case session.CodeCancelled, session.CodeClosed:
		p.cancelled.Add(1)
	case session.CodeCapacityRefused:
		// Refused after admission: the executor's prefill found it could
		// not serve it after all (a state from the cache evicted since).
		p.refused.Add(1)
	default:
		p.failed.Add(1)
	}
	rep := t.replyFor(code)
	rep.Instance = p.cfg.Instance
	if t.span != nil {
		defer func(span trace.Span) { endSpanCode(span, code, t.cause) }(t.span)
		t.span = nil
	}
	buf := getMsgBuf()
	b, err := wire.AppendPrefillReply(*buf, &rep, p.maxPayload)
	if err != nil {
		putMsgBuf(buf, *buf)
		p.cfg.Logger.Error("encode reply", "seq", rep.RequestID, "from", t.msg.From, "err", err)
		return
	}
	p.published.Add(1)
	err = p.nc.Publish(t.reply, b)
	putMsgBuf(buf, b) // NATS copied it
	if err != nil {
		p.cfg.Logger.Warn("reply", "seq", rep.RequestID, "from", t.msg.From, "err", err)
	}
}
