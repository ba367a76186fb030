package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer"
)

// tinyLayout is shaped like tiny-hybrid's caches, smaller pools.
func tinyLayout() Layout {
	return Layout{
		Model: "tiny-hybrid", Revision: "test", Pattern: "M*M*", Vocab: 256,
		KV:    &KVLayout{Layers: 2, KVHeads: 2, HeadDim: 16, TokensPerBlock: 16, DType: "float32", Blocks: 32},
		Mamba: &MambaLayout{Layers: 2, Heads: 4, HeadDim: 16, DState: 16, NGroups: 1, DConv: 4, ConvDType: "float32", SSMDType: "float32", Rows: 6, Reserved: []int{5}},
	}
}

// engine is a test engine: a connected Client and its pools' memory, mapped
// from memfds like an engine's tensors.
type engine struct {
	c       *Client
	kv, mam []byte
	p       *pools
}

// rawEngine is an engine that reads the connection itself, frame by
// frame in the order the agent wrote them (the Client sorts replies from
// events).
type rawEngine struct {
	t  *testing.T
	c  *net.UnixConn
	r  *bufio.Reader
	id uint64
}

// registerRaw connects a rawEngine to the agent at sock and registers
// memfds of layout l.
func registerRaw(t *testing.T, sock string, l Layout) *rawEngine {
	p, err := compile(l, false)
	require.NoError(t, err)
	c, err := net.Dial("unix", sock)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	e := &rawEngine{t: t, c: c.(*net.UnixConn), r: bufio.NewReader(c)}
	e.send(Request{Op: OpHello, Version: Version})
	e.next()
	kfd, _ := memfd(t, p.kvBytes())
	mfd, _ := memfd(t, p.mambaBytes())
	e.send(Request{Op: OpRegister, Layout: &l, KVBytes: p.kvBytes(), MambaBytes: p.mambaBytes()}, kfd, mfd)
	rep := e.next()
	require.Empty(t, rep.Code, rep.Msg)
	return e
}

// send writes q with the next id, which it returns.
func (e *rawEngine) send(q Request, fds ...int) uint64 {
	e.id++
	q.ID = e.id
	body, err := msgpack.Marshal(q)
	require.NoError(e.t, err)
	frame := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
	_, _, err = e.c.WriteMsgUnix(append(frame, body...), unix.UnixRights(fds...), nil)
	require.NoError(e.t, err)
	return e.id
}

// next reads the next reply or event.
func (e *rawEngine) next() Reply {
	body, err := readFrame(e.r)
	require.NoError(e.t, err)
	rep, err := decodeReply(body)
	require.NoError(e.t, err)
	return rep
}

func memfd(t testing.TB, n int64) (int, []byte) {
	t.Helper()
	fd, err := unix.MemfdCreate("test", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	require.NoError(t, err)
	require.NoError(t, unix.Ftruncate(fd, n))
	b, err := unix.Mmap(fd, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	t.Cleanup(func() { unix.Munmap(b); unix.Close(fd) })
	return fd, b
}

func startAgent(t testing.TB, name string, ts ...rdma.Transport) string {
	sock, _ := startAgentA(t, name, ts...)
	return sock
}

func startAgentA(t testing.TB, name string, ts ...rdma.Transport) (string, *Agent) {
	return startAgentNATS(t, nil, name, ts...)
}

func startAgentNATS(t testing.TB, nc *nats.Conn, name string, ts ...rdma.Transport) (string, *Agent) {
	t.Helper()
	sock, a, _ := serveAgent(t, Config{Name: name, Transports: ts}, nc)
	return sock, a
}

// serveAgent starts an agent with cfg (a socket in a temporary directory
// unless cfg names one; no logs) and serves it until stop, or the test's
// end; stop checks that Serve returned no error.
func serveAgent(t testing.TB, cfg Config, nc *nats.Conn) (sock string, a *Agent, stop func()) {
	t.Helper()
	if cfg.Socket == "" {
		cfg.Socket = filepath.Join(t.TempDir(), "a", cfg.Name+".sock")
	}
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	a, err := New(cfg, nc)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			require.NoError(t, <-done, cfg.Name)
		})
	}
	t.Cleanup(stop)
	return cfg.Socket, a, stop
}

