package transfer

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/rdma"
)

// streamExec is a testExec whose jobs stream: Prefill fills the cache in
// pieces of `piece` bytes, in a shuffled order, and reports each piece to
// the sink once it is written. Halfway it tells paused and waits on resume
// (when set); with fail set it fails there.
type streamExec struct {
	*testExec
	piece   int
	paused  chan uint64
	resume  chan struct{}
	fail    atomic.Bool
	streams atomic.Int64 // jobs whose Stream was called
	// extra, when set, returns pieces to report right after p (and in
	// the same call to the sink when together is set).
	extra    func(p Piece) []Piece
	together bool
	// released, when set, is called by Release, on the task's goroutine,
	// before the lease's resources are freed.
	released func(l *streamJob)
}

func newStreamExec(s *side, piece int) *streamExec {
	return &streamExec{testExec: newExec(s), piece: piece}
}

func (x *streamExec) Admit(job Job) (AdmittedJob, error) {
	a, err := x.testExec.Admit(job)
	if err != nil {
		return nil, err
	}
	return &streamJob{testLease: a.(*testLease), x: x}, nil
}

type streamJob struct {
	*testLease
	x    *streamExec
	sink atomic.Pointer[func([]Piece)]
}

var _ LayerwiseJob = (*streamJob)(nil)

func (l *streamJob) Release() {
	if l.x.released != nil {
		l.x.released(l)
	}
	l.testLease.Release()
}

func (l *streamJob) Stream(sink func([]Piece)) {
	l.x.streams.Add(1)
	l.sink.Store(&sink)
}

func (l *streamJob) Prefill(ctx context.Context) (Prefilled, error) {
	id := l.job.RequestID
	var ps []Piece
	var at uint64
	for _, e := range l.d.extents() {
		for off := uint64(0); off < e.Length; off += uint64(l.x.piece) {
			n := min(uint64(l.x.piece), e.Length-off)
			ps = append(ps, Piece{At: at + off, Src: rdma.Extent{Region: e.Region, Offset: e.Offset + off, Length: n}})
		}
		at += e.Length
	}
	rand.New(rand.NewPCG(id, 1)).Shuffle(len(ps), func(i, j int) { ps[i], ps[j] = ps[j], ps[i] })
	for k, p := range ps {
		if k == len(ps)/2 {
			if l.x.paused != nil {
				l.x.paused <- id
				select {
				case <-l.x.resume:
				case <-ctx.Done():
					return Prefilled{}, ctx.Err()
				}
			}
			if l.x.fail.Load() {
				return Prefilled{}, errors.New("test prefill failed halfway")
			}
		}
		b := l.x.s.bytes(p.Src)
		for j := range b {
			b[j] = pattern(id, int(p.At)+j)
		}
		if sink := l.sink.Load(); sink != nil {
			var more []Piece
			if l.x.extra != nil {
				more = l.x.extra(p)
			}
			if l.x.together {
				(*sink)(append([]Piece{p}, more...))
			} else {
				(*sink)([]Piece{p})
				for _, m := range more {
					(*sink)([]Piece{m})
				}
			}
		}
	}
	return Prefilled{FirstToken: int32(id % 1000), Source: l.d}, nil
}

// streamPrefiller is fixture.prefiller over a streamExec.
func (f *fixture) streamPrefiller(name string, x *streamExec, mod func(*PrefillerConfig)) *Prefiller {
	f.t.Helper()
	cfg := PrefillerConfig{Instance: name, Namespace: f.ns, Fingerprint: f.fp, MaxDraftTokens: 2, NoRegistry: true,
		Registry: RegistryConfig{TTL: 30 * time.Second}}
	mod(&cfg)
	p, err := NewPrefiller(cfg, natstest.Connect(f.t, f.srv), x.s.eng, x)
	require.NoError(f.t, err)
	require.NoError(f.t, p.Start(context.Background()))
	f.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(f.t, p.Shutdown(ctx))
	})
	return p
}

func streamTransports() []rdma.Transport {
	ts := []rdma.Transport{rdma.TransportInproc, rdma.TransportTCP}
	if runtime.GOOS == "linux" {
		ts = append(ts, rdma.TransportSHM)
	}
	return ts
}

