package agent

import (
	"context"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/reshard"
)

// shardUnit returns shard r's copy of a whole-model (TP 1) unit under a
// plan 1 → tp.
func shardUnit(t *testing.T, l reshard.Layout, tp, r int, whole []byte) []byte {
	pl, err := reshard.New(l, 1, tp)
	require.NoError(t, err)
	out := make([]byte, pl.DstBytes)
	reshard.Apply(out, whole, pl.Copies(0, r))
	return out
}

// tp2Senders starts two TP-2 block-major engines, each with its own agent
// over tr, holding their shards of two whole-model blocks (at blocks) and
// a row (at row), filled from seed; it returns them and the whole model's
// units: the two blocks, then the row.
func tp2Senders(t *testing.T, tr rdma.Transport, blocks [2]int, row int, seed uint64) ([2]*engine, [][]byte) {
	p, err := compile(tinyLayout(), false)
	require.NoError(t, err)
	var senders [2]*engine
	for r := range 2 {
		l := tinyLayout()
		l.TP = TP{Rank: r, Size: 2}
		senders[r] = register(t, startAgent(t, "pre"+string(rune('0'+r)), tr), l)
	}
	kvL, mL := reshard.KV(p.wholeKV), reshard.Mamba(p.wholeMamba)
	whole := [][]byte{make([]byte, p.kv.BlockBytes()), make([]byte, p.kv.BlockBytes()), make([]byte, p.mamba.RowBytes())}
	for i, w := range whole {
		fill(w, seed+uint64(i))
	}
	for r, s := range senders {
		copy(s.block(blocks[0]), shardUnit(t, kvL, 2, r, whole[0]))
		copy(s.block(blocks[1]), shardUnit(t, kvL, 2, r, whole[1]))
		copy(s.row(row), shardUnit(t, mL, 2, r, whole[2]))
	}
	return senders, whole
}

// layerCall is one layer a layer-by-layer send sends: "kv" or "mamba".
type layerCall struct {
	kind  string
	layer int
}

// sendInto writes blocks and row of s into ticket, whole (order nil) or
// layer by layer in order then commit, and waits for send_done.
func sendInto(t *testing.T, ctx context.Context, s *engine, ticket []byte, blocks []int, row int, order []layerCall) {
	t.Helper()
	op := OpSend
	if order != nil {
		op = OpOpenSend
	}
	rep, err := s.c.Call(ctx, Request{Op: op, Ticket: ticket, Blocks: blocks, Row: Row(row)}, nil)
	require.NoError(t, err)
	if order != nil {
		for _, x := range order {
			_, err = s.c.Call(ctx, Request{Op: OpSendLayer, Send: rep.Send, Kind: x.kind, Layer: x.layer}, nil)
			require.NoError(t, err)
		}
		_, err = s.c.Call(ctx, Request{Op: OpCommit, Send: rep.Send}, nil)
		require.NoError(t, err)
	}
	event(t, s, EvSendDone)
}

// TestReshardTwoToOne: two TP-2 engines, each with its own agent, write
// one request into a TP-1 engine's grant, whole and layer by layer; the
// receiver's blocks and row are the whole model's, byte for byte.
func TestReshardTwoToOne(t *testing.T) {
	for _, layers := range []bool{false, true} {
		name := map[bool]string{false: "whole", true: "layer by layer"}[layers]
		t.Run(name, func(t *testing.T) {
			rl := tinyLayout()
			recv := register(t, startAgent(t, "dec", rdma.TransportSHM), rl)
			senders, whole := tp2Senders(t, rdma.TransportSHM, [2]int{0, 1}, 4, 10)
			p := recv.p
			ctx := ctxT(t)
			g, err := recv.c.Call(ctx, Request{Op: OpGrant, RequestID: 21, Blocks: []int{9, 3}, Row: Row(1), FromTP: 2}, nil)
			require.NoError(t, err)
			var order []layerCall
			if layers {
				order = []layerCall{{"kv", 0}, {"mamba", 0}, {"kv", 1}, {"mamba", 1}}
			}
			for _, s := range senders {
				sendInto(t, ctx, s, g.Ticket, []int{0, 1}, 4, order)
			}
			ev := event(t, recv, EvGrantDone)
			require.EqualValues(t, 2*p.kv.BlockBytes()+p.mamba.RowBytes(), ev.Bytes)
			require.Equal(t, whole[0], recv.block(9))
			require.Equal(t, whole[1], recv.block(3))
			require.Equal(t, whole[2], recv.row(1))
		})
	}
}

