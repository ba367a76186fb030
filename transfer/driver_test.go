package transfer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/internal/leakcheck"
	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/rdma"
)

func testHybrid(blocks, mbs int) hybrid.Config {
	return hybrid.Config{
		KV: kvcache.Config{Layers: 2, KVHeads: 2, HeadDim: 4, ElemSize: 2, TokensPerBlock: 4, Blocks: blocks},
		Mamba: mambacache.Config{Layers: 2, DState: 4, DConv: 4, Heads: 2, HeadDim: 3, NGroups: 1,
			ConvElemSize: 2, SSMElemSize: 4, MaxBatchSize: mbs, AttentionDP: true, MaxDraftTokens: 2},
	}
}

// side is one worker's data plane and pools.
type side struct {
	eng     *rdma.Engine
	m       *hybrid.Manager
	rank    *RankRegions
	regions map[rdma.RegionID]*rdma.Region
	initial hybrid.Stats

	mu    sync.Mutex
	dests map[uint64]CacheExtents // by request id, see handoff
}

func newSide(t *testing.T, agent string, cfg hybrid.Config) *side {
	t.Helper()
	return newSideOn(t, agent, cfg, rdma.TransportInproc)
}

// newSideOn is newSide with its engine serving transport tr.
func newSideOn(t *testing.T, agent string, cfg hybrid.Config, tr rdma.Transport) *side {
	t.Helper()
	eng, err := rdma.New(rdma.Config{Agent: rdma.AgentID(agent), Transports: []rdma.Transport{tr},
		Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = eng.Close() })
	m, err := hybrid.New(cfg)
	require.NoError(t, err)
	kv, err := eng.Register("kv", cfg.KV.ArenaBytes())
	require.NoError(t, err)
	mr, err := eng.Register("mamba", cfg.Mamba.ArenaBytes())
	require.NoError(t, err)
	rank, err := NewRankRegions(m, kv, mr)
	require.NoError(t, err)
	return &side{eng: eng, m: m, rank: rank, regions: map[rdma.RegionID]*rdma.Region{kv.ID(): kv, mr.ID(): mr}, initial: m.Stats()}
}

// prepare allocates request id's KV blocks and Mamba row for tokens prompt
// tokens and resolves them to extents: what a worker's scheduler does before a
// handoff (decode) or a prefill (prefill).
func (s *side) prepare(id uint64, tokens int) (CacheExtents, error) {
	res, err := s.m.Prepare(id, tokens)
	if err != nil {
		return CacheExtents{}, err
	}
	d, err := s.rank.Resolve(res)
	if err != nil {
		_ = s.m.Free(id)
		return CacheExtents{}, err
	}
	return d, nil
}

// handoff runs req on d into a destination prepared on s, with the decode
// worker's duties around it: a failed handoff's destination is freed at once,
// or once its quarantine ends; a delivered one stays the caller's, who frees
// it (s.m.Free) when done with it. The destination is s.dests[req.ID].
func (s *side) handoff(ctx context.Context, d *Decoder, req Request) (Result, error) {
	dest, err := s.prepare(req.ID, len(req.Tokens))
	if err != nil {
		return Result{}, fmt.Errorf("%w: %w", ErrCapacityRefused, err)
	}
	s.mu.Lock()
	if s.dests == nil {
		s.dests = map[uint64]CacheExtents{}
	}
	s.dests[req.ID] = dest
	s.mu.Unlock()
	req.Dest = dest
	res, err := d.Handoff(ctx, req)
	if err == nil {
		return res, nil
	}
	if q, ok := errors.AsType[*QuarantinedError](err); ok {
		go func() {
			<-q.Released()
			_ = s.m.Free(req.ID)
		}()
		return res, err
	}
	if ferr := s.m.Free(req.ID); ferr != nil {
		panic(ferr)
	}
	return res, err
}

// dest is where request id's last handoff on s wrote.
func (s *side) dest(id uint64) CacheExtents {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dests[id]
}

func (s *side) bytes(x rdma.Extent) []byte {
	return s.regions[x.Region].Bytes()[x.Offset : x.Offset+x.Length]
}

func (s *side) requireInitial(t *testing.T) {
	t.Helper()
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if got := s.m.Stats(); got != s.initial {
			return fmt.Errorf("pools not back to initial: %+v, want %+v", got, s.initial)
		}
		return nil
	})
}

// pattern is the byte the test executor writes at offset i of request id's
// cache: the receiver checks every byte it got.
func pattern(id uint64, i int) byte { return byte(id*31 + uint64(i)*7 + uint64(i>>8)) }

// testExec is a PrefillExecutor over a side's pools, with fault switches.
type testExec struct {
	s        *side
	refuse   atomic.Bool
	block    chan struct{} // when set, Prefill waits for it (or ctx)
	started  chan uint64   // receives request ids as prefills start (buffered)
	ctxErr   chan error    // receives the ctx error of a blocked prefill
	admits   atomic.Int64
	releases atomic.Int64
	ready    atomic.Bool  // Admit returns ReadyLeases
	inline   atomic.Int64 // prefills that ran on the NATS dispatch goroutine
}

func newExec(s *side) *testExec {
	return &testExec{s: s, started: make(chan uint64, 64), ctxErr: make(chan error, 64)}
}

func (x *testExec) Admit(job Job) (AdmittedJob, error) {
	x.admits.Add(1)
	if x.refuse.Load() {
		return nil, fmt.Errorf("%w: test executor full", ErrCapacityRefused)
	}
	d, err := x.s.prepare(job.RequestID, len(job.Tokens))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCapacityRefused, err)
	}
	l := &testLease{x: x, job: job, d: d}
	if x.ready.Load() {
		return readyLease{l}, nil
	}
	return l, nil
}

// readyLease is a testLease that declares its prefill ready at admission.
type readyLease struct{ *testLease }

func (readyLease) Ready() bool { return true }

type testLease struct {
	x        *testExec
	job      Job
	d        CacheExtents
	released atomic.Bool
}

func (l *testLease) Prefill(ctx context.Context) (Prefilled, error) {
	l.x.started <- l.job.RequestID
	buf := make([]byte, 64<<10)
	if strings.Contains(string(buf[:runtime.Stack(buf, false)]), "transfer.(*Prefiller).handle(") {
		l.x.inline.Add(1)
	}
	if l.x.block != nil {
		select {
		case <-l.x.block:
		case <-ctx.Done():
			l.x.ctxErr <- ctx.Err()
			return Prefilled{}, ctx.Err()
		}
	}
	i := 0
	for _, e := range l.d.Extents() {
		b := l.x.s.bytes(e)
		for j := range b {
			b[j] = pattern(l.job.RequestID, i)
			i++
		}
	}
	return Prefilled{FirstToken: int32(l.job.RequestID % 1000), Source: l.d}, nil
}

func (l *testLease) Release() {
	if l.released.Swap(true) {
		panic("lease released twice")
	}
	l.x.releases.Add(1)
	if err := l.x.s.m.Free(l.job.RequestID); err != nil {
		panic(err)
	}
}

type fixture struct {
	t   *testing.T
	srv *server.Server
	ns  string
	fp  string
}

func newFixture(t *testing.T) *fixture {
	leakcheck.Check(t)
	return &fixture{t: t, srv: natstest.Run(t), ns: "t1", fp: "fp-tiny"}
}

func (f *fixture) decoder(name string, s *side, mod func(*DecoderConfig)) *Decoder {
	f.t.Helper()
	cfg := DecoderConfig{Instance: name, Namespace: f.ns, Fingerprint: f.fp, MaxDraftTokens: 2, NoRegistry: true,
		Registry: RegistryConfig{TTL: 30 * time.Second}}
	if mod != nil {
		mod(&cfg)
	}
	nc := natstest.Connect(f.t, f.srv)
	d, err := NewDecoder(context.Background(), cfg, nc, s.eng)
	require.NoError(f.t, err)
	f.t.Cleanup(func() { require.NoError(f.t, d.Close()) })
	return d
}

