package agent

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/reshard"
)

// TestPlacementChecks: planes that overlap themselves or each other, or
// run past what an offset can hold, are refused by name; interleaved
// planes that share a stride and not a byte are taken.
func TestPlacementChecks(t *testing.T) {
	lens := []uint64{8, 8}
	for _, tc := range []struct {
		name   string
		planes []Plane
		want   string // "" for taken
		size   uint64
	}{
		{"back to back", nil, "", 4 * 16},
		{"apart", []Plane{{Offset: 100, Stride: 8}, {Offset: 0, Stride: 10}}, "", 132},
		{"interleaved", []Plane{{Offset: 0, Stride: 16}, {Offset: 8, Stride: 16}}, "", 64},
		{"interleaved, wrapped", []Plane{{Offset: 12, Stride: 16}, {Offset: 4, Stride: 16}}, "", 68},
		{"interleaved, one byte shared", []Plane{{Offset: 0, Stride: 16}, {Offset: 7, Stride: 16}}, "planes 0 and 1 overlap", 0},
		{"interleaved, wrapped onto", []Plane{{Offset: 12, Stride: 16}, {Offset: 3, Stride: 16}}, "planes 0 and 1 overlap", 0},
		{"the second reaching into the first", []Plane{{Offset: 4, Stride: 16}, {Offset: 0, Stride: 16}}, "planes 0 and 1 overlap", 0},
		{"same offset", []Plane{{Offset: 0, Stride: 16}, {Offset: 0, Stride: 16}}, "planes 0 and 1 overlap", 0},
		{"strides differ over shared bytes", []Plane{{Offset: 0, Stride: 16}, {Offset: 8, Stride: 24}}, "different strides", 0},
		{"stride below the plane", []Plane{{Offset: 0, Stride: 7}, {Offset: 100, Stride: 8}}, "plane 0 at offset 0 with stride 7", 0},
		{"negative offset", []Plane{{Offset: -8, Stride: 8}, {Offset: 100, Stride: 8}}, "plane 0 at offset -8", 0},
		{"overflow", []Plane{{Offset: 0, Stride: 1 << 62}, {Offset: 8, Stride: 1 << 62}}, "overflows", 0},
		{"offset at the end of int64", []Plane{{Offset: 1<<63 - 4, Stride: 8}, {Offset: 0, Stride: 8}}, "overflows", 0},
		{"one plane short", []Plane{{Offset: 0, Stride: 8}}, "1 declared, the layout has 2", 0},
	} {
		m, err := newPlacement("kv", 4, lens, tc.planes, 0)
		if tc.want == "" {
			require.NoError(t, err, tc.name)
			require.EqualValues(t, tc.size, m.bytes(), tc.name)
			continue
		}
		require.ErrorIs(t, err, ErrInvalidLayout, tc.name)
		require.Contains(t, err.Error(), tc.want, tc.name)
	}
}

