package agent

import (
	"encoding/json"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/rdma"
)

// frozenPeer is a tcp data-path address that accepts connections and reads
// what comes, and never answers: a receiving agent that stopped.
func frozenPeer(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			go io.Copy(io.Discard, c)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return ln.Addr().String()
}

// frozenTicket is tk with its descriptor pointing at a frozenPeer: a send
// into it runs until the grant's deadline and sendGrace pass.
func frozenTicket(t *testing.T, tk []byte) []byte {
	var w ticket
	require.NoError(t, msgpack.Unmarshal(tk, &w))
	var d rdma.Descriptor
	require.NoError(t, json.Unmarshal(w.Desc, &d))
	d.TCPAddr = frozenPeer(t)
	var err error
	w.Desc, err = json.Marshal(d)
	require.NoError(t, err)
	forged, err := msgpack.Marshal(w)
	require.NoError(t, err)
	return forged
}

// TestRefusedCommitLeavesSendCancellable: a commit of a whole send is
// refused, and the send can still be cancelled (the refusal once forgot
// it, so that it ran on to its grant's deadline).
func TestRefusedCommitLeavesSendCancellable(t *testing.T) {
	sock, agentA := startAgentA(t, "a", rdma.TransportTCP)
	a := register(t, sock, tinyLayout())
	b := register(t, startAgent(t, "b", rdma.TransportTCP), tinyLayout())
	ctx := ctxT(t)
	g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 62, Blocks: []int{2}, Row: Row(0), DeadlineMS: 60_000}, nil)
	require.NoError(t, err)
	s, err := a.c.Call(ctx, Request{Op: OpSend, Ticket: frozenTicket(t, g.Ticket), Blocks: []int{3}, Row: Row(1)}, nil)
	require.NoError(t, err)
	_, err = a.c.Call(ctx, Request{Op: OpCommit, Send: s.Send}, nil)
	require.ErrorIs(t, err, ErrBadRequest)
	_, err = a.c.Call(ctx, Request{Op: OpCancel, Send: s.Send}, nil)
	require.NoError(t, err)
	ev := event(t, a, EvSendFailed)
	require.Equal(t, s.Send, ev.Send)
	require.Equal(t, "cancelled", ev.Code, ev.Msg)
	require.Zero(t, runningSends(agentA))
}

// TestSendEndsPastDeadline: a send to a receiver that never answers ends
// with code deadline once its grant's deadline and sendGrace have passed,
// not before, and in time.
func TestSendEndsPastDeadline(t *testing.T) {
	sock, agentA := startAgentA(t, "a", rdma.TransportTCP)
	a := register(t, sock, tinyLayout())
	b := register(t, startAgent(t, "b", rdma.TransportTCP), tinyLayout())
	ctx := ctxT(t)
	const deadline = 100 * time.Millisecond
	asked := time.Now() // the receiver sets the deadline after this
	g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 60, Blocks: []int{2}, Row: Row(0), DeadlineMS: deadline.Milliseconds()}, nil)
	require.NoError(t, err)
	granted := time.Now()
	_, err = a.c.Call(ctx, Request{Op: OpSend, Ticket: frozenTicket(t, g.Ticket), Blocks: []int{3}, Row: Row(1), Wait: true}, nil)
	ended := time.Now()
	require.ErrorIs(t, err, rdma.ErrDeadline)
	require.Contains(t, err.Error(), "past the grant's deadline")
	require.GreaterOrEqual(t, ended.Sub(asked), deadline+sendGrace, "ended before the grace")
	require.Less(t, ended.Sub(granted), deadline+sendGrace+sendSweep+2*time.Second, "held past the grace")
	require.Zero(t, runningSends(agentA), "the send's goroutine ended")
}

// TestOpenSendEndsPastDeadline: a layer-by-layer send whose engine never
// commits ends with code deadline once its grant's deadline and sendGrace
// have passed, as an event.
func TestOpenSendEndsPastDeadline(t *testing.T) {
	sock, agentA := startAgentA(t, "a", rdma.TransportSHM)
	a := register(t, sock, tinyLayout())
	b := register(t, startAgent(t, "b", rdma.TransportSHM), tinyLayout())
	ctx := ctxT(t)
	const deadline = 100 * time.Millisecond
	g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 61, Blocks: []int{2}, Row: Row(0), DeadlineMS: deadline.Milliseconds()}, nil)
	require.NoError(t, err)
	s, err := a.c.Call(ctx, Request{Op: OpOpenSend, Ticket: g.Ticket, Blocks: []int{3}, Row: Row(1)}, nil)
	require.NoError(t, err)
	_, err = a.c.Call(ctx, Request{Op: OpSendLayer, Send: s.Send, Kind: "kv", Layer: 0}, nil)
	require.NoError(t, err)
	ev := event(t, a, EvSendFailed)
	require.Equal(t, s.Send, ev.Send)
	require.Equal(t, "deadline", ev.Code, ev.Msg)
	require.Contains(t, ev.Msg, "past the grant's deadline")
	require.Zero(t, runningSends(agentA))
	require.Equal(t, "deadline", event(t, b, EvGrantFailed).Code)
}

// runningSends counts the sends whose goroutines have not ended.
func runningSends(a *Agent) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for s := range a.sessions {
		s.mu.Lock()
		n += len(s.running)
		s.mu.Unlock()
	}
	return n
}

// TestEventsFollowTheirReply: a send that fails at once (the receiver
// serves no transport the sender has) has its event written after the
// reply that named it, read in order off the connection by a raw client.
// Before the event waited for the reply, a round in a few hundred had
// them the other way (three runs of this test in five failed).
func TestEventsFollowTheirReply(t *testing.T) {
	a := registerRaw(t, startAgent(t, "a", rdma.TransportSHM), tinyLayout())
	b := register(t, startAgent(t, "b", rdma.TransportTCP), tinyLayout())
	ctx := ctxT(t)
	for i := range 2000 {
		g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: uint64(100 + i), Blocks: []int{i % 30}, DeadlineMS: 5000}, nil)
		require.NoError(t, err)
		sent := a.send(Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{3}})
		first, second := a.next(), a.next()
		require.Equal(t, sent, first.Re, "round %d: the reply comes first, then %+v", i, first)
		require.Equal(t, EvSendFailed, second.Ev, "round %d", i)
		require.Equal(t, first.Send, second.Send)
		_, err = b.c.Call(ctx, Request{Op: OpRevoke, Grant: g.Grant}, nil)
		require.NoError(t, err)
		require.Equal(t, g.Grant, event(t, b, EvGrantFailed).Grant)
	}
}
