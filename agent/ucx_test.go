//go:build ucx

package agent

// The agent over UCX, in builds with -tags ucx where UCX is installed
// (scripts/install-ucx): UCX_TLS=tcp go test -tags ucx -run UCX ./agent/

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/rdma"
)

func TestUCXSendLayersAndRevoke(t *testing.T) {
	a := register(t, startAgent(t, "a", rdma.TransportUCX), tinyLayout())
	b := register(t, startAgent(t, "b", rdma.TransportUCX), tinyLayout())
	ctx := ctxT(t)

	g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 70, Blocks: []int{9, 3}, Row: Row(1)}, nil)
	require.NoError(t, err)
	_, err = a.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{0, 1}, Row: Row(4)}, nil)
	require.NoError(t, err)
	event(t, a, EvSendDone)
	event(t, b, EvGrantDone)
	require.Equal(t, a.block(0), b.block(9))
	require.Equal(t, a.block(1), b.block(3))
	require.Equal(t, a.row(4), b.row(1))

	g, err = b.c.Call(ctx, Request{Op: OpGrant, RequestID: 71, Blocks: []int{20}, Row: Row(2)}, nil)
	require.NoError(t, err)
	s, err := a.c.Call(ctx, Request{Op: OpOpenSend, Ticket: g.Ticket, Blocks: []int{5}, Row: Row(3)}, nil)
	require.NoError(t, err)
	for l := range 2 {
		_, err = a.c.Call(ctx, Request{Op: OpSendLayer, Send: s.Send, Kind: "kv", Layer: l}, nil)
		require.NoError(t, err)
	}
	_, err = a.c.Call(ctx, Request{Op: OpCommit, Send: s.Send}, nil)
	require.NoError(t, err)
	event(t, a, EvSendDone)
	event(t, b, EvGrantDone)
	require.Equal(t, a.block(5), b.block(20))
	require.Equal(t, a.row(3), b.row(2))

	g, err = b.c.Call(ctx, Request{Op: OpGrant, RequestID: 72, Blocks: []int{30}, Row: Row(0)}, nil)
	require.NoError(t, err)
	_, err = b.c.Call(ctx, Request{Op: OpRevoke, Grant: g.Grant}, nil)
	require.NoError(t, err)
	canary := bytes.Clone(b.block(30))
	_, err = a.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{6}, Row: Row(0)}, nil)
	require.NoError(t, err)
	ev := event(t, a, EvSendFailed)
	require.Equal(t, "revoked", ev.Code, ev.Msg)
	require.Equal(t, canary, b.block(30))
}