// TestSegmentsCut: a send's pieces are cut where the ticket's extents end
// (the receiver's planes) and where the sender's own planes do; a ticket
// whose extents hold more or fewer bytes than the pieces is refused.
func TestSegmentsCut(t *testing.T) {
	p := &pools{}
	var err error
	p.kvAt, err = newPlacement("kv", 8, []uint64{16}, nil, 0)
	require.NoError(t, err)
	p.mamAt, err = newPlacement("mamba", 8, []uint64{4}, nil, 1)
	require.NoError(t, err)
	p.kv.Layers, p.mamba.Layers = 2, 2
	r := simRegions
	pcs := []piece{{len: 16}, {mamba: true, len: 4}}
	segs, err := p.segments(r, pcs, []int{3}, 5, []rdma.Extent{{Length: 12}, {Length: 8}})
	require.NoError(t, err)
	require.Equal(t, []seg{
		{dst: 0, at: rdma.Range{Ext: 0, Offset: 0, Length: 12}, src: rdma.Extent{Region: 1, Offset: 48, Length: 12}},
		{dst: 12, at: rdma.Range{Ext: 1, Offset: 0, Length: 4}, src: rdma.Extent{Region: 1, Offset: 60, Length: 4}},
		{mamba: true, dst: 0, at: rdma.Range{Ext: 1, Offset: 4, Length: 4}, src: rdma.Extent{Region: 2, Offset: 20, Length: 4}},
	}, segs)
	require.Equal(t, []rdma.Extent{{Region: 1, Offset: 48, Length: 16}, {Region: 2, Offset: 20, Length: 4}}, sources(segs))

	// The sender's KV in two planes of 8, the second first in memory.
	p.kvAt, err = newPlacement("kv", 8, []uint64{8, 8}, []Plane{{Offset: 1000, Stride: 8}, {Offset: 0, Stride: 8}}, 0)
	require.NoError(t, err)
	segs, err = p.segments(r, pcs[:1], []int{3}, -1, []rdma.Extent{{Length: 16}})
	require.NoError(t, err)
	require.Equal(t, []seg{
		{dst: 0, at: rdma.Range{Ext: 0, Offset: 0, Length: 8}, src: rdma.Extent{Region: 1, Offset: 1024, Length: 8}},
		{dst: 8, at: rdma.Range{Ext: 0, Offset: 8, Length: 8}, src: rdma.Extent{Region: 1, Offset: 24, Length: 8}},
	}, segs)

	for _, ext := range [][]rdma.Extent{
		{{Length: 16}},                           // too short
		{{Length: 16}, {Length: 4}, {Length: 1}}, // too long
		{{Length: 24}},                           // one too long
		{{Length: 16}, {Length: 0}, {Length: 4}}, // an empty one
	} {
		_, err := p.segments(r, pcs, []int{3}, 5, ext)
		require.ErrorIs(t, err, ErrBadTicket, "%v", ext)
	}
	// More extents than the receiver's planes cut are refused as the
	// ticket unfolds, before the segments.
	w, _ := toWire(rdma.Ticket{Extents: slices.Repeat([]rdma.Extent{{Length: 1}}, 20)}, 0)
	w.Token = make([]byte, 16)
	_, err = w.ticket(p.mostExtents(pcs))
	require.ErrorIs(t, err, ErrBadTicket)
}

// randomPlanes places n units of planes of lens: back to back (nil), each
// plane apart in a shuffled order with gaps and padded strides, or pairs
// of planes interleaved at one stride (K and V of a layer in one tensor),
// the pairs apart.
func randomPlanes(rng *rand.Rand, n int, lens []uint64) []Plane {
	mode := rng.IntN(3)
	if mode == 0 {
		return nil
	}
	out := make([]Plane, len(lens))
	var at int64
	for _, i := range rng.Perm(len(lens)) {
		if mode == 2 && i%2 == 1 {
			continue // placed with its pair
		}
		at += int64(rng.IntN(3) * 64)
		pad := int64(rng.IntN(2) * 16)
		if mode == 1 || i+1 == len(lens) {
			out[i] = Plane{Offset: at, Stride: int64(lens[i]) + pad}
			at += int64(n) * out[i].Stride
			continue
		}
		s := int64(lens[i]+lens[i+1]) + pad
		out[i], out[i+1] = Plane{Offset: at, Stride: s}, Plane{Offset: at + int64(lens[i]), Stride: s}
		if rng.IntN(2) == 0 { // V first in the pair
			out[i], out[i+1] = Plane{Offset: at + int64(lens[i+1]), Stride: s}, Plane{Offset: at, Stride: s}
		}
		at += int64(n) * s
	}
	return out
}

// simShard is one shard's memory in the property test: the regions' bytes
// by region ID (1 KV, 2 Mamba).
type simShard struct {
	p   *pools
	mem map[rdma.RegionID][]byte
}

var simRegions = []rdma.RegionID{1, 2} // buffer 0 the KV pool's, 1 the Mamba pool's