func (f *fixture) prefiller(name, fp string, x *testExec, mod func(*PrefillerConfig)) *Prefiller {
	f.t.Helper()
	cfg := PrefillerConfig{Instance: name, Namespace: f.ns, Fingerprint: fp, MaxDraftTokens: 2, NoRegistry: true,
		Registry: RegistryConfig{TTL: 30 * time.Second}}
	if mod != nil {
		mod(&cfg)
	}
	nc := natstest.Connect(f.t, f.srv)
	p, err := NewPrefiller(cfg, nc, x.s.eng, x)
	require.NoError(f.t, err)
	require.NoError(f.t, p.Start(context.Background()))
	f.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(f.t, p.Shutdown(ctx))
	})
	return p
}

func withRegistry(c *DecoderConfig)    { c.NoRegistry = false }
func withRegistryP(c *PrefillerConfig) { c.NoRegistry = false }
func tokens(n int) []int32             { return make([]int32, n) }
func inMsgs(t *testing.T, s *server.Server) int64 {
	v, err := s.Varz(nil)
	require.NoError(t, err)
	return v.InMsgs
}

// requireInMsgs checks that the server received want messages since before.
// The server adds a read's messages to its count after it delivered them, so
// the last reply may reach its receiver a moment before it is counted.
func requireInMsgs(t *testing.T, s *server.Server, before, want int64) {
	t.Helper()
	natstest.CheckFor(t, 5*time.Second, time.Millisecond, func() error {
		if n := inMsgs(t, s) - before; n < want {
			return fmt.Errorf("%d messages, want %d", n, want)
		}
		return nil
	})
	require.Equal(t, want, inMsgs(t, s)-before)
}

func TestHandoffHappy(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	d := f.decoder("d1", ds, nil)
	p := f.prefiller("p1", f.fp, x, nil)

	before := inMsgs(t, f.srv)
	for id := uint64(1); id <= 5; id++ {
		n := int(id*5 + 1)
		res, err := ds.handoff(context.Background(), d, Request{ID: id, Tokens: tokens(n), Deadline: time.Now().Add(5 * time.Second)})
		require.NoError(t, err)
		require.Equal(t, int32(id), res.FirstToken)
		require.Equal(t, "p1", res.Instance)
		require.Equal(t, 1, res.Attempts)
		kvb, mb := ds.dest(id).Bytes()
		require.Equal(t, kvb, res.KVBytes)
		require.Equal(t, mb, res.MambaBytes)
		require.Equal(t, uint64(kvcache.Config(testHybrid(1, 1).KV).BlocksFor(n))*uint64(testHybrid(1, 1).KV.BlockBytes()), kvb)
		i := 0
		for _, e := range ds.dest(id).Extents() {
			for _, b := range ds.bytes(e) {
				require.Equal(t, pattern(id, i), b, "request %d byte %d", id, i)
				i++
			}
		}
		require.NoError(t, ds.m.Free(id))
	}
	// One request-reply per handoff: the request and the reply are the only
	// messages clients published.
	requireInMsgs(t, f.srv, before, 2*5)
	ds.requireInitial(t)
	ps.requireInitial(t)
	require.Equal(t, uint64(5), d.Stats().Delivered)
	require.Equal(t, uint64(5), p.Stats().Served)
	require.Equal(t, int64(5), x.releases.Load())
}

// A ReadyJob's request to a decoder connected inproc runs on the dispatch
// goroutine, with the same outcome, messages and cleanup; the first one,
// before the engines are connected, runs on its own goroutine.
func TestHandoffReadyLeaseInline(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.ready.Store(true)
	d := f.decoder("d1", ds, nil)
	p := f.prefiller("p1", f.fp, x, nil)
	before := inMsgs(t, f.srv)
	for id := uint64(1); id <= 5; id++ {
		res, err := ds.handoff(context.Background(), d, Request{ID: id, Tokens: tokens(9), Deadline: time.Now().Add(5 * time.Second)})
		require.NoError(t, err)
		require.Equal(t, int32(id), res.FirstToken)
		i := 0
		for _, e := range ds.dest(id).Extents() {
			for _, b := range ds.bytes(e) {
				require.Equal(t, pattern(id, i), b, "request %d byte %d", id, i)
				i++
			}
		}
		require.NoError(t, ds.m.Free(id))
		<-x.started
	}
	require.Equal(t, int64(4), x.inline.Load())
	requireInMsgs(t, f.srv, before, 2*5)
	ds.requireInitial(t)
	ps.requireInitial(t)
	require.Equal(t, uint64(5), p.Stats().Served)
	require.Equal(t, int64(5), x.releases.Load())
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := p.Stats().InFlight; n != 0 {
			return fmt.Errorf("%d in flight", n)
		}
		return nil
	})
}

// transportEngine is a sender engine with a fixed connection state.
type transportEngine struct {
	senderEngine
	tr        rdma.Transport
	connected bool
}

func (e transportEngine) TransportFor(rdma.AgentID) (rdma.Transport, bool) { return e.tr, e.connected }

type notReady struct{ readyLease }

func (notReady) Ready() bool { return false }

func TestInlineOnlyWhenNothingCanBlock(t *testing.T) {
	ready, plain := readyLease{&testLease{}}, &testLease{}
	cases := []struct {
		name      string
		lease     AdmittedJob
		tr        rdma.Transport
		connected bool
		kv, mamba uint64
		want      bool
	}{
		{"ready inproc small", ready, rdma.TransportInproc, true, 4096, 128, true},
		{"ready inproc at the limit", ready, rdma.TransportInproc, true, InlineMaxBytes - 1, 1, true},
		{"ready inproc too large", ready, rdma.TransportInproc, true, InlineMaxBytes, 1, false},
		{"ready inproc overflowing sizes", ready, rdma.TransportInproc, true, math.MaxUint64, 2, false},
		{"ready not connected yet", ready, "", false, 1, 1, false},
		{"ready over tcp", ready, rdma.TransportTCP, true, 1, 1, false},
		{"ready over shm", ready, rdma.TransportSHM, true, 1, 1, false},
		{"not ready", notReady{ready}, rdma.TransportInproc, true, 1, 1, false},
		{"plain lease", plain, rdma.TransportInproc, true, 1, 1, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := &Prefiller{eng: transportEngine{tr: c.tr, connected: c.connected}}
			tk := &task{lease: c.lease, msg: PrefillRequest{KVBytes: c.kv, MambaBytes: c.mamba}}
			require.Equal(t, c.want, p.inline(tk))
		})
	}
}

func TestHandoffConcurrent(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(256, 16)), newSide(t, "pre", testHybrid(256, 16))
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", f.fp, newExec(ps), nil)
	const n = 16 // both sides hold 16 requests: none may be refused
	var wg sync.WaitGroup
	results := make([]Result, n+1)
	errs := make([]error, n+1)
	for id := uint64(1); id <= n; id++ {
		wg.Go(func() {
			results[id], errs[id] = ds.handoff(context.Background(), d, Request{ID: id, Tokens: tokens(13)})
		})
	}
	wg.Wait()
	for id := uint64(1); id <= n; id++ {
		require.NoError(t, errs[id], "request %d", id)
		res := results[id]
		require.Equal(t, int32(id), res.FirstToken, "request %d got another's reply", id)
		// Every byte of its destination is its own prefill's.
		i := 0
		for _, x := range ds.dest(id).Extents() {
			for j, b := range ds.bytes(x) {
				require.Equal(t, pattern(id, i), b, "request %d: byte %d of extent %v", id, j, x)
				i++
			}
		}
		require.NoError(t, ds.m.Free(id))
	}
	ds.requireInitial(t)
	ps.requireInitial(t)
}

