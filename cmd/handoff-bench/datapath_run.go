package main

// One measured run of the datapath command: a writer streaming into a receiver.

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/handoff-io/handoff/internal/crc32c"
	"github.com/handoff-io/handoff/rdma"
)

// runOnce measures one transport at one layout.
func runOnce(ctx context.Context, t rdma.Transport, l layout, dur time.Duration, logger *slog.Logger, sp spawner, progress io.Writer) (res datapathResult, err error) {
	// The receiver lives on the caller's ctx: ending this run closes its
	// control channel, which lets it exit on its own instead of being killed.
	rx, err := sp.spawn(ctx, t, l, logger)
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if err != nil {
		return res, err
	}
	var dispatch sync.WaitGroup
	// hangUp closes the control channel, which ends a healthy receiver; one
	// that has not hung up receiverGrace later (stuck, or stopped) is
	// aborted, so that reading its last words below cannot wait forever.
	var backstop *time.Timer
	hangUp := func() {
		_ = rx.in.Close()
		if backstop == nil && rx.abort != nil {
			backstop = time.AfterFunc(receiverGrace, rx.abort)
		}
	}
	defer func() {
		hangUp()
		cancel(errors.New("run over"))
		dispatch.Wait()
		// Read what the receiver still says (an error report) until it
		// hangs up, so that it never blocks writing to us.
		_, _ = io.Copy(io.Discard, rx.out)
		werr := rx.wait()
		if backstop != nil {
			backstop.Stop()
		}
		if werr != nil && err == nil {
			err = fmt.Errorf("receiver: %w", werr)
		}
	}()
	cr := newCtrlReader(rx.out)
	cw := newCtrlWriter(rx.in)
	hello, err := cr.next()
	if err != nil {
		return res, fmt.Errorf("receiver hello: %w", err)
	}
	if hello.Type != "hello" {
		return res, fmt.Errorf("receiver: expected hello, got %q %s", hello.Type, hello.Error)
	}
	peer := *hello.Descriptor
	if len(peer.Regions) != 1 || peer.Regions[0].Length != l.regionBytes() {
		return res, fmt.Errorf("receiver: descriptor has regions %+v, want one of %d bytes", peer.Regions, l.regionBytes())
	}

	tlsCfg, err := loadBenchTLS(l.TLSDir)
	if err != nil {
		return datapathResult{}, err
	}
	eng, err := rdma.New(rdma.Config{Agent: agentID("writer"), Transports: []rdma.Transport{t}, Logger: logger, TCPLanes: l.TCPLanes, SkipCRC: l.SkipCRC, TLS: tlsCfg})
	if err != nil {
		return res, err
	}
	defer eng.Close()
	src, err := eng.Register("bench-src", int64(l.sourceBytes()))
	if err != nil {
		return res, err
	}
	_, _ = rand.Read(src.Bytes())
	chosen, err := eng.Connect(ctx, peer)
	if err != nil {
		return res, err
	}
	if chosen != t {
		return res, fmt.Errorf("asked for transport %s, the engine chose %s", t, chosen)
	}

	// The dispatcher routes tickets to their stream and ends the run on a
	// receiver error or a closed channel.
	tickets := make([]chan ctrlMsg, l.Streams)
	for i := range tickets {
		tickets[i] = make(chan ctrlMsg, l.Depth) // at most Depth opens outstanding per stream
	}
	statsCh := make(chan receiverStats, 1)
	dispatch.Add(1)
	go func() {
		defer dispatch.Done()
		for {
			m, err := cr.next()
			if err != nil {
				cancel(fmt.Errorf("receiver control channel: %w", err))
				return
			}
			switch m.Type {
			case "ticket":
				if m.Stream < 0 || m.Stream >= l.Streams {
					cancel(fmt.Errorf("receiver: ticket for stream %d", m.Stream))
					return
				}
				select {
				case tickets[m.Stream] <- m:
				default:
					cancel(fmt.Errorf("receiver: unrequested ticket for stream %d", m.Stream))
					return
				}
			case "stats":
				statsCh <- *m.Stats
				return
			case "error":
				cancel(fmt.Errorf("receiver: %s", m.Error))
				return
			default:
				cancel(fmt.Errorf("receiver: unexpected %q", m.Type))
				return
			}
		}
	}()

	var (
		reqID   atomic.Uint64
		total   atomic.Uint64
		grants  atomic.Uint64
		streams sync.WaitGroup
		lats    = make([][]time.Duration, l.Streams)
		errs    = make([]error, l.Streams)
	)
	open := func(stream, slot int) error {
		return cw.send(ctrlMsg{Type: "open", Stream: stream, Slot: slot, RequestID: reqID.Add(1)})
	}
	start := time.Now()
	stopProgress := startProgress(progress, fmt.Sprintf("%s %s", t, formatSize(l.Extent)), start, &total)
	for s := range l.Streams {
		streams.Add(1)
		go func() {
			defer streams.Done()
			lats[s], errs[s] = writeStream(ctx, eng, peer, l, s, src.ID(), start.Add(dur), tickets[s], open, &total, &grants)
		}()
	}
	streams.Wait()
	elapsed := time.Since(start)
	stopProgress()
	if err := errors.Join(errs...); err != nil {
		// A failed write or send often has its reason on the receiver's
		// side: hang up, let the dispatcher read the receiver's last words,
		// and report those first.
		hangUp()
		dispatch.Wait()
		// A receiver that merely hung up (or was stopped) said nothing.
		if c := context.Cause(ctx); c != nil && !errors.Is(err, c) && !errors.Is(c, io.EOF) {
			err = fmt.Errorf("%w (%w)", c, err)
		}
		return res, err
	}
	if err := cw.send(ctrlMsg{Type: "stop"}); err != nil {
		return res, err
	}
	var st receiverStats
	statsWait := time.NewTimer(l.ttl())
	defer statsWait.Stop()
	select {
	case st = <-statsCh:
	case <-ctx.Done():
		return res, context.Cause(ctx)
	case <-statsWait.C:
		return res, fmt.Errorf("receiver sent no stats within %s of stop", l.ttl())
	}
	if st.Bytes != total.Load() || st.Committed != grants.Load() {
		return res, fmt.Errorf("receiver committed %d grants / %d bytes, writer wrote %d / %d", st.Committed, st.Bytes, grants.Load(), total.Load())
	}
	if grants.Load() == 0 {
		return res, fmt.Errorf("no grant was written within --duration %s: nothing was measured", dur)
	}
	all := slices.Concat(lats...)
	slices.Sort(all)
	res = datapathResult{
		Transport: t, ExtentBytes: l.Extent, Bytes: total.Load(), Seconds: elapsed.Seconds(),
		GBPerS: float64(total.Load()) / elapsed.Seconds() / 1e9, Streams: l.Streams, Depth: l.Depth,
		GrantBytes: l.grantBytes(), ExtentsPerGrant: l.PerGrant, Grants: grants.Load(),
		GrantP50Ms: quantileMs(all, 0.50), GrantP99Ms: quantileMs(all, 0.99), Processes: rx.processes,
		CRC: !l.SkipCRC,
	}
	if res.CRC {
		res.CRCKernel = crc32c.Kernel()
	}
	if t == rdma.TransportTCP {
		res.TCPLanes = max(l.TCPLanes, 1)
		res.TLS = l.TLSDir != ""
	}
	return res, nil
}