func newSimShard(t *testing.T, rng *rand.Rand, rank, size int, convOrder string) simShard {
	l := tinyLayout()
	l.TP = TP{Rank: rank, Size: size}
	l.Mamba.ConvOrder = convOrder
	p, err := compile(l, false)
	require.NoError(t, err)
	kvLens := make([]uint64, 2*p.kv.Layers)
	for i := range kvLens {
		kvLens[i] = uint64(p.kv.BlockBytes()) / uint64(len(kvLens))
	}
	var mLens []uint64
	for range p.mamba.Layers {
		mLens = append(mLens, uint64(p.mamba.ConvBytes()), uint64(p.mamba.SSMBytes()))
	}
	l.KV.Planes = randomPlanes(rng, l.KV.Blocks, kvLens)
	l.Mamba.Planes = randomPlanes(rng, l.Mamba.Rows, mLens)
	p, err = compile(l, false)
	require.NoError(t, err, "%+v %+v", l.KV.Planes, l.Mamba.Planes)
	return simShard{p: p, mem: map[rdma.RegionID][]byte{1: make([]byte, p.kvBytes()), 2: make([]byte, p.mambaBytes())}}
}

// unit reads (or, with w, writes) the virtual bytes of a block or row.
func (s simShard) unit(mamba bool, u int, w []byte) []byte {
	m := &s.p.kvAt
	if mamba {
		m = &s.p.mamAt
	}
	var out []byte
	for _, e := range m.spans(nil, simRegions, u, 0, m.unit) {
		b := s.mem[e.Region][e.Offset : e.Offset+e.Length]
		if w != nil {
			w = w[copy(b, w):]
		}
		out = append(out, b...)
	}
	return out
}

