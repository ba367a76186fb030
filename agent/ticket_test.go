package agent

import (
	"bufio"
	"bytes"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/rdma"
)

// TestFoldProperty: extents folded in groups unfold to the same list,
// whatever repeats and wherever the repetition stops; groups of a shape
// fold, the first that differs and all after it are listed as they are.
func TestFoldProperty(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 9))
	for round := range 2000 {
		g := 1 + r.IntN(6)
		shape := make([]rdma.Extent, g)
		for i := range shape {
			shape[i] = rdma.Extent{Offset: uint64(r.IntN(1 << 20)), Length: 1 + uint64(r.IntN(4096))}
		}
		groups, like := r.IntN(6), 0
		var es []rdma.Extent
		for k := range groups {
			base := uint64(r.IntN(1 << 30))
			reg := rdma.RegionID(1 + r.IntN(3))
			grp := make([]rdma.Extent, g)
			for i, e := range shape {
				grp[i] = rdma.Extent{Region: reg, Offset: base + e.Offset, Length: e.Length}
			}
			if k == like && r.IntN(5) > 0 {
				like++ // repeats the shape
			} else {
				grp[r.IntN(g)].Length++ // breaks it (or the shape is this one's)
			}
			es = append(es, grp...)
		}
		for range r.IntN(4) {
			es = append(es, rdma.Extent{Region: rdma.RegionID(r.IntN(4)), Offset: uint64(r.IntN(1 << 30)), Length: uint64(1 + r.IntN(99))})
		}
		w, folded := toWire(rdma.Ticket{Token: [16]byte{1}, Extents: es}, g)
		back, err := w.ticket(len(es))
		require.NoError(t, err, "round %d", round)
		require.True(t, slices.Equal(es, back.Extents), "round %d: groups of %d: %v unfolded to %v", round, g, es, back.Extents)
		if like >= 2 {
			require.True(t, folded, "round %d: %d groups alike", round, like)
			require.GreaterOrEqual(t, len(w.Bases)/2, like, "round %d", round)
		}
		_, err = w.ticket(len(es) - 1)
		require.ErrorIs(t, err, ErrBadTicket, "one extent more than allowed")
	}
}

// TestFoldedTicketRefused: a folded ticket that claims more extents than
// the send can need is refused before room is made for them, and one whose
// offsets overflow or whose regions do not fit is refused by name.
func TestFoldedTicketRefused(t *testing.T) {
	token := make([]byte, 16)
	pairs := func(n int, a, b uint64) words {
		w := make(words, 0, 2*n)
		for range n {
			w = append(w, a, b)
		}
		return w
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := wireTicket{Token: token, Shape: pairs(1024, 0, 8), Bases: pairs(1024, 1, 0)}.ticket(4096)
	runtime.ReadMemStats(&after)
	require.ErrorIs(t, err, ErrBadTicket)
	require.Contains(t, err.Error(), "1048576 extents")
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(1<<20), "room made for 2^20 extents")

	for name, w := range map[string]wireTicket{
		"overflow":     {Token: token, Shape: words{1 << 63, 8}, Bases: words{1, 1 << 63}},
		"region":       {Token: token, Shape: words{0, 8}, Bases: words{1 << 32, 0, 1, 0}},
		"odd shape":    {Token: token, Shape: words{0}, Bases: words{1, 0}},
		"bases only":   {Token: token, Bases: words{1, 0}},
		"short token":  {Token: token[:8], Shape: words{0, 8}, Bases: words{1, 0}},
		"tail regions": {Token: token, Extents: words{1 << 33, 0, 8}},
	} {
		_, err := w.ticket(16)
		require.ErrorIs(t, err, ErrBadTicket, name)
	}
}