func TestHandoffNoPrefillWorker(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(64, 8))
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoResponderWait = 300 * time.Millisecond })
	start := time.Now()
	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9)})
	require.ErrorIs(t, err, ErrNoPrefillWorker)
	require.Less(t, time.Since(start), 5*time.Second, "waited past NoResponderWait")
	ds.requireInitial(t)
	// Sent at 0, 50 and 150 ms; the next (350 ms) is past the wait.
	require.Equal(t, uint64(2), d.Stats().Retries)
}

// A prefill worker that is not there yet (restarting, or resubscribing
// after a NATS reconnect) when a request is sent serves it once it is: the
// request is sent again with a backoff instead of failing at once.
func TestHandoffWaitsForPrefillWorker(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoResponderWait = 10 * time.Second })
	type out struct {
		res Result
		err error
	}
	done := make(chan out, 1)
	go func() {
		res, err := ds.handoff(context.Background(), d, Request{ID: 4, Tokens: tokens(9), Deadline: time.Now().Add(20 * time.Second)})
		done <- out{res, err}
	}()
	time.Sleep(400 * time.Millisecond)
	f.prefiller("p1", f.fp, newExec(ps), nil)
	o := <-done
	require.NoError(t, o.err)
	require.Equal(t, int32(4), o.res.FirstToken)
	require.Greater(t, o.res.Attempts, 1)
	require.NoError(t, ds.m.Free(4))
	ds.requireInitial(t)
	ps.requireInitial(t)
}

func TestHandoffCapacityRefused(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.refuse.Store(true)
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", f.fp, x, nil)
	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9)})
	require.ErrorIs(t, err, ErrCapacityRefused)
	var re *RemoteError
	require.ErrorAs(t, err, &re)
	require.Equal(t, "p1", re.Instance)
	require.Equal(t, int64(3), x.admits.Load())
	ds.requireInitial(t)
	ps.requireInitial(t)
}

// TestHandoffRetriesOnAnotherWorker: a full worker refuses; the retry goes to
// the other worker by its instance subject.
func TestHandoffRetriesOnAnotherWorker(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(64, 8))
	full, free := newExec(newSide(t, "pre1", testHybrid(64, 8))), newExec(newSide(t, "pre2", testHybrid(64, 8)))
	full.refuse.Store(true)
	f.prefiller("p1", f.fp, full, withRegistryP)
	f.prefiller("p2", f.fp, free, withRegistryP)
	d := f.decoder("d1", ds, withRegistry)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := len(d.Registry().Instances(RolePrefill, time.Now())); n != 2 {
			return fmt.Errorf("%d prefill instances known", n)
		}
		return nil
	})
	for id := uint64(1); id <= 16; id++ {
		res, err := ds.handoff(context.Background(), d, Request{ID: id, Tokens: tokens(5)})
		require.NoError(t, err)
		require.Equal(t, "p2", res.Instance)
		require.LessOrEqual(t, res.Attempts, 2)
		require.NoError(t, ds.m.Free(id))
	}
	require.Positive(t, full.admits.Load(), "the queue group never chose the full worker")
	ds.requireInitial(t)
	free.s.requireInitial(t)
}

func TestHandoffLayoutMismatch(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", "fp-other-model", x, nil)
	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9)})
	require.ErrorIs(t, err, ErrLayoutMismatch)
	require.ErrorContains(t, err, "layout")
	require.Zero(t, x.admits.Load(), "admitted despite the mismatch")
	ds.requireInitial(t)
	for _, r := range ds.regions {
		require.Equal(t, make([]byte, r.Len()), r.Bytes(), "a byte moved")
	}
}

// TestHandoffLayoutMismatchBytes: same fingerprint, but the worker's cache of
// the prompt has another size (misconfigured block size): refused after
// prefill, before any byte moves.
func TestHandoffLayoutMismatchBytes(t *testing.T) {
	f := newFixture(t)
	other := testHybrid(64, 8)
	other.KV.TokensPerBlock = 8
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", other)
	x := newExec(ps)
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", f.fp, x, nil)
	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9)})
	require.ErrorIs(t, err, ErrLayoutMismatch)
	ds.requireInitial(t)
	ps.requireInitial(t)
	for _, r := range ds.regions {
		require.Equal(t, make([]byte, r.Len()), r.Bytes(), "a byte moved")
	}
}

func TestHandoffTimeoutFreesBothSides(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	d := f.decoder("d1", ds, nil)
	p := f.prefiller("p1", f.fp, x, nil)
	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(300 * time.Millisecond)})
	require.ErrorIs(t, err, ErrTimeout)
	ds.requireInitial(t)
	require.Error(t, <-x.ctxErr)
	ps.requireInitial(t)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if st := p.Stats(); st.InFlight != 0 {
			return fmt.Errorf("%d in flight", st.InFlight)
		}
		return nil
	})
}

// TestHandoffCancelStopsPrefill: the caller cancels while the worker
// prefills; the cancel message stops the worker long before the deadline.
func TestHandoffCancelStopsPrefill(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	d := f.decoder("d1", ds, nil)
	p := f.prefiller("p1", f.fp, x, nil)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-x.started; cancel() }()
	_, err := ds.handoff(ctx, d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
	require.ErrorIs(t, err, ErrCancelled)
	require.ErrorIs(t, <-x.ctxErr, context.Canceled)
	ds.requireInitial(t)
	ps.requireInitial(t)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if st := p.Stats(); st.Cancelled != 1 {
			return fmt.Errorf("stats %+v", st)
		}
		return nil
	})
}

// TestHandoffPrefillDeath: the serving worker disappears from the registry
// mid-prefill; the decoder fails at once with ErrPeerFailed.
func TestHandoffPrefillDeath(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	p := f.prefiller("p1", f.fp, x, withRegistryP)
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoRegistry, c.DirectFirst = false, true })
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := len(d.Registry().Instances(RolePrefill, time.Now())); n != 1 {
			return fmt.Errorf("%d prefill instances known", n)
		}
		return nil
	})
	go func() {
		<-x.started
		// What expiry of the worker's entry looks like to watchers.
		require.NoError(t, p.Registry().kv.Delete(context.Background(), registryKey(RolePrefill, "p1")))
	}()
	start := time.Now()
	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
	require.ErrorIs(t, err, ErrPeerFailed)
	require.Less(t, time.Since(start), 30*time.Second)
	ds.requireInitial(t)
	// The worker is alive after all: it gets the cancel and stops.
	require.ErrorIs(t, <-x.ctxErr, context.Canceled)
	ps.requireInitial(t)
}

// TestPrefillerStopsOnDecodeDeath: the requesting decode instance leaves the
// registry; the worker stops its prefill and frees.
func TestPrefillerStopsOnDecodeDeath(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	p := f.prefiller("p1", f.fp, x, withRegistryP)
	d := f.decoder("d1", ds, withRegistry)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := len(p.Registry().Instances(RoleDecode, time.Now())); n != 1 {
			return fmt.Errorf("%d decode instances known", n)
		}
		return nil
	})
	// The worker pre-connected its data plane to the decode instance it saw.
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if tr, ok := ps.eng.TransportFor("dec"); !ok || tr != rdma.TransportInproc {
			return fmt.Errorf("not connected (%q)", tr)
		}
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := ds.handoff(ctx, d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done <- err
	}()
	<-x.started
	require.NoError(t, d.Registry().kv.Delete(context.Background(), registryKey(RoleDecode, "d1")))
	require.ErrorIs(t, <-x.ctxErr, context.Canceled)
	ps.requireInitial(t)
	// The decoder hears the worker's peer_failed reply.
	err := <-done
	cancel()
	require.ErrorIs(t, err, ErrPeerFailed)
	ds.requireInitial(t)
}