// TestPlanesProperty: senders and receivers that place their caches in
// random planes (or back to back), over every TP pair of the tiny layout,
// whole and layer by layer, conv states channel by channel or position by
// position (MambaLayout.ConvOrder): what lands in the receiver's named blocks and
// row is its shard of the whole model's, and no other byte of its memory
// changes. The write is simulated as rdma performs one: the concatenation
// of the sources lands in the concatenation of the ticket's extents.
func TestPlanesProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for round := range 300 {
		from, to := 1+rng.IntN(2), 1+rng.IntN(2)
		layers := rng.IntN(2) == 1
		order := []string{"ds", "sd"}[rng.IntN(2)]
		name := fmt.Sprintf("round %d: TP %d → %d, layer by layer %v, conv order %s", round, from, to, layers, order)
		senders := make([]simShard, from)
		for r := range from {
			senders[r] = newSimShard(t, rng, r, from, order)
		}
		p1, err := compile(tinyLayout(), false)
		require.NoError(t, err)
		kvL, mL := reshard.KV(p1.wholeKV), reshard.Mamba(p1.wholeMamba)
		if order == "sd" {
			mL = reshard.MambaSD(p1.wholeMamba)
		}
		nb := 1 + rng.IntN(4)
		srcBlocks, dstBlocks := rng.Perm(32)[:nb], rng.Perm(32)[:nb]
		srcRow, dstRow := rng.IntN(5), rng.IntN(5) // row 5 is reserved
		whole := make([][]byte, nb+1)
		for i := range whole {
			n := p1.kv.BlockBytes()
			if i == nb {
				n = p1.mamba.RowBytes()
			}
			whole[i] = make([]byte, n)
			fill(whole[i], uint64(round*10+i))
		}
		for r, s := range senders {
			for i, b := range srcBlocks {
				s.unit(false, b, shardUnit(t, kvL, from, r, whole[i]))
			}
			s.unit(true, srcRow, shardUnit(t, mL, from, r, whole[nb]))
		}
		for rd := range to {
			recv := newSimShard(t, rng, rd, to, order)
			pl, err := recv.p.plans(from, to)
			require.NoError(t, err)
			for rs, snd := range senders {
				pm := recv.p.kvAt.placed()
				pcs := pl.pieces(rs, rd, nb, true)
				if len(pcs) == 0 {
					continue
				}
				if pm {
					pcs = pl.planeMajor(pcs)
				}
				// The grant's extents, through a ticket folded as the
				// receiver folds it, unfolded under the sender's bound.
				ext, g := recv.p.grantExtents(simRegions, pl, pcs, dstBlocks, dstRow, pm)
				spl, err := snd.p.plans(from, to)
				require.NoError(t, err)
				spcs := spl.pieces(rs, rd, nb, true)
				if pm {
					spcs = spl.planeMajor(spcs)
				}
				w, folded := toWire(rdma.Ticket{Token: [16]byte{1}, Extents: ext}, g)
				alike := pm // the receiver's KV planes of one stride list their blocks alike
				for _, pt := range recv.p.kvAt.parts {
					alike = alike && pt.stride == recv.p.kvAt.parts[0].stride
				}
				require.True(t, folded || !alike, "%s: not folded", name)
				rt, err := w.ticket(snd.p.mostExtents(spcs))
				require.NoError(t, err, name)
				require.Equal(t, ext, rt.Extents, name)
				segs, err := snd.p.segments(simRegions, spcs, srcBlocks, srcRow, rt.Extents)
				require.NoError(t, err, name)
				if !layers {
					var flat []byte
					for _, e := range sources(segs) {
						flat = append(flat, snd.mem[e.Region][e.Offset:e.Offset+e.Length]...)
					}
					for _, e := range ext {
						flat = flat[copy(recv.mem[e.Region][e.Offset:e.Offset+e.Length], flat):]
					}
					require.Empty(t, flat, name)
					continue
				}
				for _, mamba := range []bool{false, true} {
					for l := range 2 {
						dst, src := layerRanges(spl, segs, mamba, l)
						for i, d := range dst {
							e, s := ext[d.Ext], src[i]
							copy(recv.mem[e.Region][e.Offset+d.Offset:e.Offset+d.Offset+d.Length], snd.mem[s.Region][s.Offset:s.Offset+s.Length])
						}
					}
				}
			}
			// What the receiver's memory must hold: its shard of the
			// named units, zero elsewhere.
			want := simShard{p: recv.p, mem: map[rdma.RegionID][]byte{1: make([]byte, len(recv.mem[1])), 2: make([]byte, len(recv.mem[2]))}}
			for i, b := range dstBlocks {
				want.unit(false, b, shardUnit(t, kvL, to, rd, whole[i]))
			}
			want.unit(true, dstRow, shardUnit(t, mL, to, rd, whole[nb]))
			for id := range want.mem {
				if !bytes.Equal(want.mem[id], recv.mem[id]) {
					require.Equal(t, want.mem[id], recv.mem[id], "%s: receiver %d's region %d", name, rd, id)
				}
			}
		}
	}
}

// vllmLayout is tinyLayout with each layer's caches apart, as vLLM keeps
// them: per attention layer one [2][blocks][heads][tokens][head_dim]
// tensor (K planes then V planes), per Mamba layer a conv tensor [rows]...
// then an SSM tensor [rows]...; the layers in reverse order in memory, a
// page between tensors, and a page spare at the end.
func vllmLayout(t testing.TB, tp TP) (Layout, int64) {
	l := tinyLayout()
	l.TP = tp
	return perLayer(t, l)
}

// perLayer places l's caches as vllmLayout says.
func perLayer(t testing.TB, l Layout) (Layout, int64) {
	p, err := compile(l, false)
	require.NoError(t, err)
	const page = 4096
	var at int64
	rb := p.kv.BlockBytes() / int64(2*p.kv.Layers)
	l.KV.Planes = make([]Plane, 2*p.kv.Layers)
	for i := p.kv.Layers - 1; i >= 0; i-- {
		l.KV.Planes[2*i] = Plane{Offset: at, Stride: rb}
		l.KV.Planes[2*i+1] = Plane{Offset: at + int64(l.KV.Blocks)*rb, Stride: rb}
		at += 2*int64(l.KV.Blocks)*rb + page
	}
	l.Mamba.Planes = make([]Plane, 2*p.mamba.Layers)
	cb, sb := p.mamba.ConvBytes(), p.mamba.SSMBytes()
	for i := p.mamba.Layers - 1; i >= 0; i-- {
		l.Mamba.Planes[2*i] = Plane{Offset: at, Stride: cb}
		l.Mamba.Planes[2*i+1] = Plane{Offset: at + int64(l.Mamba.Rows)*cb, Stride: sb}
		at += int64(l.Mamba.Rows)*(cb+sb) + page
	}
	return l, at
}