func register(t testing.TB, sock string, l Layout) *engine {
	t.Helper()
	p, err := compile(l, false)
	require.NoError(t, err)
	ctx := context.Background()
	c, err := Dial(ctx, sock)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	kfd, kv := memfd(t, p.kvBytes())
	mfd, mam := memfd(t, p.mambaBytes())
	rep, err := c.Register(ctx, l, kfd, p.kvBytes(), mfd, p.mambaBytes())
	require.NoError(t, err)
	require.Equal(t, p.fingerprint, rep.Fingerprint)
	fill(kv, 1)
	fill(mam, 2)
	return &engine{c: c, kv: kv, mam: mam, p: p}
}

func fill(b []byte, seed uint64) {
	r := rand.New(rand.NewPCG(seed, 7))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
}

func (e *engine) block(b int) []byte {
	n := int(e.p.kv.BlockBytes())
	return e.kv[b*n : (b+1)*n]
}

func (e *engine) row(r int) []byte {
	n := int(e.p.mamba.RowBytes())
	return e.mam[r*n : (r+1)*n]
}

// ctxT bounds a test's calls: a hang fails the test instead of the run.
// Generous, as the largest tests take seconds under -race on 2 cores.
func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func event(t *testing.T, e *engine, kind string) Reply {
	t.Helper()
	pair := map[string]string{EvSendDone: EvSendFailed, EvSendFailed: EvSendDone, EvGrantDone: EvGrantFailed, EvGrantFailed: EvGrantDone}
	ev, err := e.c.WaitEvent(ctxT(t), func(r Reply) bool { return r.Ev == kind || r.Ev == pair[kind] })
	require.NoError(t, err)
	require.Equal(t, kind, ev.Ev, "%s: %s", ev.Code, ev.Msg)
	return ev
}

func TestSendLandsAtNamedBlocks(t *testing.T) {
	for _, tr := range []rdma.Transport{rdma.TransportSHM, rdma.TransportTCP} {
		t.Run(string(tr), func(t *testing.T) {
			a := register(t, startAgent(t, "a", tr), tinyLayout())
			b := register(t, startAgent(t, "b", tr), tinyLayout())
			ctx := ctxT(t)
			g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 7, Blocks: []int{9, 3, 20}, Row: Row(1)}, nil)
			require.NoError(t, err)
			before := bytes.Clone(b.kv)
			_, err = a.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{0, 1, 2}, Row: Row(4)}, nil)
			require.NoError(t, err)
			ev := event(t, a, EvSendDone)
			require.EqualValues(t, 7, ev.RequestID)
			gev := event(t, b, EvGrantDone)
			require.Equal(t, g.Grant, gev.Grant)
			require.Equal(t, a.block(0), b.block(9))
			require.Equal(t, a.block(1), b.block(3))
			require.Equal(t, a.block(2), b.block(20))
			require.Equal(t, a.row(4), b.row(1))
			require.Equal(t, before[:3*len(a.block(0))], b.kv[:3*len(a.block(0))], "block 0..2 untouched")
		})
	}
}