func TestPrefillerShutdownAbortsInFlight(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	d := f.decoder("d1", ds, nil)
	p := f.prefiller("p1", f.fp, x, nil)
	done := make(chan error, 1)
	go func() {
		_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done <- err
	}()
	<-x.started
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	require.NoError(t, p.Shutdown(ctx))
	ps.requireInitial(t)
	require.ErrorIs(t, <-done, ErrClosed)
	ds.requireInitial(t)
	// After shutdown nobody serves the subject.
	_, err := ds.handoff(context.Background(), d, Request{ID: 4, Tokens: tokens(9)})
	require.ErrorIs(t, err, ErrNoPrefillWorker)
	ds.requireInitial(t)
}

func TestDecoderCloseFailsInFlight(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", f.fp, x, nil)
	done := make(chan error, 1)
	go func() {
		_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done <- err
	}()
	<-x.started
	require.NoError(t, d.Close())
	require.ErrorIs(t, <-done, ErrClosed)
	ds.requireInitial(t)
	require.ErrorIs(t, <-x.ctxErr, context.Canceled)
	ps.requireInitial(t)
	_, err := ds.handoff(context.Background(), d, Request{ID: 4, Tokens: tokens(9)})
	require.ErrorIs(t, err, ErrClosed)
}

func TestHandoffPayloadTooLarge(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(1<<16+2, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", f.fp, x, nil)
	before := inMsgs(t, f.srv)
	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(DefaultMaxPayload / 4)})
	require.ErrorIs(t, err, ErrPayloadTooLarge)
	require.Equal(t, before, inMsgs(t, f.srv), "something was published")
	require.Zero(t, x.admits.Load())
	ds.requireInitial(t)
}

// TestDummiesNeverTransferred: request id 0 and padding sentinels are refused
// by the decoder before granting and by the worker before admitting; a
// reserved row cannot be resolved nor granted.
func TestDummiesNeverTransferred(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", f.fp, x, nil)

	// A destination a broken caller might pass along with a dummy id.
	dest, err := ds.prepare(1, 4)
	require.NoError(t, err)
	for _, id := range []uint64{0, math.MaxUint64, math.MaxUint64 - 2} {
		_, err := d.Handoff(context.Background(), Request{ID: id, Tokens: tokens(4), Dest: dest})
		require.ErrorIs(t, err, ErrDummyRequest, "id %d", id)
	}
	require.Zero(t, ds.eng.Stats().GrantsOpened)
	require.NoError(t, ds.m.Free(1))

	// The worker refuses a request naming a dummy id, whoever sent it.
	nc := natstest.Connect(t, f.srv)
	for _, id := range []uint64{0, math.MaxUint64 - 1} {
		req := sampleRequest(4, 2)
		req.RequestID, req.Ticket.RequestID, req.Fingerprint = id, id, f.fp
		req.Deadline = time.Now().Add(time.Minute).UnixNano()
		b, err := EncodePrefillRequest(req, 0)
		require.NoError(t, err)
		m, err := nc.Request(Subject(DefaultPrefix, f.ns, SubjectPrefill, ""), b, 5*time.Second)
		require.NoError(t, err)
		rep, err := DecodePrefillReply(m.Data)
		require.NoError(t, err)
		require.Equal(t, CodeDummyRequest, rep.Code, "id %d", id)
	}
	require.Zero(t, x.admits.Load())

	// Reserved rows: the ADP dummy's row can be neither resolved nor granted.
	require.NoError(t, ds.m.AddDummy(mambacache.ADPDummyID))
	row, ok := ds.m.Mamba().Row(mambacache.ADPDummyID)
	require.True(t, ok)
	require.True(t, ds.m.Mamba().IsReserved(row))
	_, err = ds.rank.Resolve(hybrid.Resources{Row: row})
	require.ErrorIs(t, err, ErrDummyRequest)
	x0 := ds.m.Mamba().Config().RowExtent(row)
	var mambaRegion rdma.RegionID
	for id, r := range ds.regions {
		if r.Name() == "mamba" {
			mambaRegion = id
		}
	}
	_, err = ds.eng.OpenGrant(rdma.GrantSpec{RequestID: 5, Extents: []rdma.Extent{{Region: mambaRegion, Offset: uint64(x0.Offset), Length: uint64(x0.Length)}}})
	require.ErrorIs(t, err, rdma.ErrForbidden)
	require.Equal(t, CodeDummyRequest, rdmaCode(err))
	require.NoError(t, ds.m.Free(mambacache.ADPDummyID))
	ds.requireInitial(t)
}

// badRowDest is a reserved row's extent, as a broken allocator might hand
// it out.
func badRowDest(s *side) CacheExtents {
	cfg := s.m.Mamba().Config()
	row := mambacache.Row(cfg.TotalRows() - 1) // the padding row
	x := cfg.RowExtent(row)
	var region rdma.RegionID
	for rid, r := range s.regions {
		if r.Name() == "mamba" {
			region = rid
		}
	}
	return CacheExtents{Mamba: rdma.Extent{Region: region, Offset: uint64(x.Offset), Length: uint64(x.Length)}}
}

func TestHandoffRefusesReservedRowGrant(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(64, 8))
	require.True(t, ds.m.Mamba().IsReserved(mambacache.Row(ds.m.Mamba().Config().TotalRows()-1)))
	d := f.decoder("d1", ds, nil)
	_, err := d.Handoff(context.Background(), Request{ID: 9, Tokens: tokens(4), Dest: badRowDest(ds)})
	require.ErrorIs(t, err, ErrDummyRequest)
	require.ErrorIs(t, err, rdma.ErrForbidden)
}

func TestMicroServiceListed(t *testing.T) {
	f := newFixture(t)
	ps := newSide(t, "pre", testHybrid(64, 8))
	f.prefiller("p1", f.fp, newExec(ps), nil)
	nc := natstest.Connect(t, f.srv)
	m, err := nc.Request("$SRV.INFO."+ServiceName, nil, 5*time.Second)
	require.NoError(t, err)
	s := string(m.Data)
	require.Contains(t, s, `"name":"handoff-prefill"`)
	require.Contains(t, s, Subject(DefaultPrefix, f.ns, SubjectPrefill, ""))
	require.Contains(t, s, `"queue_group":"prefill"`)
	require.Contains(t, s, Subject(DefaultPrefix, f.ns, SubjectInstancePrefill, "p1"))
	require.Contains(t, s, `"fingerprint":"fp-tiny"`)
}