// writeStream is one writer: it keeps Depth grants requested and writes each
// ticket as it arrives, until the deadline. It returns the per-grant write
// latencies.
func writeStream(ctx context.Context, eng *rdma.Engine, peer rdma.Descriptor, l layout, s int, srcRegion rdma.RegionID,
	until time.Time, tickets <-chan ctrlMsg, open func(stream, slot int) error, total, grants *atomic.Uint64) ([]time.Duration, error) {
	src := l.extents(srcRegion, s)
	dst := make([][]rdma.Extent, l.Depth)
	for k := range dst {
		i, _ := l.slotIndex(s, k)
		dst[k] = l.extents(peer.Regions[0].ID, i)
	}
	lats := make([]time.Duration, 0, 4096)
	for k := range l.Depth {
		if err := open(s, k); err != nil {
			return nil, err
		}
	}
	ticketWait := time.NewTimer(l.ttl())
	defer ticketWait.Stop()
	for time.Now().Before(until) {
		var m ctrlMsg
		ticketWait.Reset(l.ttl())
		select {
		case m = <-tickets:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		case <-ticketWait.C:
			return nil, fmt.Errorf("stream %d: the receiver sent no ticket within %s", s, l.ttl())
		}
		if m.Slot < 0 || m.Slot >= l.Depth {
			return nil, fmt.Errorf("receiver: ticket for slot %d", m.Slot)
		}
		wt := m.Ticket
		t := rdma.Ticket{Agent: peer.Agent, Grant: wt.Grant, Epoch: wt.Epoch, Token: wt.Token, RequestID: wt.RequestID,
			Extents: dst[m.Slot], Bytes: wt.Bytes, Deadline: wt.Deadline}
		t0 := time.Now()
		// The grant ends at its deadline: a write the receiver has not
		// answered by then never will be.
		wctx, cancel := context.WithDeadline(ctx, wt.Deadline)
		_, err := eng.Write(wctx, peer, t, src)
		cancel()
		if err != nil {
			if ctx.Err() == nil && wctx.Err() != nil {
				return nil, fmt.Errorf("stream %d grant %d: not committed by the grant's deadline, %s after it was opened (is the receiver stuck?): %w",
					s, wt.Grant, l.ttl(), err)
			}
			return nil, fmt.Errorf("stream %d grant %d: %w", s, wt.Grant, err)
		}
		lats = append(lats, time.Since(t0))
		total.Add(wt.Bytes)
		grants.Add(1)
		if err := open(s, m.Slot); err != nil {
			return nil, err
		}
	}
	return lats, nil
}

func quantileMs(sorted []time.Duration, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := min(len(sorted)-1, int(q*float64(len(sorted))))
	return float64(sorted[i]) / 1e6
}

// startProgress prints a live rate to w every half second until the returned
// stop is called; with a nil w it does nothing.
func startProgress(w io.Writer, label string, start time.Time, bytes *atomic.Uint64) (stop func()) {
	if w == nil {
		return func() {}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(500 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				fmt.Fprint(w, "\r\033[K")
				return
			case <-tick.C:
				sec := time.Since(start).Seconds()
				fmt.Fprintf(w, "\r\033[K%s: %.1fs %.2f GB/s", label, sec, float64(bytes.Load())/sec/1e9)
			}
		}
	})
	return func() { close(done); wg.Wait() }
}