// TestReshardOneToTwo: one TP-1 engine writes one request into two TP-2
// engines' grants; each gets its shard of the whole model's bytes.
func TestReshardOneToTwo(t *testing.T) {
	send := register(t, startAgent(t, "pre", rdma.TransportTCP), tinyLayout())
	ctx := ctxT(t)
	p := send.p
	for r := range 2 {
		l := tinyLayout()
		l.TP = TP{Rank: r, Size: 2}
		recv := register(t, startAgent(t, "dec"+string(rune('0'+r)), rdma.TransportTCP), l)
		g, err := recv.c.Call(ctx, Request{Op: OpGrant, RequestID: 22, Blocks: []int{5}, Row: Row(0), FromTP: 1}, nil)
		require.NoError(t, err)
		_, err = send.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{2}, Row: Row(3)}, nil)
		require.NoError(t, err)
		event(t, send, EvSendDone)
		event(t, recv, EvGrantDone)
		require.Equal(t, shardUnit(t, reshard.KV(p.wholeKV), 2, r, send.block(2)), recv.block(5))
		require.Equal(t, shardUnit(t, reshard.Mamba(p.wholeMamba), 2, r, send.row(3)), recv.row(0))
	}
}

// TestReshardRefusesWrongTP: a ticket granted to TP-2 senders is refused
// by a TP-1 sender, by name, before a byte moves.
func TestReshardRefusesWrongTP(t *testing.T) {
	send := register(t, startAgent(t, "pre", rdma.TransportSHM), tinyLayout())
	recv := register(t, startAgent(t, "dec", rdma.TransportSHM), tinyLayout())
	ctx := ctxT(t)
	g, err := recv.c.Call(ctx, Request{Op: OpGrant, RequestID: 23, Blocks: []int{5}, FromTP: 2}, nil)
	require.NoError(t, err)
	_, err = send.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{2}}, nil)
	require.ErrorIs(t, err, ErrLayoutMismatch)
	require.Contains(t, err.Error(), `agent "dec" granted to TP-2 senders`)
}

// TestCheckNames: a block named twice is refused whether the send names a
// few blocks (compared with each other) or many (marked in a bitset), as
// are blocks outside the pool and reserved rows.
func TestCheckNames(t *testing.T) {
	l := tinyLayout()
	l.KV.Blocks = 200
	p, err := compile(l, false)
	require.NoError(t, err)
	many := make([]int, 100)
	for i := range many {
		many[i] = 199 - i
	}
	for _, tc := range []struct {
		name   string
		blocks []int
		row    int
		want   error
	}{
		{"few", []int{3, 1, 2}, 0, nil},
		{"few, one twice", []int{3, 1, 3}, 0, ErrBadRequest},
		{"many", many, -1, nil},
		{"many, one twice", append(slices.Clone(many), 150), -1, ErrBadRequest},
		{"many, the first twice", append(slices.Clone(many), 199), -1, ErrBadRequest},
		{"outside the pool", []int{200}, -1, ErrBadRequest},
		{"negative", []int{-1}, -1, ErrBadRequest},
		{"reserved row", []int{1}, 5, ErrReserved},
		{"nothing", nil, -1, ErrBadRequest},
	} {
		err := p.checkNames(tc.blocks, tc.row)
		if tc.want == nil {
			require.NoError(t, err, tc.name)
		} else {
			require.ErrorIs(t, err, tc.want, tc.name)
		}
	}
}