func TestRegistryExpiry(t *testing.T) {
	leakcheck.Check(t)
	srv := natstest.Run(t)
	nc := natstest.Connect(t, srv)
	ctx := context.Background()
	cfg := RegistryConfig{Namespace: "t1", TTL: time.Second}
	watcher, err := OpenRegistry(ctx, nc, cfg)
	require.NoError(t, err)
	defer watcher.Close(ctx)
	gone := make(chan string, 4)
	watcher.OnChange(func(inst Instance, g bool) {
		if g {
			gone <- inst.ID
		}
	})
	require.NoError(t, watcher.Watch(ctx, RolePrefill))

	// A live instance, refreshed by heartbeats, and one that stops.
	live, err := OpenRegistry(ctx, natstest.Connect(t, srv), RegistryConfig{Namespace: "t1", TTL: time.Second, Heartbeat: 200 * time.Millisecond})
	require.NoError(t, err)
	defer live.Close(ctx)
	require.NoError(t, live.Announce(ctx, func() Instance { return Instance{ID: "p-live", Role: RolePrefill, Fingerprint: "fp"} }))
	dead, err := OpenRegistry(ctx, natstest.Connect(t, srv), cfg)
	require.NoError(t, err)
	require.NoError(t, dead.put(ctx, registryKey(RolePrefill, "p-dead"), Instance{ID: "p-dead", Role: RolePrefill, Fingerprint: "fp"}))
	require.NoError(t, dead.Close(ctx))
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := len(watcher.Instances(RolePrefill, time.Now())); n != 2 {
			return fmt.Errorf("%d instances", n)
		}
		return nil
	})
	// The stopped one expires: locally by its age, then by the server's marker.
	select {
	case id := <-gone:
		require.Equal(t, "p-dead", id)
	case <-time.After(10 * time.Second):
		t.Fatal("no expiry seen")
	}
	got := watcher.Instances(RolePrefill, time.Now())
	require.Len(t, got, 1)
	require.Equal(t, "p-live", got[0].ID)
	require.Empty(t, watcher.Instances(RoleDecode, time.Now()))
	require.Empty(t, watcher.Instances(RolePrefill, time.Now().Add(2*time.Second)), "local ttl check")
}

func TestConfigValidation(t *testing.T) {
	leakcheck.Check(t)
	srv := natstest.Run(t)
	nc := natstest.Connect(t, srv)
	ds := newSide(t, "dec", testHybrid(8, 2))
	for _, cfg := range []DecoderConfig{
		{Namespace: "n", Fingerprint: "f"},
		{Instance: "a.b", Namespace: "n", Fingerprint: "f"},
		{Instance: "a", Namespace: "n"},
		{Instance: "a", Namespace: "n", Fingerprint: "f", MaxAttempts: -1},
	} {
		_, err := NewDecoder(context.Background(), cfg, nc, ds.eng)
		require.ErrorIs(t, err, ErrInvalidConfig, "%+v", cfg)
	}
	_, err := NewPrefiller(PrefillerConfig{Instance: "a", Namespace: "n", Fingerprint: "f"}, nc, ds.eng, nil)
	require.ErrorIs(t, err, ErrInvalidConfig)
	_, err = OpenRegistry(context.Background(), nc, RegistryConfig{Namespace: "n", TTL: time.Second, Heartbeat: 2 * time.Second})
	require.ErrorIs(t, err, ErrInvalidConfig)
	d, err := NewDecoder(context.Background(), DecoderConfig{Instance: "a", Namespace: "n", Fingerprint: "f", NoRegistry: true}, nc, ds.eng)
	require.NoError(t, err)
	_, err = d.Handoff(context.Background(), Request{ID: 1})
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.NoError(t, d.Close())
	require.NoError(t, d.Close())
}

// BenchmarkHandoff measures one minimal handoff end to end (1-byte cache,
// embedded NATS, inproc data path).
func BenchmarkHandoff(b *testing.B) {
	srv := natstest.Run(b)
	quiet := slog.New(slog.DiscardHandler)
	newEng := func(agent string) (*rdma.Engine, *rdma.Region) {
		e, err := rdma.New(rdma.Config{Agent: rdma.AgentID(agent), Transports: []rdma.Transport{rdma.TransportInproc}, Logger: quiet})
		require.NoError(b, err)
		b.Cleanup(func() { _ = e.Close() })
		r, err := e.Register("state", 4096)
		require.NoError(b, err)
		return e, r
	}
	de, dr := newEng("bd")
	pe, pr := newEng("bp")
	p, err := NewPrefiller(PrefillerConfig{Instance: "p", Namespace: "b", Fingerprint: "f", NoRegistry: true},
		natstest.Connect(b, srv), pe, fixedExec{CacheExtents{Mamba: rdma.Extent{Region: pr.ID(), Length: 1}}})
	require.NoError(b, err)
	require.NoError(b, p.Start(context.Background()))
	b.Cleanup(func() { _ = p.Shutdown(context.Background()) })
	d, err := NewDecoder(context.Background(), DecoderConfig{Instance: "d", Namespace: "b", Fingerprint: "f", NoRegistry: true},
		natstest.Connect(b, srv), de)
	require.NoError(b, err)
	b.Cleanup(func() { _ = d.Close() })
	dest := CacheExtents{Mamba: rdma.Extent{Region: dr.ID(), Length: 1}}
	b.ReportAllocs()
	id := uint64(0)
	for b.Loop() {
		id++
		if _, err := d.Handoff(context.Background(), Request{ID: id, Tokens: tokens(8), Dest: dest}); err != nil {
			b.Fatal(err)
		}
	}
}

type fixedExec struct{ src CacheExtents }

func (x fixedExec) Admit(Job) (AdmittedJob, error) { return fixedLease(x), nil }

type fixedLease struct{ src CacheExtents }

func (l fixedLease) Prefill(context.Context) (Prefilled, error) {
	return Prefilled{FirstToken: 1, Source: l.src}, nil
}
func (fixedLease) Release() {}

// TestFailureMatchesOneSentinel: whatever happened before, a Handoff error
// matches exactly one class.
func TestFailureMatchesOneSentinel(t *testing.T) {
	h := &handoff{req: Request{ID: 5}}
	cases := []struct {
		cause error
		code  Code
		also  error // a non-transfer error that must stay reachable
	}{
		{nil, CodeTimeout, nil},
		{&RemoteError{Code: CodeCapacityRefused}, CodeCapacityRefused, nil},
		{&RemoteError{Code: CodeCapacityRefused}, CodeNoPrefillWorker, nil},
		{fmt.Errorf("grant: %w", rdma.ErrForbidden), CodeDummyRequest, rdma.ErrForbidden},
		{context.Canceled, CodeCancelled, context.Canceled},
		{context.DeadlineExceeded, CodeTimeout, context.DeadlineExceeded},
	}
	for _, c := range cases {
		h.cause = c.cause
		err := h.failure(c.code)
		require.Equal(t, c.code, CodeOf(err), "%v", err)
		for o := Code(1); o < codeCount; o++ {
			require.Equal(t, o == c.code, errors.Is(err, CodeErr(o)), "%v vs %s", err, o)
		}
		if c.also != nil {
			require.ErrorIs(t, err, c.also)
		}
	}
}

// A prefill worker that starts after a decode instance is already announced
// receives it from the registry's initial values while Start is still running;
// Start must not hold the lock that pre-connecting takes.
func TestPrefillerStartsAfterDecoderAnnounced(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	d := f.decoder("d1", ds, withRegistry)
	started := make(chan *Prefiller, 1)
	go func() { started <- f.prefiller("p1", f.fp, newExec(ps), withRegistryP) }()
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("Prefiller.Start did not return with a decode instance already registered")
	}
	res, err := ds.handoff(context.Background(), d, Request{ID: 1, Tokens: tokens(9), Deadline: time.Now().Add(5 * time.Second)})
	require.NoError(t, err)
	require.Equal(t, "p1", res.Instance)
	require.NoError(t, ds.m.Free(1))
}

// syncBuffer is a bytes.Buffer safe for a logger shared by goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// duplicateKeys returns the top-level keys a JSON log line repeats.
func duplicateKeys(t *testing.T, line string) []string {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(line))
	tok, err := dec.Token()
	require.NoError(t, err, line)
	require.Equal(t, json.Delim('{'), tok, line)
	seen := map[string]bool{}
	var dups []string
	for dec.More() {
		k, err := dec.Token()
		require.NoError(t, err, line)
		if seen[k.(string)] {
			dups = append(dups, k.(string))
		}
		seen[k.(string)] = true
		var v json.RawMessage
		require.NoError(t, dec.Decode(&v), line)
	}
	return dups
}

