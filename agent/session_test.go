package agent

import (
	"encoding/binary"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/rdma"
)

// sessions counts the connections a holds.
func sessions(a *Agent) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.sessions)
}

// Close returns once the agent let the registration's memory go (revoked
// its grants, waited out the writers still copying into them, unmapped
// it), not when the engine's side of the connection closed: the engine may
// use or register its memory again at once.
func TestCloseWaitsForTheAgent(t *testing.T) {
	sock, a := startAgentA(t, "close-wait", rdma.TransportSHM)
	for range 5 {
		e := register(t, sock, tinyLayout())
		_, err := e.c.Call(ctxT(t), Request{Op: OpGrant, RequestID: 1, Blocks: []int{1, 2}, Row: new(int)}, nil)
		require.NoError(t, err)
		require.Equal(t, 1, sessions(a))
		require.NoError(t, e.c.Close())
		require.Equal(t, 0, sessions(a), "Close returned before the agent ended the registration")
	}
}

// A registration over host memory another connection holds waits for that
// one to end (an engine that re-registers may get there before the agent
// saw its old connection end), and is refused while it stays.
func TestRegisterWaitsForTheSameMemory(t *testing.T) {
	sock, a := startAgentA(t, "same-memory", rdma.TransportSHM)
	l := tinyLayout()
	p, err := compile(l, false)
	require.NoError(t, err)
	kfd, _ := memfd(t, p.kvBytes())
	mfd, _ := memfd(t, p.mambaBytes())
	dial := func() *Client {
		c, err := Dial(ctxT(t), sock)
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		return c
	}
	first := dial()
	_, err = first.Register(ctxT(t), l, kfd, p.kvBytes(), mfd, p.mambaBytes())
	require.NoError(t, err)

	start := time.Now()
	second := dial()
	_, err = second.Register(ctxT(t), l, kfd, p.kvBytes(), mfd, p.mambaBytes())
	require.ErrorIs(t, err, ErrRegistered, "the same memory registered by two live connections")
	require.GreaterOrEqual(t, time.Since(start), reuseWait)

	// The first connection ends while the second registers: the second
	// waits for it, then registers.
	go func() {
		time.Sleep(300 * time.Millisecond)
		first.c.Close() // the engine's side only: no wait for the agent
	}()
	_, err = second.Register(ctxT(t), l, kfd, p.kvBytes(), mfd, p.mambaBytes())
	require.NoError(t, err)
	require.Equal(t, 1, sessions(a))
}

// Two engines registered on one agent: the later one leaving leaves the
// agent describing (and taking offers for) the one still registered.
func TestLatestFallsBackToALiveRegistration(t *testing.T) {
	sock, a := startAgentA(t, "latest", rdma.TransportSHM)
	e1 := register(t, sock, tinyLayout())
	id1 := a.describe().AgentID
	e2 := register(t, sock, tinyLayout())
	id2 := a.describe().AgentID
	require.NotEqual(t, id1, id2)
	require.NoError(t, e2.c.Close())
	require.Equal(t, id1, a.describe().AgentID, "the agent describes no registration while engine 1 is registered")
	_, err := e1.c.Call(ctxT(t), Request{Op: OpGrant, RequestID: 1, Blocks: []int{1}}, nil)
	require.NoError(t, err)
	require.NoError(t, e1.c.Close())
	require.Empty(t, a.describe().AgentID)
}

// A request that frames well but does not decode (a field of the wrong
// type) is answered under its id as a bad request, and the connection goes
// on; one without an id ends it.
func TestBadRequestAnsweredUnderItsID(t *testing.T) {
	sock := startAgent(t, "bad-request", rdma.TransportSHM)
	e := registerRaw(t, sock, tinyLayout())
	body, err := msgpack.Marshal(map[string]any{"op": "grant", "id": 41, "request_id": "seven"})
	require.NoError(t, err)
	_, err = e.c.Write(append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...))
	require.NoError(t, err)
	rep := e.next()
	require.Equal(t, uint64(41), rep.Re)
	require.Equal(t, "bad_request", rep.Code, rep.Msg)

	id := e.send(Request{Op: OpGrant, RequestID: 1, Blocks: []int{1}})
	rep = e.next()
	require.Equal(t, id, rep.Re)
	require.Empty(t, rep.Code, rep.Msg)

	body, err = msgpack.Marshal(map[string]any{"op": 7})
	require.NoError(t, err)
	_, err = e.c.Write(append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...))
	require.NoError(t, err)
	for { // the grant's event may come first
		b, err := readFrame(e.r)
		if err != nil {
			break
		}
		rep, err := decodeReply(b)
		if errors.Is(err, ErrBadRequest) {
			continue // the answer without an id
		}
		require.NoError(t, err)
		require.NotEmpty(t, rep.Ev)
	}
}

// Two connections registering the same memory at once: one registers, the
// other waits for it and is refused while it stays (a check that reads the
// others' registrations would let both through, neither registered yet).
func TestSameMemoryRegisteredOnce(t *testing.T) {
	sock, _ := startAgentA(t, "same-memory-race", rdma.TransportSHM)
	l := tinyLayout()
	p, err := compile(l, false)
	require.NoError(t, err)
	kfd, _ := memfd(t, p.kvBytes())
	mfd, _ := memfd(t, p.mambaBytes())
	errs := make(chan error, 2)
	for range 2 {
		c, err := Dial(ctxT(t), sock)
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		go func() {
			_, err := c.Register(ctxT(t), l, kfd, p.kvBytes(), mfd, p.mambaBytes())
			errs <- err
		}()
	}
	first, second := <-errs, <-errs
	if first != nil {
		first, second = second, first
	}
	require.NoError(t, first)
	require.ErrorIs(t, second, ErrRegistered)
}

// Close confirms the release of the memory only when the agent ended the
// connection after Close began: an agent that stopped (or died, or sent
// what is not its frame) first leaves it unconfirmed.
func TestCloseUnconfirmedWhenTheAgentLeftFirst(t *testing.T) {
	sock, a := startAgentA(t, "left-first", rdma.TransportSHM)
	e := register(t, sock, tinyLayout())
	require.NoError(t, a.Close())
	select {
	case <-e.c.done: // the reader saw the agent's end
	case <-time.After(10 * time.Second):
		t.Fatal("the client did not see the agent stop")
	}
	require.ErrorIs(t, e.c.Close(), ErrClosed)

	sock = startAgent(t, "left-after", rdma.TransportSHM)
	e = register(t, sock, tinyLayout())
	require.NoError(t, e.c.Close())
}
