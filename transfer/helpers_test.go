package transfer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/internal/leakcheck"
	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/wire"
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

// handoffOut is what a handoff run by handoffAsync returned.
type handoffOut struct {
	res Result
	err error
}

// handoffAsync runs s.handoff on a goroutine and delivers its outcome.
func (s *side) handoffAsync(d *Decoder, req Request) <-chan handoffOut {
	done := make(chan handoffOut, 1)
	go func() {
		res, err := s.handoff(context.Background(), d, req)
		done <- handoffOut{res, err}
	}()
	return done
}

// requirePattern checks every byte of request id's destination: the test
// executor's pattern, in the order of the destination's extents.
func (s *side) requirePattern(t *testing.T, id uint64) {
	t.Helper()
	i := 0
	for _, e := range s.dest(id).extents() {
		for _, b := range s.bytes(e) {
			require.Equal(t, pattern(id, i), b, "byte %d", i)
			i++
		}
	}
}

// pattern is the byte the test executor writes at offset i of request id's
// cache: the receiver checks every byte it got.
func pattern(id uint64, i int) byte { return byte(id*31 + uint64(i)*7 + uint64(i>>8)) }

// testExec is a PrefillExecutor over a side's pools, with fault switches.
type testExec struct {
	s        *side
	refuse   atomic.Bool
	tooLong  atomic.Bool   // refuses every request as longer than its pools
	block    chan struct{} // when set, Prefill waits for it (or ctx)
	started  chan uint64   // receives request ids as prefills start (buffered)
	ctxErr   chan error    // receives the ctx error of a blocked prefill
	admits   atomic.Int64
	releases atomic.Int64
	keys     atomic.Uint64 // admission keys: see Admit
	drafts   []int32       // draft tokens every Prefill proposes (set before use)
	// prefillErr, when set, is what every Prefill returns once started
	// (set before use).
	prefillErr error
	// slowRelease, when set, is how long Release takes before it frees
	// (set before use).
	slowRelease time.Duration
}

func newExec(s *side) *testExec {
	return &testExec{s: s, started: make(chan uint64, 64), ctxErr: make(chan error, 64)}
}

func (x *testExec) Admit(job Job) (AdmittedJob, error) {
	x.admits.Add(1)
	if x.refuse.Load() {
		return nil, fmt.Errorf("%w: test executor full", ErrCapacityRefused)
	}
	if x.tooLong.Load() {
		return nil, fmt.Errorf("%w: %w: test executor's pools", ErrCapacityRefused, ErrTooLong)
	}
	// Each admission holds its resources under a key of its own, as the
	// real worker's scheduler does: two attempts of one request may be
	// admitted on one worker at once (a fenced retry handed back to it
	// while the old attempt still winds down), and a pool keyed by the
	// request id would let the first release free the second's resources
	// (Prepare of a held id grows it).
	key := 1<<40 + x.keys.Add(1)
	d, err := x.s.prepare(key, len(job.Tokens))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCapacityRefused, err)
	}
	return &testLease{x: x, job: job, key: key, d: d}, nil
}

type testLease struct {
	x        *testExec
	job      Job
	key      uint64 // the admission's key in x.s's pools
	d        CacheExtents
	released atomic.Bool
}

func (l *testLease) Prefill(ctx context.Context) (Prefilled, error) {
	l.x.started <- l.job.RequestID
	if l.x.block != nil {
		select {
		case <-l.x.block:
		case <-ctx.Done():
			l.x.ctxErr <- ctx.Err()
			return Prefilled{}, ctx.Err()
		}
	}
	if l.x.prefillErr != nil {
		return Prefilled{}, l.x.prefillErr
	}
	out := l.x.s.prefilled(l.job.RequestID, l.d)
	out.Drafts = l.x.drafts // all of them: the prefiller cuts them to what was asked
	return out, nil
}

// prefilled fills d, a source on s, with request id's pattern and returns
// the prefill's outcome over it, as every test executor's Prefill does.
func (s *side) prefilled(id uint64, d CacheExtents) Prefilled {
	i := 0
	for _, e := range d.extents() {
		b := s.bytes(e)
		for j := range b {
			b[j] = pattern(id, i)
			i++
		}
	}
	return Prefilled{FirstToken: int32(id % 1000), Source: d}
}

func (l *testLease) Release() {
	if l.released.Swap(true) {
		panic("lease released twice")
	}
	l.x.releases.Add(1)
	time.Sleep(l.x.slowRelease)
	if err := l.x.s.m.Free(l.key); err != nil {
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
		err := p.Shutdown(ctx)
		if !nc.IsClosed() { // a test that closed it killed the worker: it cannot delete its entry
			require.NoError(f.t, err)
		}
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

// waitKnown waits until reg knows n live instances of role.
func waitKnown(t *testing.T, reg *Registry, role wire.Role, n int) {
	t.Helper()
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if got := len(reg.Instances(role, time.Now())); got != n {
			return fmt.Errorf("%d %s instances known, want %d", got, role, n)
		}
		return nil
	})
}