// registerPlanes registers l (with planes) in one memfd of size bytes,
// which holds both caches, as one allocation of an engine would.
func registerPlanes(t testing.TB, sock string, l Layout, size int64) *engine {
	p, err := compile(l, false)
	require.NoError(t, err)
	ctx := context.Background()
	c, err := Dial(ctx, sock)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	fd, mem := memfd(t, size)
	fill(mem, 3)
	_, err = c.Register(ctx, l, fd, size, fd, size)
	require.NoError(t, err)
	return &engine{c: c, kv: mem, mam: mem, p: p}
}

// vunit reads the virtual bytes of a block or row of e, wherever its
// layout places them.
func (e *engine) vunit(mamba bool, u int) []byte {
	m, mem := &e.p.kvAt, e.kv
	if mamba {
		m, mem = &e.p.mamAt, e.mam
	}
	var out []byte
	for _, x := range m.spans(nil, make([]rdma.RegionID, 2), u, 0, m.unit) {
		out = append(out, mem[x.Offset:x.Offset+x.Length]...)
	}
	return out
}

// TestPerLayerEngine: an engine that keeps each layer's caches apart
// (vLLM's per-layer tensors, in one allocation) registers them with
// planes: two TP-2 block-major engines write one request into it, whole
// and layer by layer over tcp, and it lands in every layer's tensors; it
// writes back into a block-major engine over shm; its reserved row is
// forbidden in the data plane in every plane.
func TestPerLayerEngine(t *testing.T) {
	for _, layers := range []bool{false, true} {
		t.Run(map[bool]string{false: "whole", true: "layer by layer"}[layers], func(t *testing.T) {
			l, size := vllmLayout(t, TP{})
			sock, a := startAgentA(t, "dec", rdma.TransportTCP, rdma.TransportSHM)
			recv := registerPlanes(t, sock, l, size)
			a.mu.Lock()
			s := a.latest
			a.mu.Unlock()
			forbid := recv.p.mamAt.spans(nil, regionIDs(s.bufs), 5, 0, recv.p.mamAt.unit)
			slices.SortFunc(forbid, func(a, b rdma.Extent) int { return int(a.Offset) - int(b.Offset) })
			require.Equal(t, forbid, s.bufs[1].Forbidden())
			require.Len(t, forbid, 4)
			for _, e := range forbid {
				_, err := s.eng.OpenGrant(rdma.GrantSpec{RequestID: 1, Extents: []rdma.Extent{{Region: s.bufs[1].ID(), Offset: e.Offset + e.Length - 1, Length: 1}}})
				require.ErrorIs(t, err, rdma.ErrForbidden)
			}

			senders, whole := tp2Senders(t, rdma.TransportTCP, [2]int{7, 8}, 2, 20)
			p := recv.p
			before := slices.Clone(recv.kv)
			ctx := ctxT(t)
			g, err := recv.c.Call(ctx, Request{Op: OpGrant, RequestID: 31, Blocks: []int{4, 5}, Row: Row(3), FromTP: 2}, nil)
			require.NoError(t, err)
			var order []layerCall
			if layers {
				order = []layerCall{{"mamba", 1}, {"kv", 1}, {"mamba", 0}, {"kv", 0}}
			}
			for _, s := range senders {
				sendInto(t, ctx, s, g.Ticket, []int{7, 8}, 2, order)
			}
			ev := event(t, recv, EvGrantDone)
			require.EqualValues(t, 2*p.kv.BlockBytes()+p.mamba.RowBytes(), ev.Bytes)
			require.Equal(t, whole[0], recv.vunit(false, 4))
			require.Equal(t, whole[1], recv.vunit(false, 5))
			require.Equal(t, whole[2], recv.vunit(true, 3))
			// Nothing else changed: put the named units back as they were
			// and compare the whole allocation.
			after := simShard{p: recv.p, mem: map[rdma.RegionID][]byte{1: slices.Clone(recv.kv), 2: nil}}
			after.mem[2] = after.mem[1]
			old := simShard{p: recv.p, mem: map[rdma.RegionID][]byte{1: before, 2: before}}
			after.unit(false, 4, old.unit(false, 4, nil))
			after.unit(false, 5, old.unit(false, 5, nil))
			after.unit(true, 3, old.unit(true, 3, nil))
			require.True(t, bytes.Equal(before, after.mem[1]), "bytes outside the named blocks and row changed")

			// Back into a block-major engine, over shm.
			back := register(t, startAgent(t, "back", rdma.TransportSHM), tinyLayout())
			g, err = back.c.Call(ctx, Request{Op: OpGrant, RequestID: 32, Blocks: []int{9, 1}, Row: Row(0)}, nil)
			require.NoError(t, err)
			_, err = recv.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{4, 5}, Row: Row(3)}, nil)
			require.NoError(t, err)
			event(t, recv, EvSendDone)
			event(t, back, EvGrantDone)
			require.Equal(t, whole[0], back.block(9))
			require.Equal(t, whole[1], back.block(1))
			require.Equal(t, whole[2], back.row(0))
		})
	}
}