// The worker's logger already carries the instance id, so no log line of the
// drivers may name a peer under the same key.
func TestLogLinesHaveNoDuplicateKeys(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	var out syncBuffer
	logger := func(id string) *slog.Logger {
		return slog.New(slog.NewJSONHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug})).With("instance", id)
	}
	d := f.decoder("d1", ds, func(c *DecoderConfig) { withRegistry(c); c.Logger = logger("d1") })
	f.prefiller("p1", f.fp, newExec(ps), func(c *PrefillerConfig) { withRegistryP(c); c.Logger = logger("p1") })
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if !strings.Contains(out.String(), "pre-connected to decode instance") {
			return errors.New("no pre-connect logged yet")
		}
		return nil
	})
	_, err := ds.handoff(context.Background(), d, Request{ID: 1, Tokens: tokens(9), Deadline: time.Now().Add(5 * time.Second)})
	require.NoError(t, err)
	require.NoError(t, ds.m.Free(1))
	require.Contains(t, out.String(), "handoff delivered")
	require.Contains(t, out.String(), `"seq":1`, "the decode engine logs the request's seq under that key")
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		require.Empty(t, duplicateKeys(t, line), line)
	}
}

// nats.go ends a KV watch when the context it was created with ends, so the
// registry must not create it with Watch's ctx, which only bounds the wait for
// the initial entries.
func TestRegistryWatchOutlivesItsContext(t *testing.T) {
	leakcheck.Check(t)
	srv := natstest.Run(t)
	cfg := RegistryConfig{Namespace: "t1", TTL: 30 * time.Second}
	watcher, err := OpenRegistry(context.Background(), natstest.Connect(t, srv), cfg)
	require.NoError(t, err)
	defer watcher.Close(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	require.NoError(t, watcher.Watch(ctx, RolePrefill))
	cancel()

	time.Sleep(50 * time.Millisecond) // let a watch bound to ctx end
	late, err := OpenRegistry(context.Background(), natstest.Connect(t, srv), cfg)
	require.NoError(t, err)
	defer late.Close(context.Background())
	require.NoError(t, late.Announce(context.Background(), func() Instance {
		return Instance{ID: "p-late", Role: RolePrefill, Fingerprint: "fp"}
	}))
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := len(watcher.Instances(RolePrefill, time.Now())); n != 1 {
			return fmt.Errorf("%d instances, want the one announced after Watch's ctx ended", n)
		}
		return nil
	})
}

// slowConnect is a sender engine whose pre-connects block until cancelled;
// its first pre-connect also cancels the ctx of the Start that triggered it.
type slowConnect struct {
	senderEngine
	cancelStart context.CancelFunc
	connecting  chan struct{}
	returned    chan struct{}
}

func (s *slowConnect) Descriptor() rdma.Descriptor {
	select { // Start announces after the watch delivered the decode instance
	case <-s.connecting:
	case <-time.After(5 * time.Second):
	}
	return s.senderEngine.Descriptor()
}

func (s *slowConnect) Connect(ctx context.Context, _ rdma.Descriptor) (rdma.Transport, error) {
	s.cancelStart()
	close(s.connecting)
	<-ctx.Done()
	close(s.returned)
	return "", ctx.Err()
}

// A Start that fails after the registry delivered a decode instance stops the
// pre-connect it began before returning, as Shutdown would.
func TestPrefillerFailedStartStopsPreconnect(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	f.decoder("d1", ds, withRegistry)
	p, err := NewPrefiller(PrefillerConfig{Instance: "p1", Namespace: f.ns, Fingerprint: f.fp,
		Registry: RegistryConfig{TTL: 30 * time.Second}}, natstest.Connect(t, f.srv), ps.eng, newExec(ps))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	eng := &slowConnect{senderEngine: ps.eng, cancelStart: cancel, connecting: make(chan struct{}), returned: make(chan struct{})}
	p.eng = eng
	require.Error(t, p.Start(ctx))
	select {
	case <-eng.returned:
	default:
		t.Fatal("Start returned an error with its pre-connect still running")
	}
	require.NoError(t, p.Shutdown(context.Background()))
}

// fakeRequest is a micro.Request that keeps the reply.
type fakeRequest struct {
	micro.Request
	data  []byte
	reply []byte
}

func (r *fakeRequest) Data() []byte  { return r.data }
func (r *fakeRequest) Reply() string { return "_INBOX.test" }
func (r *fakeRequest) Respond(b []byte, _ ...micro.RespondOpt) error {
	r.reply = b
	return nil
}
func (r *fakeRequest) Error(_, _ string, b []byte, _ ...micro.RespondOpt) error {
	r.reply = b
	return nil
}

// A request that reaches a prefiller already shutting down (dispatched before
// its endpoints stopped) is refused as capacity, which the decoder retries on
// another worker, not failed as closed.
func TestPrefillerNotServingRefusesAsCapacity(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	p := f.prefiller("p1", f.fp, x, nil)
	require.NoError(t, p.Shutdown(context.Background()))
	dest, err := ds.prepare(1, 9)
	require.NoError(t, err)
	defer ds.m.Free(1)
	kvb, mb := dest.Bytes()
	deadline := time.Now().Add(5 * time.Second)
	g, err := ds.eng.OpenGrant(rdma.GrantSpec{RequestID: 1, Extents: dest.Extents(), Deadline: deadline})
	require.NoError(t, err)
	defer g.Revoke()
	b, err := EncodePrefillRequest(PrefillRequest{RequestID: 1, From: "d1", Fingerprint: f.fp, Tokens: tokens(9),
		Deadline: deadline.UnixNano(), Peer: PeerOf(ds.eng.Descriptor()),
		Ticket: TicketOf(g.Ticket()), KVBytes: kvb, MambaBytes: mb}, 0)
	require.NoError(t, err)
	r := &fakeRequest{data: b}
	p.handle(r)
	rep, err := DecodePrefillReply(r.reply)
	require.NoError(t, err)
	require.Equal(t, CodeCapacityRefused, rep.Code, rep.Msg)
	require.ErrorIs(t, &RemoteError{Code: rep.Code}, ErrCapacityRefused)
	require.Zero(t, x.admits.Load())
	ps.requireInitial(t)
}

// Shutdown may come at any point of Start: both return, Start with nil or
// ErrClosed, and nothing stays subscribed or running.
func TestPrefillerShutdownDuringStart(t *testing.T) {
	f := newFixture(t)
	ps := newSide(t, "pre", testHybrid(64, 8))
	nc := natstest.Connect(t, f.srv)
	_, err := nc.Request("$JS.API.INFO", nil, 5*time.Second) // the connection's reply mux subscribes once
	require.NoError(t, err)
	baseline := nc.NumSubscriptions()
	for i := range 8 {
		p, err := NewPrefiller(PrefillerConfig{Instance: fmt.Sprintf("p%d", i), Namespace: f.ns, Fingerprint: f.fp,
			Registry: RegistryConfig{TTL: 30 * time.Second}}, nc, ps.eng, newExec(ps))
		require.NoError(t, err)
		started := make(chan error, 1)
		go func() { started <- p.Start(context.Background()) }()
		time.Sleep(time.Duration(i) * time.Millisecond)
		require.NoError(t, p.Shutdown(context.Background()))
		if err := <-started; err != nil {
			require.ErrorIs(t, err, ErrClosed)
		}
		require.NoError(t, p.Shutdown(context.Background()))
	}
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := nc.NumSubscriptions(); n != baseline {
			return fmt.Errorf("%d subscriptions left, want %d", n, baseline)
		}
		return nil
	})
}