func TestLayerByLayer(t *testing.T) {
	a := register(t, startAgent(t, "a", rdma.TransportSHM), tinyLayout())
	b := register(t, startAgent(t, "b", rdma.TransportSHM), tinyLayout())
	ctx := ctxT(t)
	g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 8, Blocks: []int{5, 6}, Row: Row(0)}, nil)
	require.NoError(t, err)
	s, err := a.c.Call(ctx, Request{Op: OpOpenSend, Ticket: g.Ticket, Blocks: []int{10, 11}, Row: Row(2)}, nil)
	require.NoError(t, err)
	for l := range 2 {
		_, err = a.c.Call(ctx, Request{Op: OpSendLayer, Send: s.Send, Kind: "kv", Layer: l}, nil)
		require.NoError(t, err)
		_, err = a.c.Call(ctx, Request{Op: OpSendLayer, Send: s.Send, Kind: "mamba", Layer: l}, nil)
		require.NoError(t, err)
	}
	_, err = a.c.Call(ctx, Request{Op: OpCommit, Send: s.Send}, nil)
	require.NoError(t, err)
	event(t, a, EvSendDone)
	event(t, b, EvGrantDone)
	require.Equal(t, a.block(10), b.block(5))
	require.Equal(t, a.block(11), b.block(6))
	require.Equal(t, a.row(2), b.row(0))
}

func TestReservedRowRefused(t *testing.T) {
	b := register(t, startAgent(t, "b", rdma.TransportSHM), tinyLayout())
	_, err := b.c.Call(ctxT(t), Request{Op: OpGrant, RequestID: 9, Blocks: []int{1}, Row: Row(5)}, nil)
	require.ErrorIs(t, err, ErrReserved)
}

// The data plane refuses the reserved rows too, whatever the agent checks:
// they are forbidden in the registration's Mamba region.
func TestReservedRowForbiddenInDataPlane(t *testing.T) {
	sock, a := startAgentA(t, "b", rdma.TransportSHM)
	b := register(t, sock, tinyLayout())
	a.mu.Lock()
	s := a.latest
	a.mu.Unlock()
	rb := uint64(b.p.mamba.RowBytes())
	require.Equal(t, []rdma.Extent{{Region: s.bufs[1].ID(), Offset: 5 * rb, Length: rb}}, s.bufs[1].Forbidden())
	_, err := s.eng.OpenGrant(rdma.GrantSpec{RequestID: 1, Extents: []rdma.Extent{{Region: s.bufs[1].ID(), Offset: 5*rb + 8, Length: 8}}})
	require.ErrorIs(t, err, rdma.ErrForbidden)
}

func TestRevokeLandsNothing(t *testing.T) {
	for _, tr := range []rdma.Transport{rdma.TransportSHM, rdma.TransportTCP} {
		t.Run(string(tr), func(t *testing.T) {
			a := register(t, startAgent(t, "a", tr), tinyLayout())
			b := register(t, startAgent(t, "b", tr), tinyLayout())
			ctx := ctxT(t)
			g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 10, Blocks: []int{4}, Row: Row(3)}, nil)
			require.NoError(t, err)
			_, err = b.c.Call(ctx, Request{Op: OpRevoke, Grant: g.Grant}, nil)
			require.NoError(t, err)
			canaryKV, canaryRow := bytes.Clone(b.block(4)), bytes.Clone(b.row(3))
			_, err = a.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{0}, Row: Row(0)}, nil)
			require.NoError(t, err)
			ev := event(t, a, EvSendFailed)
			require.Equal(t, "revoked", ev.Code, ev.Msg)
			require.Equal(t, canaryKV, b.block(4))
			require.Equal(t, canaryRow, b.row(3))
			gev := event(t, b, EvGrantFailed)
			require.Equal(t, "revoked", gev.Code)
		})
	}
}

func TestMismatchedPeerRefusedByName(t *testing.T) {
	a := register(t, startAgent(t, "a", rdma.TransportSHM), tinyLayout())
	other := tinyLayout()
	other.Mamba.DState = 32
	b := register(t, startAgent(t, "bee", rdma.TransportSHM), other)
	ctx := ctxT(t)
	g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 11, Blocks: []int{1}, Row: Row(0)}, nil)
	require.NoError(t, err)
	_, err = a.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{1}, Row: Row(0)}, nil)
	require.ErrorIs(t, err, ErrLayoutMismatch)
	require.Contains(t, err.Error(), `agent "bee"`)
}