// TestPlanesSizeChecked: memory with planes may be larger than the planes
// need (an allocation holding more), never smaller; without planes it is
// exactly the pools' size; a buffer nothing is placed in, or one a plane
// names that was not registered, is refused.
func TestPlanesSizeChecked(t *testing.T) {
	l, size := vllmLayout(t, TP{})
	p, err := compile(l, false)
	require.NoError(t, err)
	mem := func(kv, mamba int64) []bufferMem {
		return []bufferMem{{name: "kv pool", bytes: kv}, {name: "mamba pool", bytes: mamba}}
	}
	require.NoError(t, checkBuffers(p.kvAt, p.mamAt, mem(size, size)))
	require.ErrorIs(t, checkBuffers(p.kvAt, p.mamAt, mem(p.kvBytes()-1, size)), ErrInvalidLayout)
	require.ErrorIs(t, checkBuffers(p.kvAt, p.mamAt, mem(size, p.mambaBytes()-1)), ErrInvalidLayout)
	p, err = compile(tinyLayout(), false)
	require.NoError(t, err)
	require.NoError(t, checkBuffers(p.kvAt, p.mamAt, mem(p.kvBytes(), p.mambaBytes())))
	err = checkBuffers(p.kvAt, p.mamAt, mem(p.kvBytes()+1, p.mambaBytes()))
	require.ErrorIs(t, err, ErrInvalidLayout)
	require.Contains(t, err.Error(), "kv pool of")

	l, _ = vllmLayout(t, TP{})
	l.KV.Planes[3].Buffer = 2
	p, err = compile(l, true)
	require.NoError(t, err)
	three := []bufferMem{{name: "buffer 0", bytes: size}, {name: "buffer 1", bytes: size}, {name: "buffer 2", bytes: size}}
	err = checkBuffers(p.kvAt, p.mamAt, three)
	require.ErrorIs(t, err, ErrInvalidLayout)
	require.Contains(t, err.Error(), "buffer 1 of")
	require.Contains(t, err.Error(), "places nothing in it")
	err = checkBuffers(p.kvAt, p.mamAt, three[:1])
	require.Contains(t, err.Error(), "buffer 2, which was not registered")
}