// TestLayerwiseHandoff: with layer-wise on, what the job reports while it
// computes is written before Prefill returns, the rest after, and decode
// gets every byte, on every transport. Off (or a prompt under auto's
// threshold) streams nothing, with the same outcome.
func TestLayerwiseHandoff(t *testing.T) {
	for _, tr := range streamTransports() {
		for _, mode := range []Layerwise{LayerwiseOn, LayerwiseAuto, LayerwiseOff} {
			t.Run(fmt.Sprintf("%s/%s", tr, mode), func(t *testing.T) {
				f := newFixture(t)
				ds, ps := newSideOn(t, "dec", testHybrid(64, 8), tr), newSideOn(t, "pre", testHybrid(64, 8), tr)
				x := newStreamExec(ps, 37)
				x.paused, x.resume = make(chan uint64, 1), make(chan struct{})
				d := f.decoder("d1", ds, nil)
				p := f.streamPrefiller("p1", x, func(c *PrefillerConfig) { c.Layerwise, c.LayerwiseMinTokens = mode, 12 })
				for id := uint64(1); id <= 4; id++ {
					n := int(id*5 + 1) // 6, 11, 16, 21 tokens: auto streams the last two
					streams := mode == LayerwiseOn || mode == LayerwiseAuto && n >= 12
					before, streamedBefore := ps.eng.Stats().BytesWritten, p.Stats().StreamedBytes
					type out struct {
						res Result
						err error
					}
					done := make(chan out, 1)
					go func() {
						res, err := ds.handoff(context.Background(), d, Request{ID: id, Tokens: tokens(n), Deadline: time.Now().Add(10 * time.Second)})
						done <- out{res, err}
					}()
					require.Equal(t, id, <-x.paused)
					if streams {
						// Half the pieces were reported: they leave while
						// the job still "computes".
						natstest.CheckFor(t, 5*time.Second, time.Millisecond, func() error {
							if ps.eng.Stats().BytesWritten == before {
								return errors.New("nothing written while prefill computes")
							}
							return nil
						})
					} else {
						require.Equal(t, before, ps.eng.Stats().BytesWritten)
					}
					x.resume <- struct{}{}
					o := <-done
					require.NoError(t, o.err)
					i := 0
					for _, e := range ds.dest(id).extents() {
						for _, b := range ds.bytes(e) {
							require.Equal(t, pattern(id, i), b, "request %d byte %d", id, i)
							i++
						}
					}
					kv, m := ds.dest(id).bytes()
					require.Equal(t, before+kv+m, ps.eng.Stats().BytesWritten, "every byte written once")
					if streamed := p.Stats().StreamedBytes - streamedBefore; streams {
						require.Positive(t, streamed, "request %d: streamed bytes not counted", id)
						require.LessOrEqual(t, streamed, kv+m)
					} else {
						require.Zero(t, streamed, "request %d went in one write", id)
					}
					require.NoError(t, ds.m.Free(id))
				}
				want := map[Layerwise]int64{LayerwiseOn: 4, LayerwiseAuto: 2, LayerwiseOff: 0}[mode]
				require.Equal(t, want, x.streams.Load())
				ds.requireInitial(t)
				ps.requireInitial(t)
				require.Equal(t, uint64(4), p.Stats().Served)
			})
		}
	}
}