// localIDs admits each job under an id of its own in the prefill worker's
// pools, as a worker does: decoders' request ids are theirs, not global.
type localIDs struct {
	x    *testExec
	next atomic.Uint64
}

func (l *localIDs) Admit(job Job) (AdmittedJob, error) {
	job.RequestID = 1000 + l.next.Add(1)
	return l.x.Admit(job)
}

// Request ids and grant ids are per decoder, so two decoders' requests can
// share both: a cancel from one decoder stops only its own request.
func TestCancelStopsOnlyTheSendersRequest(t *testing.T) {
	f := newFixture(t)
	ds1, ds2 := newSide(t, "dec1", testHybrid(64, 8)), newSide(t, "dec2", testHybrid(64, 8))
	ps := newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.block = make(chan struct{})
	d1, d2 := f.decoder("d1", ds1, nil), f.decoder("d2", ds2, nil)
	p, err := NewPrefiller(PrefillerConfig{Instance: "p1", Namespace: f.ns, Fingerprint: f.fp, MaxDraftTokens: 2, NoRegistry: true},
		natstest.Connect(t, f.srv), ps.eng, &localIDs{x: x})
	require.NoError(t, err)
	require.NoError(t, p.Start(context.Background()))
	defer func() { require.NoError(t, p.Shutdown(context.Background())) }()

	ctx1, cancel1 := context.WithCancel(context.Background())
	defer cancel1()
	failed1 := make(chan error, 1)
	go func() {
		_, err := ds1.handoff(ctx1, d1, Request{ID: 1, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		failed1 <- err
	}()
	<-x.started
	done2 := make(chan error, 1)
	go func() {
		_, err := ds2.handoff(context.Background(), d2, Request{ID: 1, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done2 <- err
	}()
	<-x.started // both prefills run: request 1, grant 1 of each decoder
	cancel1()
	require.ErrorIs(t, <-failed1, ErrCancelled)
	require.ErrorIs(t, <-x.ctxErr, context.Canceled)
	close(x.block)
	require.NoError(t, <-done2, "d2's request was stopped by d1's cancel")
	require.NoError(t, ds2.m.Free(1))
	ds1.requireInitial(t)
	ds2.requireInitial(t)
	ps.requireInitial(t)
}

// The prefiller counts the bytes of served handoffs only: a handoff cancelled
// mid-prefill adds nothing.
func TestPrefillerCountsServedBytes(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	d := f.decoder("d1", ds, nil)
	p := f.prefiller("p1", f.fp, x, nil)
	res, err := ds.handoff(context.Background(), d, Request{ID: 1, Tokens: tokens(9), Deadline: time.Now().Add(5 * time.Second)})
	require.NoError(t, err)
	require.NoError(t, ds.m.Free(1))

	x.block = make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-x.started; <-x.started; cancel() }()
	_, err = ds.handoff(ctx, d, Request{ID: 2, Tokens: tokens(30), Deadline: time.Now().Add(time.Minute)})
	require.ErrorIs(t, err, ErrCancelled)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if st := p.Stats(); st.Cancelled != 1 {
			return fmt.Errorf("stats %+v", st)
		}
		return nil
	})
	st := p.Stats()
	require.Equal(t, res.KVBytes, st.KVBytes)
	require.Equal(t, res.MambaBytes, st.MambaBytes)
}

// A prefiller that shuts down stays registered for its requests in flight
// but announces it is draining: decoders stop addressing it at once instead
// of spending an attempt on it.
func TestDrainingPrefillerNotAddressed(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(64, 8))
	ps1, ps2 := newSide(t, "pre1", testHybrid(64, 8)), newSide(t, "pre2", testHybrid(64, 8))
	x1, x2 := newExec(ps1), newExec(ps2)
	x1.block, x2.block = make(chan struct{}), make(chan struct{})
	d := f.decoder("d1", ds, func(c *DecoderConfig) { withRegistry(c); c.DirectFirst = true })
	p1 := f.prefiller("p1", f.fp, x1, withRegistryP)
	f.prefiller("p2", f.fp, x2, withRegistryP)
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := len(d.Registry().Instances(RolePrefill, time.Now())); n != 2 {
			return fmt.Errorf("%d prefill instances", n)
		}
		return nil
	})
	type outcome struct {
		res Result
		err error
	}
	results := make(chan outcome, 4)
	handoff := func(id uint64) {
		res, err := ds.handoff(context.Background(), d, Request{ID: id, Tokens: tokens(5), Deadline: time.Now().Add(time.Minute)})
		results <- outcome{res, err}
	}
	// Load: one request blocked on p1, two on p2, so p1 is the least loaded.
	go handoff(1)
	go handoff(2)
	go handoff(3)
	for range 3 {
		select {
		case <-x1.started:
		case <-x2.started:
		}
	}
	require.Equal(t, int64(1), x1.admits.Load())

	shut := make(chan error, 1)
	go func() { shut <- p1.Shutdown(context.Background()) }() // drains its blocked request
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		for _, inst := range d.Registry().Instances(RolePrefill, time.Now()) {
			if inst.ID == "p1" && inst.Draining {
				return nil
			}
		}
		return errors.New("p1 not seen draining")
	})
	go handoff(4)
	<-x2.started
	close(x1.block)
	close(x2.block)
	require.NoError(t, <-shut)
	for range 4 {
		o := <-results
		require.NoError(t, o.err)
		if o.res.FirstToken == 4 { // the test executor's first token is the request id
			require.Equal(t, "p2", o.res.Instance)
			require.Equal(t, 1, o.res.Attempts, "request 4 spent an attempt on the draining instance")
		}
	}
	for id := uint64(1); id <= 4; id++ {
		require.NoError(t, ds.m.Free(id))
	}
	ds.requireInitial(t)
}