// TestOneMemoryForBothChecked: one memfd passed for both caches is taken
// when their planes lie apart, and refused when a KV plane reaches into
// the Mamba state (a KV write would land in it, a reserved row's bytes
// included) or when both are back to back from offset 0.
func TestOneMemoryForBothChecked(t *testing.T) {
	sock := startAgent(t, "a", rdma.TransportSHM)
	try := func(l Layout, size int64) error {
		c, err := Dial(context.Background(), sock)
		require.NoError(t, err)
		defer c.Close()
		fd, _ := memfd(t, size)
		_, err = c.Register(ctxT(t), l, fd, size, fd, size)
		return err
	}
	l, size := vllmLayout(t, TP{})
	require.NoError(t, try(l, size))

	bad, _ := vllmLayout(t, TP{})
	bad.KV.Planes = slices.Clone(bad.KV.Planes)
	bad.KV.Planes[0].Offset = bad.Mamba.Planes[1].Offset // layer 0's K onto layer 1's SSM state... and past it
	err := try(bad, size+int64(bad.KV.Blocks)*bad.KV.Planes[0].Stride)
	require.ErrorIs(t, err, ErrInvalidLayout)
	require.Contains(t, err.Error(), "kv plane 0 (kv pool) and mamba plane")

	p, err := compile(tinyLayout(), false)
	require.NoError(t, err)
	size = max(p.kvBytes(), p.mambaBytes())
	c, err := Dial(context.Background(), sock)
	require.NoError(t, err)
	defer c.Close()
	fd, _ := memfd(t, size)
	_, err = c.Register(ctxT(t), tinyLayout(), fd, p.kvBytes(), fd, p.mambaBytes())
	require.ErrorIs(t, err, ErrInvalidLayout)
	require.Contains(t, err.Error(), "overlap in one memory")
}

// TestNHDOrder: a KV cache in NHD order (vLLM's default, SGLang's) moves
// between agents of that order at one TP size, byte for byte; an HND peer
// is refused by name, as is a grant from senders of another TP size.
func TestNHDOrder(t *testing.T) {
	nhd := func() Layout {
		l, _ := vllmLayout(t, TP{})
		l.KV.Order = "nhd"
		return l
	}
	l, size := vllmLayout(t, TP{})
	a := registerPlanes(t, startAgent(t, "a", rdma.TransportSHM), nhd(), size)
	b := registerPlanes(t, startAgent(t, "b", rdma.TransportSHM), nhd(), size)
	hnd := registerPlanes(t, startAgent(t, "c", rdma.TransportSHM), l, size)
	ctx := ctxT(t)
	g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 40, Blocks: []int{2}, Row: Row(1)}, nil)
	require.NoError(t, err)
	_, err = a.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{6}, Row: Row(0)}, nil)
	require.NoError(t, err)
	event(t, a, EvSendDone)
	event(t, b, EvGrantDone)
	require.Equal(t, a.vunit(false, 6), b.vunit(false, 2))
	require.Equal(t, a.vunit(true, 0), b.vunit(true, 1))

	_, err = hnd.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{6}, Row: Row(0)}, nil)
	require.ErrorIs(t, err, ErrLayoutMismatch)
	require.Contains(t, err.Error(), `agent "b" has dtypes kv=float32/nhd`)

	_, err = b.c.Call(ctx, Request{Op: OpGrant, RequestID: 41, Blocks: []int{3}, FromTP: 2}, nil)
	require.ErrorIs(t, err, ErrLayoutMismatch)
	require.Contains(t, err.Error(), "NHD order")

	bad := nhd()
	bad.KV.Order = "thd"
	_, err = compile(bad, false)
	require.ErrorIs(t, err, ErrInvalidLayout)
}

// TestPlaneOffsetsRefusedAtRegister: a plane placed near the end of the
// offsets (which once passed the overflow guard and had the agent panic
// forbidding a reserved row there) is refused by name, and the agent
// goes on serving.
func TestPlaneOffsetsRefusedAtRegister(t *testing.T) {
	sock := startAgent(t, "a", rdma.TransportSHM)
	l, size := vllmLayout(t, TP{})
	for _, off := range []int64{math.MaxInt64 - 8, math.MaxInt64 - 4096, 1 << 62} {
		bad, _ := vllmLayout(t, TP{})
		bad.Mamba.Planes[0].Offset = off
		c, err := Dial(context.Background(), sock)
		require.NoError(t, err)
		fd, _ := memfd(t, size)
		_, err = c.Register(ctxT(t), bad, fd, size, fd, size)
		require.ErrorIs(t, err, ErrInvalidLayout, "offset %d", off)
		c.Close()
	}
	registerPlanes(t, sock, l, size)
}