func TestEngineGoneRevokesAndUnmaps(t *testing.T) {
	sock := startAgent(t, "b", rdma.TransportSHM)
	b := register(t, sock, tinyLayout())
	ctx := ctxT(t)
	_, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 12, Blocks: []int{1}}, nil)
	require.NoError(t, err)
	maps := func() int {
		m, err := os.ReadFile("/proc/self/maps")
		require.NoError(t, err)
		return bytes.Count(m, []byte("memfd:test"))
	}
	fds := func() int { return memfdFDs(t) }
	require.Equal(t, 4, maps(), "the test's two mappings and the agent's two")
	require.Equal(t, 4, fds(), "the test's two memfds and the agent's duplicates")
	b.c.Close()
	require.Eventually(t, func() bool { return maps() == 2 && fds() == 2 }, 5*time.Second, 10*time.Millisecond,
		"the agent unmapped the engine's memory and closed its descriptors")
	// The engine registers again with the agent it left.
	b2 := register(t, sock, tinyLayout())
	_, err = b2.c.Call(ctx, Request{Op: OpGrant, RequestID: 12, Blocks: []int{1}}, nil)
	require.NoError(t, err)
}

// unregistered is an engine connected to a fresh agent that has not
// registered yet: its client, tiny-hybrid's pools, and their memfds.
func unregistered(t *testing.T) (c *Client, l Layout, p *pools, kfd, mfd int) {
	t.Helper()
	c, err := Dial(ctxT(t), startAgent(t, "b", rdma.TransportSHM))
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	l = tinyLayout()
	p, err = compile(l, false)
	require.NoError(t, err)
	kfd, _ = memfd(t, p.kvBytes())
	mfd, _ = memfd(t, p.mambaBytes())
	return c, l, p, kfd, mfd
}

func TestRegisterRefusesWrongSizes(t *testing.T) {
	c, _, p, kfd, mfd := unregistered(t)
	_, err := c.Register(ctxT(t), tinyLayout(), kfd, p.kvBytes()-1, mfd, p.mambaBytes())
	require.ErrorIs(t, err, ErrInvalidLayout)
	_, err = c.Call(ctxT(t), Request{Op: OpGrant, RequestID: 1, Blocks: []int{1}}, nil)
	require.ErrorIs(t, err, ErrNotRegistered)
}

// TestRegisterExtraDescriptorsRefused: a registration passed more
// descriptors than its memory takes is refused, and none of them is kept:
// the retry's own are the ones it maps (an extra one kept was taken first
// by the retry, mapping the wrong memory as its KV pool).
func TestRegisterExtraDescriptorsRefused(t *testing.T) {
	c, l, p, kfd, mfd := unregistered(t)
	xfd, _ := memfd(t, p.mambaBytes())
	_, err := c.Call(ctxT(t), Request{Op: OpRegister, Layout: &l, KVBytes: p.kvBytes(), MambaBytes: p.mambaBytes()}, []int{kfd, mfd, xfd})
	require.ErrorIs(t, err, ErrBadRequest)
	require.ErrorContains(t, err, "3 descriptors passed")
	require.Equal(t, 3, memfdFDs(t), "the test's three memfds, no duplicate kept by the agent")
	// A registration refused for its sizes keeps none either.
	_, err = c.Register(ctxT(t), l, kfd, p.kvBytes()-1, mfd, p.mambaBytes())
	require.ErrorIs(t, err, ErrInvalidLayout)
	require.Equal(t, 3, memfdFDs(t))
	rep, err := c.Register(ctxT(t), l, kfd, p.kvBytes(), mfd, p.mambaBytes())
	require.NoError(t, err)
	require.Equal(t, p.fingerprint, rep.Fingerprint)
}

