package transfer

// Handoffs that succeed: the happy path, concurrent handoffs, inline
// dispatch of ready leases, what a served handoff counts, and the benchmark.

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/rdma"
)

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
		kvb, mb := ds.dest(id).bytes()
		require.Equal(t, kvb, res.KVBytes)
		require.Equal(t, mb, res.MambaBytes)
		require.Equal(t, uint64(kvcache.Config(testHybrid(1, 1).KV).BlocksFor(n))*uint64(testHybrid(1, 1).KV.BlockBytes()), kvb)
		i := 0
		for _, e := range ds.dest(id).extents() {
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
		for _, x := range ds.dest(id).extents() {
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