// TestLayerwiseFaults: a prefill that fails halfway through its stream, a
// decoder that cancels mid-stream: the handoff fails, the grant is
// revoked, and both sides' pools come back, on every transport.
func TestLayerwiseFaults(t *testing.T) {
	for _, tr := range streamTransports() {
		t.Run(string(tr), func(t *testing.T) {
			f := newFixture(t)
			ds, ps := newSideOn(t, "dec", testHybrid(64, 8), tr), newSideOn(t, "pre", testHybrid(64, 8), tr)
			x := newStreamExec(ps, 29)
			d := f.decoder("d1", ds, nil)
			p := f.streamPrefiller("p1", x, func(c *PrefillerConfig) { c.Layerwise = LayerwiseOn })

			x.paused, x.resume = make(chan uint64, 1), make(chan struct{})
			x.fail.Store(true)
			errc := make(chan error, 1)
			go func() {
				_, err := ds.handoff(context.Background(), d, Request{ID: 1, Tokens: tokens(30), Deadline: time.Now().Add(10 * time.Second)})
				errc <- err
			}()
			require.Equal(t, uint64(1), <-x.paused)
			natstest.CheckFor(t, 5*time.Second, time.Millisecond, func() error {
				if ps.eng.Stats().BytesWritten == 0 {
					return errors.New("nothing streamed yet")
				}
				return nil
			})
			x.resume <- struct{}{}
			require.ErrorIs(t, <-errc, ErrPrefillFailed)
			ds.requireInitial(t)
			ps.requireInitial(t)

			x.fail.Store(false)
			ctx, cancel := context.WithCancel(context.Background())
			go func() {
				_, err := ds.handoff(ctx, d, Request{ID: 2, Tokens: tokens(30), Deadline: time.Now().Add(10 * time.Second)})
				errc <- err
			}()
			require.Equal(t, uint64(2), <-x.paused)
			cancel()
			require.ErrorIs(t, <-errc, context.Canceled)
			ds.requireInitial(t)
			ps.requireInitial(t)
			require.Equal(t, int64(2), x.releases.Load())
			require.Equal(t, uint64(0), p.Stats().Served)
			require.Zero(t, ds.eng.Stats().GrantsOpen)
		})
	}
}

// TestLayerwiseRefusedPieceGoesOn: a piece rdma.Stream.Write refuses
// before sending anything (one reported twice, so its range was written
// already; one whose source is no local region) leaves the stream going,
// as Write documents: the handoff completes, every byte written once, and
// the other pieces of a batch that held a refused one still leave while
// prefill computes. A piece outside the cache is dropped the same way.
func TestLayerwiseRefusedPieceGoesOn(t *testing.T) {
	for _, together := range []bool{false, true} {
		t.Run(fmt.Sprintf("together=%t", together), func(t *testing.T) {
			f := newFixture(t)
			ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
			x := newStreamExec(ps, 37)
			var n atomic.Int64
			x.together = together
			x.extra = func(p Piece) []Piece {
				switch n.Add(1) {
				case 2:
					return []Piece{p} // reported twice: written already
				case 4:
					return []Piece{{At: p.At, Src: rdma.Extent{Region: 99, Length: p.Src.Length}}} // no such region
				case 6:
					return []Piece{{At: 1 << 40, Src: p.Src}} // outside the cache
				}
				return nil
			}
			d := f.decoder("d1", ds, nil)
			p := f.streamPrefiller("p1", x, func(c *PrefillerConfig) { c.Layerwise = LayerwiseOn })
			before := ps.eng.Stats().BytesWritten
			_, err := ds.handoff(context.Background(), d, Request{ID: 1, Tokens: tokens(30), Deadline: time.Now().Add(10 * time.Second)})
			require.NoError(t, err)
			ds.requirePattern(t, 1)
			kv, m := ds.dest(1).bytes()
			require.Equal(t, before+kv+m, ps.eng.Stats().BytesWritten, "every byte written once")
			require.Positive(t, p.Stats().StreamedBytes, "nothing streamed after the refused piece")
			require.NoError(t, ds.m.Free(1))
			ds.requireInitial(t)
			ps.requireInitial(t)
		})
	}
}