// TestRegisteredMemoryCannotShrink: the agent seals an engine's memfd
// against shrinking when it maps it: a page past the end of a shrunk file
// would kill the agent (SIGBUS) at its next copy, and a receiver's engine
// would kill the sending agent that maps its memory too.
func TestRegisteredMemoryCannotShrink(t *testing.T) {
	c, l, p, kfd, mfd := unregistered(t)
	require.NoError(t, unix.Ftruncate(kfd, p.kvBytes()), "not sealed before")
	_, err := c.Register(ctxT(t), l, kfd, p.kvBytes(), mfd, p.mambaBytes())
	require.NoError(t, err)
	require.ErrorIs(t, unix.Ftruncate(kfd, p.kvBytes()/2), unix.EPERM)
	require.ErrorIs(t, unix.Ftruncate(mfd, 0), unix.EPERM)
}

// memfdFDs counts this process's descriptors of the tests' memfds.
func memfdFDs(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	n := 0
	for _, e := range ents {
		if l, _ := os.Readlink("/proc/self/fd/" + e.Name()); strings.HasPrefix(l, "/memfd:test") {
			n++
		}
	}
	return n
}

func TestSocketDirMustBePrivate(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.Chmod(dir, 0o755))
	_, err := New(Config{Name: "x", Socket: filepath.Join(dir, "x.sock")}, nil)
	require.True(t, errors.Is(err, ErrUnsafeSocketDir), "%v", err)
	sock := startAgent(t, "y")
	st, err := os.Stat(sock)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
}

// TestTransportsCheckedAtStart: an agent refuses at New the transports its
// build cannot serve, rather than start, say ready and refuse each engine.
func TestTransportsCheckedAtStart(t *testing.T) {
	for _, ts := range [][]rdma.Transport{{"carrier-pigeon"}, {rdma.TransportSHM, "tpc"}} {
		_, err := New(Config{Name: "x", Socket: filepath.Join(t.TempDir(), "s", "x.sock"), Transports: ts}, nil)
		require.ErrorIs(t, err, rdma.ErrUnsupported, "%v", ts)
		require.Equal(t, "unsupported", Code(err))
	}
}

// TestSocketIsTheRunningAgents: a second agent of the same name is refused
// while the first holds the socket, even when its file is gone; a stale
// socket file is replaced; and an agent that stops leaves alone a socket
// that replaced its file meanwhile.
func TestSocketIsTheRunningAgents(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s", "x.sock")
	first, err := New(Config{Name: "x", Socket: sock}, nil)
	require.NoError(t, err)
	go first.Serve(context.Background())
	_, err = New(Config{Name: "x", Socket: sock}, nil)
	require.ErrorIs(t, err, ErrSocketInUse)

	// The first agent's file is replaced by another socket: the first is
	// still refused a successor (it holds the lock), and its Close must
	// not remove the file it no longer owns.
	require.NoError(t, os.Remove(sock))
	_, err = New(Config{Name: "x", Socket: sock}, nil)
	require.ErrorIs(t, err, ErrSocketInUse)
	other, err := net.Listen("unix", sock)
	require.NoError(t, err)
	defer other.Close()
	require.NoError(t, first.Close())
	_, err = os.Lstat(sock)
	require.NoError(t, err, "the first agent removed a socket not its own")
	other.Close()

	// Stopped, it lets the path go: a stale file is replaced.
	next, err := New(Config{Name: "x", Socket: sock}, nil)
	require.NoError(t, err)
	go next.Serve(context.Background())
	c, err := Dial(ctxT(t), sock)
	require.NoError(t, err)
	c.Close()
	require.NoError(t, next.Close())
}

// Two agents of one name starting at once: one gets the socket, the other
// is refused (a check by dialing alone lets both through, and the later
// rename takes the earlier's path).
func TestSocketTakenOnce(t *testing.T) {
	for i := range 20 {
		sock := filepath.Join(t.TempDir(), "s", "x.sock")
		var wg sync.WaitGroup
		agents := make([]*Agent, 2)
		errs := make([]error, 2)
		for j := range agents {
			wg.Add(1)
			go func() {
				defer wg.Done()
				agents[j], errs[j] = New(Config{Name: "x", Socket: sock}, nil)
			}()
		}
		wg.Wait()
		ok := 0
		for j, a := range agents {
			if errs[j] == nil {
				ok++
				require.NoError(t, a.Close())
			} else {
				require.ErrorIs(t, errs[j], ErrSocketInUse, "round %d", i)
			}
		}
		require.Equal(t, 1, ok, "round %d: both agents took the socket", i)
	}
}