// TestHandoffPrefillDeathRetried: the worker that took the request leaves the
// registry before any commit; the decoder revokes the grant, opens a fresh one
// over the same blocks and row, and the other worker serves the request. The
// "dead" worker was only partitioned: a write with its old ticket is refused
// and changes no byte.
func TestHandoffPrefillDeathRetried(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(64, 8))
	ps := map[string]*side{"p1": newSide(t, "pre1", testHybrid(64, 8)), "p2": newSide(t, "pre2", testHybrid(64, 8))}
	xs := map[string]*testExec{}
	pre := map[string]*Prefiller{}
	for _, name := range []string{"p1", "p2"} {
		xs[name] = newExec(ps[name])
		xs[name].block = make(chan struct{})
		pre[name] = f.prefiller(name, f.fp, xs[name], withRegistryP)
	}
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoRegistry, c.DirectFirst = false, true })
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := len(d.Registry().Instances(RolePrefill, time.Now())); n != 2 {
			return fmt.Errorf("%d prefill instances known", n)
		}
		return nil
	})
	// Every request addressed to an instance, as sent.
	nc := natstest.Connect(t, f.srv)
	sent := make(chan PrefillRequest, 8)
	sub, err := nc.Subscribe(Subject(DefaultPrefix, f.ns, SubjectInstancePrefill, "*"), func(m *nats.Msg) {
		if r, err := DecodePrefillRequest(m.Data); err == nil {
			sent <- r
		}
	})
	require.NoError(t, err)
	defer sub.Unsubscribe()
	require.NoError(t, nc.Flush())

	type out struct {
		res Result
		err error
	}
	done := make(chan out, 1)
	go func() {
		res, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done <- out{res, err}
	}()
	var dead, live string
	select {
	case <-xs["p1"].started:
		dead, live = "p1", "p2"
	case <-xs["p2"].started:
		dead, live = "p2", "p1"
	}
	first := <-sent
	require.Equal(t, uint8(1), first.Attempt)
	// What expiry of the worker's entry looks like to watchers.
	require.NoError(t, pre[dead].Registry().kv.Delete(context.Background(), registryKey(RolePrefill, dead)))
	<-xs[live].started
	second := <-sent
	require.Equal(t, uint8(2), second.Attempt)
	require.NotEqual(t, first.Ticket.Grant, second.Ticket.Grant, "the retry writes into a fresh grant")
	close(xs[live].block)
	o := <-done
	require.NoError(t, o.err)
	require.Equal(t, live, o.res.Instance)
	require.Equal(t, 2, o.res.Attempts)
	require.Equal(t, int32(3), o.res.FirstToken)
	checkPattern := func() {
		i := 0
		for _, e := range ds.dest(3).Extents() {
			for _, b := range ds.bytes(e) {
				require.Equal(t, pattern(3, i), b, "byte %d", i)
				i++
			}
		}
	}
	checkPattern()
	// The dead worker was alive after all: it got the cancel and stopped.
	require.ErrorIs(t, <-xs[dead].ctxErr, context.Canceled)

	// A late write with the dead worker's ticket is refused by the data plane.
	old, err := first.Ticket.RDMA()
	require.NoError(t, err)
	src, err := ps[dead].prepare(99, 9)
	require.NoError(t, err)
	for _, e := range src.Extents() {
		for j, b := 0, ps[dead].bytes(e); j < len(b); j++ {
			b[j] = 0xEE
		}
	}
	_, err = ps[dead].eng.Write(context.Background(), first.Peer.Descriptor(), old, src.Extents())
	require.Error(t, err)
	require.Equal(t, CodeCancelled, rdmaCode(err), "late write: %v", err) // revoked, unknown or stale grant
	require.NoError(t, ps[dead].m.Free(99))
	checkPattern()

	require.NoError(t, ds.m.Free(3))
	ds.requireInitial(t)
	ps["p1"].requireInitial(t)
	ps["p2"].requireInitial(t)
	require.Equal(t, uint64(1), d.Stats().Retries)
}

// TestHandoffWriterGoneRetried: the prefill worker serving a handoff loses
// every data-path connection (its engine closes, as when the process is
// killed) while its registry entry stays fresh. The decoder learns it from
// its own engine, fences the grant and retries on the other worker.
func TestHandoffWriterGoneRetried(t *testing.T) {
	f := newFixture(t)
	ds := newSideOn(t, "dec", testHybrid(64, 8), rdma.TransportTCP)
	ps := map[string]*side{
		"p1": newSideOn(t, "p1", testHybrid(64, 8), rdma.TransportTCP),
		"p2": newSideOn(t, "p2", testHybrid(64, 8), rdma.TransportTCP),
	}
	xs := map[string]*testExec{}
	for _, name := range []string{"p1", "p2"} {
		xs[name] = newExec(ps[name])
		xs[name].block = make(chan struct{})
		f.prefiller(name, f.fp, xs[name], withRegistryP)
	}
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoRegistry, c.DirectFirst = false, true })
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := len(d.Registry().Instances(RolePrefill, time.Now())); n != 2 {
			return fmt.Errorf("%d prefill instances known", n)
		}
		for name, p := range ps { // pre-connected at discovery
			if _, ok := p.eng.TransportFor(ds.eng.Agent()); !ok {
				return fmt.Errorf("%s not connected to the decoder yet", name)
			}
		}
		return nil
	})
	type out struct {
		res Result
		err error
	}
	done := make(chan out, 1)
	go func() {
		res, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done <- out{res, err}
	}()
	var dead, live string
	select {
	case <-xs["p1"].started:
		dead, live = "p1", "p2"
	case <-xs["p2"].started:
		dead, live = "p2", "p1"
	}
	// Without the report the handoff would wait for its deadline: the dead
	// worker's registry entry stays fresh.
	require.NoError(t, ps[dead].eng.Close())
	<-xs[live].started
	close(xs[live].block)
	o := <-done
	require.NoError(t, o.err)
	require.Equal(t, live, o.res.Instance)
	require.Equal(t, 2, o.res.Attempts)
	i := 0
	for _, e := range ds.dest(3).Extents() {
		for _, b := range ds.bytes(e) {
			require.Equal(t, pattern(3, i), b, "byte %d", i)
			i++
		}
	}
	// The worker that lost its engine got the cancel and stopped.
	require.ErrorIs(t, <-xs[dead].ctxErr, context.Canceled)
	require.NoError(t, ds.m.Free(3))
	ds.requireInitial(t)
	ps[live].requireInitial(t)
	ps[dead].requireInitial(t)
}

// TestHandoffSurvivesLiveWriterDroppingItsConnection: a prefill worker that
// lives breaks its only data-path connection to the decoder, as its engine
// does after a write whose context ended (another request cancelled while
// its bytes were sent). The worker connects again before letting the broken
// connection go, so the decoder hears of no death, and the handoff it is
// computing completes on its first attempt.
func TestHandoffSurvivesLiveWriterDroppingItsConnection(t *testing.T) {
	f := newFixture(t)
	ds := newSideOn(t, "dec", testHybrid(64, 8), rdma.TransportTCP)
	ps := newSideOn(t, "p1", testHybrid(64, 8), rdma.TransportTCP)
	x := newExec(ps)
	x.block = make(chan struct{})
	f.prefiller("p1", f.fp, x, withRegistryP)
	gone := make(chan rdma.AgentID, 8)
	stop := ds.eng.OnWriterGone(func(a rdma.AgentID) { gone <- a })
	defer stop()
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoRegistry, c.DirectFirst = false, true })
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := len(d.Registry().Instances(RolePrefill, time.Now())); n != 1 {
			return fmt.Errorf("%d prefill instances known", n)
		}
		if _, ok := ps.eng.TransportFor(ds.eng.Agent()); !ok {
			return fmt.Errorf("p1 not connected to the decoder yet")
		}
		return nil
	})
	type out struct {
		res Result
		err error
	}
	done := make(chan out, 1)
	go func() {
		res, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done <- out{res, err}
	}()
	require.Equal(t, uint64(3), <-x.started)

	// Another request's write from p1 whose context ended: the writer drops
	// the connection it used, its only one to the decoder.
	dst, err := ds.prepare(5, 9)
	require.NoError(t, err)
	g, err := ds.eng.OpenGrant(rdma.GrantSpec{RequestID: 5, Extents: dst.Extents(), Deadline: time.Now().Add(time.Minute)})
	require.NoError(t, err)
	src, err := ps.prepare(5, 9)
	require.NoError(t, err)
	cctx, cancel := context.WithCancel(context.Background())
	cancel()
	// Whether the bytes got out before the cancel took hold or not, a
	// connection whose deadline the cancel may have moved is not reused.
	_, _ = ps.eng.Write(cctx, ds.eng.Descriptor(), g.Ticket(), src.Extents())
	g.Revoke()
	require.NoError(t, ds.m.Free(5))
	require.NoError(t, ps.m.Free(5))
	select {
	case a := <-gone:
		t.Fatalf("%s reported gone while it lives", a)
	case <-time.After(100 * time.Millisecond):
	}

	// p1 lives and finishes the handoff it was computing.
	close(x.block)
	o := <-done
	require.NoError(t, o.err)
	require.Equal(t, "p1", o.res.Instance)
	require.Equal(t, 1, o.res.Attempts)
	require.NoError(t, ds.m.Free(3))
	ds.requireInitial(t)
	ps.requireInitial(t)
}