// TestPlaneMajorTicket: a receiver whose KV lies in planes lists its
// extents plane by plane, so consecutive blocks merge into one extent per
// plane (block order would list one per block and plane), and a
// block-major sender follows that order: the blocks land where named.
func TestPlaneMajorTicket(t *testing.T) {
	l, size := vllmLayout(t, TP{})
	recv := registerPlanes(t, startAgent(t, "dec", rdma.TransportSHM), l, size)
	send := register(t, startAgent(t, "pre", rdma.TransportSHM), tinyLayout())
	ctx := ctxT(t)
	g, err := recv.c.Call(ctx, Request{Op: OpGrant, RequestID: 70, Blocks: []int{4, 5, 6, 7}, Row: Row(1)}, nil)
	require.NoError(t, err)
	tk, _, sub, err := decodeTicket(g.Ticket, 0)
	require.NoError(t, err)
	require.Equal(t, ticketPlaneMajor, tk.V, "a small ticket is not folded")
	rt, err := sub.ticket(1 << 10)
	require.NoError(t, err)
	require.Len(t, rt.Extents, 2*l.KV.Layers+2*l.Mamba.Layers)
	_, err = send.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{9, 10, 20, 3}, Row: Row(0)}, nil)
	require.NoError(t, err)
	event(t, send, EvSendDone)
	event(t, recv, EvGrantDone)
	for i, b := range []int{9, 10, 20, 3} {
		require.Equal(t, send.block(b), recv.vunit(false, 4+i))
	}
	require.Equal(t, send.row(0), recv.vunit(true, 1))
}

// TestConvOrderSD: engines whose conv states lie position by position
// (vLLM's default) exchange rows with each other, resharded between TP
// sizes too (TestPlanesProperty checks the bytes); one that keeps them
// channel by channel is refused by name, and an unknown order at
// registration.
func TestConvOrderSD(t *testing.T) {
	sd := func(tp TP) Layout {
		l := tinyLayout()
		l.TP, l.Mamba.ConvOrder = tp, "sd"
		return l
	}
	a := register(t, startAgent(t, "a", rdma.TransportSHM), sd(TP{}))
	b := register(t, startAgent(t, "b", rdma.TransportSHM), sd(TP{}))
	ds := register(t, startAgent(t, "c", rdma.TransportSHM), tinyLayout())
	ctx := ctxT(t)
	g, err := b.c.Call(ctx, Request{Op: OpGrant, RequestID: 50, Blocks: []int{2}, Row: Row(1)}, nil)
	require.NoError(t, err)
	_, err = ds.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{6}, Row: Row(0)}, nil)
	require.ErrorIs(t, err, ErrLayoutMismatch)
	require.Contains(t, err.Error(), `agent "b" has dtypes kv=float32,conv=float32/sd,ssm=float32`)
	_, err = a.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{6}, Row: Row(0)}, nil)
	require.NoError(t, err)
	event(t, a, EvSendDone)
	event(t, b, EvGrantDone)
	require.Equal(t, a.block(6), b.block(2))
	require.Equal(t, a.row(0), b.row(1))

	_, err = b.c.Call(ctx, Request{Op: OpGrant, RequestID: 51, Blocks: []int{3}, Row: Row(2), FromTP: 2}, nil)
	require.NoError(t, err, "SD conv states reshard")

	bad := sd(TP{})
	bad.Mamba.ConvOrder = "dsx"
	_, err = compile(bad, false)
	require.ErrorIs(t, err, ErrInvalidLayout)
	bad = sd(TP{})
	bad.Mamba.DConv = maxSDConv + 1
	_, err = compile(bad, false)
	require.ErrorIs(t, err, ErrInvalidLayout, "plans of a section per position, for too many positions")
}