// TestOfferOverNATS: the receiving engine has its agent hand the ticket to
// the sender's agent over NATS, which passes it to its engine as an event;
// an offer to an agent nobody runs fails by name.
func TestOfferOverNATS(t *testing.T) {
	srv := natstest.Run(t)
	sockA, _ := startAgentNATS(t, natstest.Connect(t, srv), "pre", rdma.TransportSHM)
	sockB, _ := startAgentNATS(t, natstest.Connect(t, srv), "dec", rdma.TransportSHM)
	a, b := register(t, sockA, tinyLayout()), register(t, sockB, tinyLayout())
	ctx := ctxT(t)
	g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 31, Blocks: []int{7}, Row: Row(2)}, nil)
	require.NoError(t, err)
	_, err = b.c.Call(ctx, Request{Op: OpOffer, Ticket: g.Ticket, To: "pre"}, nil)
	require.NoError(t, err)
	ev := event(t, a, EvTicket)
	require.EqualValues(t, 31, ev.RequestID)
	require.Equal(t, "dec", ev.Agent)
	_, err = a.c.Call(ctx, Request{Op: OpSend, Ticket: ev.Ticket, Blocks: []int{1}, Row: Row(0)}, nil)
	require.NoError(t, err)
	event(t, a, EvSendDone)
	event(t, b, EvGrantDone)
	require.Equal(t, a.block(1), b.block(7))
	require.Equal(t, a.row(0), b.row(2))

	_, err = b.c.Call(ctx, Request{Op: OpOffer, Ticket: g.Ticket, To: "nobody"}, nil)
	require.ErrorIs(t, err, ErrPeerUnreachable)
	require.Contains(t, err.Error(), `"nobody"`)
	_, err = b.c.Call(ctx, Request{Op: OpOffer, Ticket: g.Ticket, To: "pre.*"}, nil)
	require.ErrorIs(t, err, ErrBadRequest, "a name that is no subject token")

	// An agent of another namespace on the same NATS server is not reached.
	sock, _, _ := serveAgent(t, Config{Name: "solo", Namespace: "other", Transports: []rdma.Transport{rdma.TransportSHM}}, natstest.Connect(t, srv))
	register(t, sock, tinyLayout())
	_, err = b.c.Call(ctx, Request{Op: OpOffer, Ticket: g.Ticket, To: "solo"}, nil)
	require.ErrorIs(t, err, ErrPeerUnreachable, "an agent of namespace other")
}

// TestOfferHoldsNothingBehindIt: an offer to an agent that never answers
// takes up to offerTimeout; the engine's revoke, sent after it, is
// answered while the offer still waits, and the offer then fails by name.
func TestOfferHoldsNothingBehindIt(t *testing.T) {
	srv := natstest.Run(t)
	sockB, _ := startAgentNATS(t, natstest.Connect(t, srv), "dec", rdma.TransportSHM)
	b := registerRaw(t, sockB, tinyLayout())
	silent := natstest.Connect(t, srv)
	_, err := silent.Subscribe(OfferSubject("default", "silent"), func(*nats.Msg) {})
	require.NoError(t, err)
	require.NoError(t, silent.Flush())
	b.send(Request{Op: OpGrant, RequestID: 1, Blocks: []int{7}, Row: Row(2)})
	g := b.next()
	require.Empty(t, g.Code, g.Msg)
	offer := b.send(Request{Op: OpOffer, Ticket: g.Ticket, To: "silent"})
	revoke := b.send(Request{Op: OpRevoke, Grant: g.Grant})
	rep := b.next()
	require.Equal(t, revoke, rep.Re, "the revoke is answered first, not %+v", rep)
	require.Empty(t, rep.Code, rep.Msg)
	require.Equal(t, EvGrantFailed, b.next().Ev)
	rep = b.next()
	require.Equal(t, offer, rep.Re)
	require.Equal(t, "peer_unreachable", rep.Code, rep.Msg)
}