// TestLayerwiseReleaseAfterStreamStopped: a job that ends mid-stream
// (prefill fails, or its decoder cancels, while writes of its pieces are in
// flight on a slow link) is released only once the stream's goroutine
// ended: no piece is read from the lease's blocks after the executor may
// hand them on (AdmittedJob.Release; worker.PendingPrefill frees them only
// then).
func TestLayerwiseReleaseAfterStreamStopped(t *testing.T) {
	for _, how := range []string{"failed", "cancelled"} {
		t.Run(how, func(t *testing.T) {
			f := newFixture(t)
			ds, proxy := newSideVia(t, "dec", testHybrid(64, 8))
			ps := newSideOn(t, "pre", testHybrid(64, 8), rdma.TransportTCP)
			proxy.SetLatency(20 * time.Millisecond)
			x := newStreamExec(ps, 16)
			if how == "failed" {
				x.fail.Store(true)
			} else {
				x.paused, x.resume = make(chan uint64, 1), make(chan struct{})
			}
			p := f.streamPrefiller("p1", x, func(c *PrefillerConfig) { c.Layerwise = LayerwiseOn })
			var streamed, stopped, released atomic.Int64
			x.released = func(l *streamJob) {
				released.Add(1)
				// The task whose lease this is: another attempt of the
				// request may be in the table too (a retry sent while the
				// machine was slow), with a stream of its own.
				p.mu.Lock()
				tk := p.tasks[l.job.RequestID]
				for tk != nil && tk.lease != AdmittedJob(l) {
					tk = tk.next
				}
				p.mu.Unlock()
				if tk == nil || tk.lw == nil { // tk.lw is the task goroutine's, which runs Release
					return
				}
				streamed.Add(1)
				select {
				case <-tk.lw.done:
					stopped.Add(1)
				default:
				}
			}
			d := f.decoder("d1", ds, nil)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			errc := make(chan error, 1)
			go func() {
				_, err := ds.handoff(ctx, d, Request{ID: 1, Tokens: tokens(30), Deadline: time.Now().Add(10 * time.Second)})
				errc <- err
			}()
			if how == "failed" {
				require.ErrorIs(t, <-errc, ErrPrefillFailed)
			} else {
				require.Equal(t, uint64(1), <-x.paused)
				cancel()
				require.ErrorIs(t, <-errc, context.Canceled)
			}
			natstest.CheckFor(t, 5*time.Second, time.Millisecond, func() error {
				if released.Load() == 0 {
					return errors.New("not released yet")
				}
				return nil
			})
			require.Equal(t, int64(1), streamed.Load(), "the job did not stream")
			require.Equal(t, int64(1), stopped.Load(), "released while the stream still ran")
			drain(t, proxy, ps)
			ds.requireInitial(t)
			ps.requireInitial(t)
		})
	}
}

// TestLayerwiseParse reads the flag's values.
func TestLayerwiseParse(t *testing.T) {
	for in, want := range map[string]Layerwise{"on": LayerwiseOn, "OFF": LayerwiseOff, "auto": LayerwiseAuto, "": LayerwiseAuto, " true ": LayerwiseOn} {
		got, err := ParseLayerwise(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
		if in == "on" || in == "auto" {
			require.Equal(t, in, got.String())
		}
	}
	_, err := ParseLayerwise("sometimes")
	require.ErrorIs(t, err, ErrInvalidConfig)
	_, err = NewPrefiller(PrefillerConfig{Instance: "p", Namespace: "n", Fingerprint: "f", LayerwiseMinTokens: -1}, nil, nil, nil)
	require.ErrorIs(t, err, ErrInvalidConfig)
}

// TestStreamerRanges maps pieces of the whole write onto the ticket's
// extents, cutting one that spans two, merges ranges (and sources) that
// continue the last one, and refuses a piece outside the cache.
func TestStreamerRanges(t *testing.T) {
	st := &streamer{ends: []uint64{10, 15, 40}, total: 40}
	dst, src, err := st.ranges([]Piece{
		{At: 8, Src: rdma.Extent{Region: 1, Offset: 100, Length: 10}},
		{At: 0, Src: rdma.Extent{Region: 2, Offset: 0, Length: 3}},
		{At: 3, Src: rdma.Extent{Region: 3, Offset: 50, Length: 2}}, // continues the range, not the source
	}, nil, nil)
	require.NoError(t, err)
	require.Equal(t, []rdma.Range{{Ext: 0, Offset: 8, Length: 2}, {Ext: 1, Offset: 0, Length: 5}, {Ext: 2, Offset: 0, Length: 3}, {Ext: 0, Offset: 0, Length: 5}}, dst)
	require.Equal(t, []rdma.Extent{{Region: 1, Offset: 100, Length: 10}, {Region: 2, Offset: 0, Length: 3}, {Region: 3, Offset: 50, Length: 2}}, src)
	for _, bad := range []Piece{{At: 38, Src: rdma.Extent{Length: 3}}, {At: 40, Src: rdma.Extent{Length: 1}}, {At: 0}} {
		_, _, err := st.ranges([]Piece{bad}, nil, nil)
		require.ErrorIs(t, err, rdma.ErrOutOfRange)
	}
}