// TestLargeTicketOffered: a per-layer receiver of a 32-layer model grants
// 3,000 blocks none of whose extents merge within a plane (192,000
// extents, about 1.3 MB listed one by one, past NATS's default 1 MB
// payload); the ticket folds to kilobytes, goes over NATS as an offer,
// and the sender's blocks land where named. The blocks begin at the first
// and end at the last of each plane, and a layer's V plane follows its K
// plane in memory, so a plane's last extent and the next one's first
// would merge into one, and the planes list their blocks alike only if
// each is merged apart.
func TestLargeTicketOffered(t *testing.T) {
	const blocks = 3000
	l := manyLayers(2 * blocks)
	srv := natstest.Run(t)
	sockA, _ := startAgentNATS(t, natstest.Connect(t, srv), "pre", rdma.TransportSHM)
	sockB, _ := startAgentNATS(t, natstest.Connect(t, srv), "dec", rdma.TransportSHM)
	send := register(t, sockA, l)
	pl, size := perLayer(t, l)
	recv := registerPlanes(t, sockB, pl, size)

	dst, src := make([]int, blocks), make([]int, blocks)
	for i := range dst {
		dst[i] = 2 * i // apart: no two of a plane's extents merge
		src[i] = (i * 7) % (2 * blocks)
	}
	dst[blocks-1] = 2*blocks - 1 // the plane's last block
	ctx := ctxT(t)
	g, err := recv.c.Call(ctx, Request{Op: OpGrant, RequestID: 90, Blocks: dst, Row: Row(1)}, nil)
	require.NoError(t, err)
	require.Less(t, len(g.Ticket), 64<<10, "a ticket of %d bytes", len(g.Ticket))
	tk, _, sub, err := decodeTicket(g.Ticket, 0)
	require.NoError(t, err)
	require.Equal(t, ticketFolded, tk.V)
	rt, err := sub.ticket(1 << 20)
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(rt.Extents), 2*l.KV.Layers*blocks)
	listed, _ := toWire(rt, 0)
	lb, err := msgpack.Marshal(listed)
	require.NoError(t, err)
	t.Logf("a ticket of %d bytes for %d extents (%d bytes listed one by one)", len(g.Ticket), len(rt.Extents), len(lb))

	_, err = recv.c.Call(ctx, Request{Op: OpOffer, Ticket: g.Ticket, To: "pre"}, nil)
	require.NoError(t, err)
	ev := event(t, send, EvTicket)
	_, err = send.c.Call(ctx, Request{Op: OpSend, Ticket: ev.Ticket, Blocks: src, Row: Row(0)}, nil)
	require.NoError(t, err)
	event(t, send, EvSendDone)
	event(t, recv, EvGrantDone)
	for i := range dst {
		require.Equal(t, send.block(src[i]), recv.vunit(false, dst[i]), "block %d", dst[i])
	}
	require.Equal(t, send.row(0), recv.vunit(true, 1))
}

// manyLayers is a model of 32 attention layers and small blocks, one
// Mamba layer.
func manyLayers(blocks int) Layout {
	const layers = 32
	return Layout{
		Model: "many-layers", Revision: "test", Pattern: "M" + strings.Repeat("*", layers), Vocab: 256,
		KV:    &KVLayout{Layers: layers, KVHeads: 1, HeadDim: 4, TokensPerBlock: 2, DType: "float32", Blocks: blocks},
		Mamba: &MambaLayout{Layers: 1, Heads: 2, HeadDim: 4, DState: 4, NGroups: 1, DConv: 4, ConvDType: "float32", SSMDType: "float32", Rows: 3, Reserved: []int{2}},
	}
}

// TestForgedFoldedTicketBounded: a forged folded ticket of 14 KB that
// claims 12 million extents for a send of 3,000 blocks (what two extents
// per piece and layer would have allowed) is refused before the sending
// agent makes room for them: the bound is what a receiver can cut the
// send's pieces into, 192,002 here.
func TestForgedFoldedTicketBounded(t *testing.T) {
	const blocks = 3000
	l := manyLayers(blocks)
	pl, size := perLayer(t, l)
	recv := registerPlanes(t, startAgent(t, "dec", rdma.TransportSHM), pl, size)
	send := register(t, startAgent(t, "pre", rdma.TransportSHM), l)
	names := make([]int, blocks)
	for i := range names {
		names[i] = i
	}
	ctx := ctxT(t)
	g, err := recv.c.Call(ctx, Request{Op: OpGrant, RequestID: 91, Blocks: names, Row: Row(0)}, nil)
	require.NoError(t, err)
	var tk ticket
	require.NoError(t, msgpack.Unmarshal(g.Ticket, &tk))
	const n = 3505 // 3505² ≈ 12.3 million
	sub := &tk.Subs[0].Ticket
	sub.Shape, sub.Bases, sub.Extents = make(words, 0, 2*n), make(words, 0, 2*n), nil
	for range n {
		sub.Shape = append(sub.Shape, 0, 1)
		sub.Bases = append(sub.Bases, 1, 0)
	}
	tk.V = ticketFolded
	forged, err := msgpack.Marshal(tk)
	require.NoError(t, err)

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, err = send.c.Call(ctx, Request{Op: OpSend, Ticket: forged, Blocks: names, Row: Row(1)}, nil)
	runtime.ReadMemStats(&after)
	require.ErrorIs(t, err, ErrBadTicket)
	require.Contains(t, err.Error(), "at most 192002")
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(64<<20), "the agent made room for what the ticket claimed")
	_, err = recv.c.Call(ctx, Request{Op: OpRevoke, Grant: g.Grant}, nil)
	require.NoError(t, err)
}