// TestCancelSend: a layer-by-layer send cancelled before its commit ends
// with send_failed; the grant, never committed, fails.
func TestCancelSend(t *testing.T) {
	a := register(t, startAgent(t, "a", rdma.TransportSHM), tinyLayout())
	b := register(t, startAgent(t, "b", rdma.TransportSHM), tinyLayout())
	ctx := ctxT(t)
	g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 40, Blocks: []int{2}, Row: Row(0), DeadlineMS: 300}, nil)
	require.NoError(t, err)
	s, err := a.c.Call(ctx, Request{Op: OpOpenSend, Ticket: g.Ticket, Blocks: []int{3}, Row: Row(1)}, nil)
	require.NoError(t, err)
	_, err = a.c.Call(ctx, Request{Op: OpSendLayer, Send: s.Send, Kind: "kv", Layer: 0}, nil)
	require.NoError(t, err)
	_, err = a.c.Call(ctx, Request{Op: OpCancel, Send: s.Send}, nil)
	require.NoError(t, err)
	ev := event(t, a, EvSendFailed)
	require.Equal(t, "cancelled", ev.Code, ev.Msg)
	_, err = a.c.Call(ctx, Request{Op: OpCommit, Send: s.Send}, nil)
	require.ErrorIs(t, err, ErrUnknown, "no commit after a cancel")
	// The writer aborts the grant when the cancel cut a write in flight;
	// else the grant, never committed, reaches its deadline.
	gev := event(t, b, EvGrantFailed)
	require.Contains(t, []string{"deadline", "peer_closed"}, gev.Code, gev.Msg)
}

func TestHelloRefusesOtherVersions(t *testing.T) {
	sock := startAgent(t, "a", rdma.TransportSHM)
	c, err := Dial(ctxT(t), sock)
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Call(ctxT(t), Request{Op: OpHello, Version: Version + 1}, nil)
	require.ErrorIs(t, err, ErrBadRequest)
	require.Contains(t, err.Error(), "version")
}

// TestSendWait: a whole send with Wait answers once it ended, in its reply
// (no event), with the refusal as the reply's error.
func TestSendWait(t *testing.T) {
	a := register(t, startAgent(t, "a", rdma.TransportSHM), tinyLayout())
	b := register(t, startAgent(t, "b", rdma.TransportSHM), tinyLayout())
	ctx := ctxT(t)
	g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 80, Blocks: []int{4}, Row: Row(2)}, nil)
	require.NoError(t, err)
	rep, err := a.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{8}, Row: Row(3), Wait: true}, nil)
	require.NoError(t, err)
	require.EqualValues(t, b.p.kv.BlockBytes()+b.p.mamba.RowBytes(), rep.Bytes)
	require.Equal(t, a.block(8), b.block(4), "landed when the reply came")
	event(t, b, EvGrantDone)

	g, err = b.c.Call(ctx, Request{Op: OpGrant, RequestID: 81, Blocks: []int{5}}, nil)
	require.NoError(t, err)
	_, err = b.c.Call(ctx, Request{Op: OpRevoke, Grant: g.Grant}, nil)
	require.NoError(t, err)
	_, err = a.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{8}, Wait: true}, nil)
	require.ErrorIs(t, err, rdma.ErrRevoked)
	select {
	case ev := <-a.c.Events():
		t.Fatalf("an event for a send with Wait: %+v", ev)
	default:
	}
}