// TestTicketTooLargeRefused: a grant whose ticket a reply could not carry
// (block-major, 128 layers, 4,096 scattered blocks for four TP-4 senders:
// a million extents each) is refused by name, its grants closed, and the
// engine's connection goes on.
func TestTicketTooLargeRefused(t *testing.T) {
	if testing.Short() || raceEnabled {
		t.Skip("SKIP: opens grants of four million extents (scripts/test runs it without -race)")
	}
	const blocks, layers = 4096, 128
	l := Layout{
		Model: "deep", Revision: "test", Pattern: "M" + strings.Repeat("*", layers), Vocab: 256,
		KV:    &KVLayout{Layers: layers, KVHeads: 4, HeadDim: 1, TokensPerBlock: 2, DType: "float32", Blocks: 2 * blocks},
		Mamba: &MambaLayout{Layers: 1, Heads: 4, HeadDim: 4, DState: 4, NGroups: 4, DConv: 4, ConvDType: "float32", SSMDType: "float32", Rows: 3, Reserved: []int{2}},
	}
	sock, a := startAgentA(t, "dec", rdma.TransportSHM)
	recv := register(t, sock, l)
	names := make([]int, blocks)
	for i := range names {
		names[i] = 2 * i // apart: no two extents merge
	}
	ctx := ctxT(t)
	_, err := recv.c.Call(ctx, Request{Op: OpGrant, RequestID: 1, Blocks: names, FromTP: 4}, nil)
	require.ErrorIs(t, err, ErrFrameTooLarge)
	require.ErrorContains(t, err, "grant fewer blocks at a time")
	require.Zero(t, engineStats(a).GrantsOpen, "the refused grant's grants are closed")
	// The connection is the engine's still.
	g, err := recv.c.Call(ctx, Request{Op: OpGrant, RequestID: 2, Blocks: names[:8], FromTP: 4}, nil)
	require.NoError(t, err)
	require.NotEmpty(t, g.Ticket)
}

// TestOversizedReplyAnswered: a reply too large for a frame is answered
// with the error in its place, and the connection goes on; an event too
// large is not sent.
func TestOversizedReplyAnswered(t *testing.T) {
	var buf bytes.Buffer
	s := &session{w: bufio.NewWriter(&buf)}
	require.NoError(t, s.reply(Reply{Re: 7, Ticket: make([]byte, MaxFrame)}))
	// An event answers no request: it is not sent (an error frame in its
	// place would be read as a reply to nothing).
	require.ErrorIs(t, s.reply(Reply{Ev: EvTicket, Ticket: make([]byte, MaxFrame)}), ErrFrameTooLarge)
	require.NoError(t, s.reply(Reply{Re: 8}))
	b, err := readFrame(&buf)
	require.NoError(t, err)
	r, err := decodeReply(b)
	require.NoError(t, err)
	require.Equal(t, uint64(7), r.Re)
	require.Equal(t, "frame_too_large", r.Code)
	b, err = readFrame(&buf)
	require.NoError(t, err)
	r, err = decodeReply(b)
	require.NoError(t, err)
	require.Equal(t, Reply{Re: 8}, r)
}

// TestGrantOverMaxExtentsRefused: scattered blocks of a receiver with a
// plane per layer that come to more extents than rdma takes in one grant
// are refused by name, with what to do, and the connection goes on.
func TestGrantOverMaxExtentsRefused(t *testing.T) {
	if testing.Short() || raceEnabled {
		// 11 s for a million extents under -race on a quiet 2-core
		// machine, 16 s with other work beside it.
		t.Skip("SKIP: opens grants of a million extents (scripts/test runs it without -race)")
	}
	const blocks = 16400 // × 2 planes × 32 layers: just over 2^20 extents
	l := manyLayers(2 * blocks)
	pl, size := perLayer(t, l)
	recv := registerPlanes(t, startAgent(t, "dec", rdma.TransportSHM), pl, size)
	dst := make([]int, blocks)
	for i := range dst {
		dst[i] = 2 * i // apart: no two merge
	}
	ctx := ctxT(t)
	_, err := recv.c.Call(ctx, Request{Op: OpGrant, RequestID: 93, Blocks: dst}, nil)
	require.ErrorIs(t, err, rdma.ErrOutOfRange)
	require.Contains(t, err.Error(), "grant fewer blocks at a time")
	g, err := recv.c.Call(ctx, Request{Op: OpGrant, RequestID: 94, Blocks: dst[:blocks/2]}, nil)
	require.NoError(t, err, "half of them fit")
	_, err = recv.c.Call(ctx, Request{Op: OpRevoke, Grant: g.Grant}, nil)
	require.NoError(t, err)
}