// TestRegistryListsPeers: with NATS each agent joins the namespace's
// registry; an engine lists the other agents with their engines'
// fingerprints (empty before one registers and after it goes), and an
// agent that stops leaves the list.
func TestRegistryListsPeers(t *testing.T) {
	srv := natstest.Run(t)
	// A heartbeat every 10 s: the changes below are seen within 5 s only
	// if the agent publishes them when they happen.
	start := func(name string) (string, func()) {
		sock, _, stop := serveAgent(t, Config{Name: name, Transports: []rdma.Transport{rdma.TransportSHM},
			Registry: transfer.RegistryConfig{TTL: 30 * time.Second}}, natstest.Connect(t, srv))
		return sock, stop
	}
	sockA, _ := start("pre")
	sockB, stopB := start("dec")

	a := register(t, sockA, tinyLayout())
	ctx := ctxT(t)
	peers := func() []Peer {
		rep, err := a.c.Call(ctx, Request{Op: OpPeers}, nil)
		require.NoError(t, err)
		return rep.Peers
	}
	require.Eventually(t, func() bool { p := peers(); return len(p) == 1 && p[0].Name == "dec" && p[0].Fingerprint == "" },
		5*time.Second, 10*time.Millisecond, "the other agent, with no engine yet: %+v", peers())

	e := register(t, sockB, tinyLayout())
	require.Eventually(t, func() bool { p := peers(); return len(p) == 1 && p[0].Fingerprint == e.p.fingerprint },
		5*time.Second, 10*time.Millisecond, "the registration's fingerprint: %+v", peers())
	p := peers()[0]
	require.Equal(t, []string{"shm"}, p.Transports)
	require.True(t, strings.HasPrefix(p.AgentID, "dec#"), p.AgentID)

	e.c.Close() // the engine goes
	require.Eventually(t, func() bool { p := peers(); return len(p) == 1 && p[0].Fingerprint == "" },
		5*time.Second, 10*time.Millisecond, "no registration any more: %+v", peers())

	stopB()
	require.Eventually(t, func() bool { return len(peers()) == 0 }, 5*time.Second, 10*time.Millisecond,
		"a stopped agent leaves the registry: %+v", peers())
}

// TestConfigRefusesBadNames: an agent's name and namespace name NATS
// subjects and registry keys.
func TestConfigRefusesBadNames(t *testing.T) {
	for _, c := range []Config{{Name: "a.b"}, {Name: "a b"}, {Name: "ok", Namespace: "x.y"}} {
		c.Socket = filepath.Join(t.TempDir(), "s", "a.sock")
		_, err := New(c, nil)
		require.ErrorIs(t, err, ErrBadRequest, "%+v", c)
	}
}

// rowOff is the arena offset of row r of a layout without planes.
func (p *pools) rowOff(r int) uint64 { return uint64(r) * uint64(p.mamba.RowBytes()) }

// TestLargeRequestFrame: a request larger than the socket's buffer (5 MB
// of block names) reaches the agent whole and is answered; a client that
// wrote only what the first write took left the agent waiting for the
// rest, and the call hanging to its deadline.
func TestLargeRequestFrame(t *testing.T) {
	e := register(t, startAgent(t, "a", rdma.TransportSHM), tinyLayout())
	blocks := make([]int, 1<<20)
	for i := range blocks {
		blocks[i] = 1 << 30
	}
	_, err := e.c.Call(ctxT(t), Request{Op: OpGrant, RequestID: 1, Blocks: blocks}, nil)
	require.ErrorIs(t, err, ErrBadRequest)
}

// engineStats sums the data-path counters of a's registrations.
func engineStats(a *Agent) rdma.Stats {
	a.mu.Lock()
	defer a.mu.Unlock()
	var st rdma.Stats
	for s := range a.sessions {
		s.mu.Lock()
		eng := s.eng
		s.mu.Unlock()
		if eng != nil {
			x := eng.Stats()
			st.BytesPulled += x.BytesPulled
			st.BytesStaged += x.BytesStaged
			st.GrantsOpen += x.GrantsOpen
		}
	}
	return st
}
