package agent

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
	"github.com/handoff-io/handoff/rdma"
)

// perBufferLayout is tinyLayout kept as vLLM keeps it on a GPU: each
// attention layer's [2][blocks][heads][tokens][head_dim] tensor, and each
// Mamba layer's conv and SSM state tensors, an allocation of its own
// (buffers 0..L-1 the KV layers', then conv and SSM of each Mamba layer).
// It returns the layout and the buffers' sizes.
func perBufferLayout(t *testing.T) (Layout, []int64) {
	l := tinyLayout()
	p, err := compile(l, false)
	require.NoError(t, err)
	rb := p.kv.BlockBytes() / int64(2*p.kv.Layers)
	var sizes []int64
	for i := range p.kv.Layers {
		l.KV.Planes = append(l.KV.Planes, Plane{Offset: 0, Stride: rb, Buffer: i}, Plane{Offset: int64(l.KV.Blocks) * rb, Stride: rb, Buffer: i})
		sizes = append(sizes, 2*int64(l.KV.Blocks)*rb)
	}
	cb, sb := p.mamba.ConvBytes(), p.mamba.SSMBytes()
	for range p.mamba.Layers {
		l.Mamba.Planes = append(l.Mamba.Planes, Plane{Stride: cb, Buffer: len(sizes)}, Plane{Stride: sb, Buffer: len(sizes) + 1})
		sizes = append(sizes, int64(l.Mamba.Rows)*cb, int64(l.Mamba.Rows)*sb)
	}
	return l, sizes
}

// bufEngine is an engine registered by buffers: their memory, by index.
type bufEngine struct {
	c   *Client
	p   *pools
	mem [][]byte
}

// vunit reads the virtual bytes of a block or row, from wherever the
// layout's planes place them.
func (e *bufEngine) vunit(mamba bool, u int) []byte {
	m := &e.p.kvAt
	if mamba {
		m = &e.p.mamAt
	}
	ids := make([]rdma.RegionID, len(e.mem))
	for i := range ids {
		ids[i] = rdma.RegionID(i)
	}
	var out []byte
	for _, x := range m.spans(nil, ids, u, 0, m.unit) {
		out = append(out, e.mem[x.Region][x.Offset:x.Offset+x.Length]...)
	}
	return out
}

// TestBuffers: an engine whose every layer's caches are allocations of
// their own (one memfd each) registers them as buffers that its planes
// name: two TP-2 block-major engines write one request into it, whole and
// layer by layer; it writes back into a block-major engine; the reserved
// row is forbidden in every plane's region, and nothing outside the
// named blocks and row changes.
func TestBuffers(t *testing.T) {
	for _, layers := range []bool{false, true} {
		t.Run(map[bool]string{false: "whole", true: "layer by layer"}[layers], func(t *testing.T) {
			l, sizes := perBufferLayout(t)
			sock, a := startAgentA(t, "dec", rdma.TransportTCP, rdma.TransportSHM)
			p, err := compile(l, true)
			require.NoError(t, err)
			recv := &bufEngine{p: p}
			var fds []int
			var bufs []Buffer
			for i, n := range sizes {
				fd, mem := memfd(t, n)
				fill(mem, uint64(100+i))
				fds, bufs, recv.mem = append(fds, fd), append(bufs, Buffer{Bytes: n}), append(recv.mem, mem)
			}
			recv.c, err = Dial(context.Background(), sock)
			require.NoError(t, err)
			t.Cleanup(func() { recv.c.Close() })
			ctx := ctxT(t)
			_, err = recv.c.Call(ctx, Request{Op: OpRegister, Layout: &l, Buffers: bufs}, fds)
			require.NoError(t, err)
			a.mu.Lock()
			s := a.latest
			a.mu.Unlock()
			require.Len(t, s.bufs, len(sizes))
			for i, r := range s.bufs[len(sizes)-4:] { // each Mamba plane's region forbids row 5's part
				n := uint64(p.mamba.ConvBytes())
				if i%2 == 1 {
					n = uint64(p.mamba.SSMBytes())
				}
				require.Equal(t, []rdma.Extent{{Region: r.ID(), Offset: 5 * n, Length: n}}, r.Forbidden())
			}
			before := make([][]byte, len(recv.mem))
			for i, m := range recv.mem {
				before[i] = append([]byte(nil), m...)
			}

			senders, whole := tp2Senders(t, rdma.TransportTCP, [2]int{7, 30}, 2, 50)
			g, err := recv.c.Call(ctx, Request{Op: OpGrant, RequestID: 80, Blocks: []int{11, 12}, Row: Row(4), FromTP: 2}, nil)
			require.NoError(t, err)
			var order []layerCall
			if layers {
				order = []layerCall{{"kv", 0}, {"kv", 1}, {"mamba", 0}, {"mamba", 1}}
			}
			for _, sd := range senders {
				sendInto(t, ctx, sd, g.Ticket, []int{7, 30}, 2, order)
			}
			ev, err := recv.c.WaitEvent(ctx, func(r Reply) bool { return r.Ev == EvGrantDone || r.Ev == EvGrantFailed })
			require.NoError(t, err)
			require.Equal(t, EvGrantDone, ev.Ev, "%s: %s", ev.Code, ev.Msg)
			require.Equal(t, whole[0], recv.vunit(false, 11))
			require.Equal(t, whole[1], recv.vunit(false, 12))
			require.Equal(t, whole[2], recv.vunit(true, 4))
			// Nothing else changed: the named units put back as they were,
			// every buffer is as before.
			old := &bufEngine{p: p, mem: before}
			undo := func(mamba bool, u int) {
				m := &p.kvAt
				if mamba {
					m = &p.mamAt
				}
				ids := make([]rdma.RegionID, len(recv.mem))
				for i := range ids {
					ids[i] = rdma.RegionID(i)
				}
				src := old.vunit(mamba, u)
				for _, x := range m.spans(nil, ids, u, 0, m.unit) {
					src = src[copy(recv.mem[x.Region][x.Offset:x.Offset+x.Length], src):]
				}
			}
			undo(false, 11)
			undo(false, 12)
			undo(true, 4)
			for i := range before {
				require.True(t, string(before[i]) == string(recv.mem[i]), "buffer %d changed outside the named blocks and row", i)
			}

			// Back into a block-major engine.
			back := register(t, startAgent(t, "back", rdma.TransportSHM), tinyLayout())
			g, err = back.c.Call(ctx, Request{Op: OpGrant, RequestID: 81, Blocks: []int{1, 2}, Row: Row(0)}, nil)
			require.NoError(t, err)
			_, err = recv.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{11, 12}, Row: Row(4)}, nil)
			require.NoError(t, err)
			ev, err = recv.c.WaitEvent(ctx, func(r Reply) bool { return r.Ev == EvSendDone || r.Ev == EvSendFailed })
			require.NoError(t, err)
			require.Equal(t, EvSendDone, ev.Ev, "%s: %s", ev.Code, ev.Msg)
			event(t, back, EvGrantDone)
			require.Equal(t, recv.vunit(false, 11), back.block(1))
			require.Equal(t, recv.vunit(false, 12), back.block(2))
			require.Equal(t, recv.vunit(true, 4), back.row(0))
		})
	}
}

// TestBuffersRefused: registrations by buffers that cannot be honoured are
// refused by name: both by pool and by buffers, a cache without planes, a
// plane naming a buffer not passed, a buffer nothing is placed in, two
// buffers of one memfd whose planes overlap.
func TestBuffersRefused(t *testing.T) {
	sock := startAgent(t, "a", rdma.TransportSHM)
	try := func(l Layout, q Request, sizes []int64, same bool) error {
		c, err := Dial(context.Background(), sock)
		require.NoError(t, err)
		defer c.Close()
		var fds []int
		for i, n := range sizes {
			if same && i > 0 {
				fds = append(fds, fds[0])
				continue
			}
			fd, _ := memfd(t, max(n, sizes[0]))
			fds = append(fds, fd)
		}
		for _, n := range sizes {
			q.Buffers = append(q.Buffers, Buffer{Bytes: n})
		}
		q.Op, q.Layout = OpRegister, &l
		_, err = c.Call(ctxT(t), q, fds)
		return err
	}
	_, sizes := perBufferLayout(t)
	for _, tc := range []struct {
		name string
		edit func(l *Layout, q *Request, sizes []int64) []int64
		same bool
		want string
	}{
		{"taken", func(*Layout, *Request, []int64) []int64 { return sizes }, false, ""},
		{"by pool and by buffers", func(_ *Layout, q *Request, s []int64) []int64 { q.KVBytes = 1; return s }, false, "both by pool and by buffers"},
		{"no kv planes", func(l *Layout, _ *Request, s []int64) []int64 { l.KV.Planes = nil; return s }, false, "each plane must name its buffer"},
		{"a buffer not passed", func(_ *Layout, _ *Request, s []int64) []int64 { return s[:len(s)-1] }, false, "which was not registered"},
		{"a buffer unused", func(_ *Layout, _ *Request, s []int64) []int64 { return append(s, 4096) }, false, "places nothing in it"},
		{"one memfd twice, planes over each other", func(*Layout, *Request, []int64) []int64 { return sizes }, true, "overlap in one memory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, _ := perBufferLayout(t)
			var q Request
			s := tc.edit(&l, &q, append([]int64(nil), sizes...))
			err := try(l, q, s, tc.same)
			if tc.want == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, ErrInvalidLayout)
			require.Contains(t, err.Error(), tc.want)
		})
	}
}

// TestBuffersOneAllocation: buffers in device memory that lie in one
// allocation (torch's caching allocator places smaller tensors in one
// segment: one IPC handle, different offsets) are mapped once and land
// where their offsets say; buffers in allocations of their own are each
// mapped.
func TestBuffersOneAllocation(t *testing.T) {
	exp := cudafake.New(cudafake.Config{})
	imp := cudafake.New(cudafake.Config{PID: os.Getpid() + 1<<22})
	h := register(t, startAgent(t, "host", rdma.TransportSHM, rdma.TransportTCP), tinyLayout())
	sock := startCUDAAgent(t, "gpu", imp)
	l, sizes := perBufferLayout(t)
	p, err := compile(l, true)
	require.NoError(t, err)
	d, err := cuda.OpenDevice(exp, "0")
	require.NoError(t, err)
	defer d.Close()
	dev := d.UUID().String()
	// The KV layers an allocation each; the Mamba states one allocation,
	// a page between them.
	var bufs []Buffer
	var arenas []*cuda.Arena
	var offs []uint64
	nKV := p.kv.Layers
	for _, n := range sizes[:nKV] {
		a, err := d.NewArena(uint64(n))
		require.NoError(t, err)
		defer a.Free()
		x, err := a.Export()
		require.NoError(t, err)
		bufs = append(bufs, Buffer{Bytes: n, CUDA: &CUDAMemory{Handle: x.Handle.Reserved[:], Device: dev}})
		arenas, offs = append(arenas, a), append(offs, 0)
	}
	total := uint64(4096)
	for _, n := range sizes[nKV:] {
		total += uint64(n) + 4096
	}
	shared, err := d.NewArena(total)
	require.NoError(t, err)
	defer shared.Free()
	x, err := shared.Export()
	require.NoError(t, err)
	at := uint64(4096)
	for _, n := range sizes[nKV:] {
		bufs = append(bufs, Buffer{Bytes: n, CUDA: &CUDAMemory{Handle: x.Handle.Reserved[:], Offset: at, Device: dev}})
		arenas, offs = append(arenas, shared), append(offs, at)
		at += uint64(n) + 4096
	}
	c, err := Dial(context.Background(), sock)
	require.NoError(t, err)
	defer c.Close()
	ctx := ctxT(t)
	_, err = c.Call(ctx, Request{Op: OpRegister, Layout: &l, Buffers: bufs}, nil)
	require.NoError(t, err)
	require.Equal(t, nKV+1, imp.Stats().Imports, "one mapping per allocation")

	g, err := c.Call(ctx, Request{Op: OpGrant, RequestID: 90, Blocks: []int{6, 7}, Row: Row(2)}, nil)
	require.NoError(t, err)
	_, err = h.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{3, 4}, Row: Row(1)}, nil)
	require.NoError(t, err)
	event(t, h, EvSendDone)
	ev, err := c.WaitEvent(ctx, func(r Reply) bool { return r.Ev == EvGrantDone || r.Ev == EvGrantFailed })
	require.NoError(t, err)
	require.Equal(t, EvGrantDone, ev.Ev, "%s: %s", ev.Code, ev.Msg)
	mem := make([][]byte, len(bufs))
	for i, b := range bufs {
		mem[i] = make([]byte, b.Bytes)
		_, err := arenas[i].ReadAt(mem[i], int64(offs[i]))
		require.NoError(t, err)
	}
	e := &bufEngine{p: p, mem: mem}
	require.Equal(t, h.block(3), e.vunit(false, 6))
	require.Equal(t, h.block(4), e.vunit(false, 7))
	require.Equal(t, h.row(1), e.vunit(true, 2))
	c.Close()
	require.Eventually(t, func() bool { return imp.Stats().Imports == 0 }, 5*time.Second, 10*time.Millisecond)
}

// TestBuffersJudgedByPlanes: two buffers of one allocation whose ranges
// overlap are taken when their planes interleave (layer 0's K and V as
// two tensors over one [blocks][2] allocation, each of stride 2 planes)
// and land where their planes say; refused when their planes share a
// byte.
func TestBuffersJudgedByPlanes(t *testing.T) {
	exp := cudafake.New(cudafake.Config{})
	imp := cudafake.New(cudafake.Config{PID: os.Getpid() + 1<<22})
	h := register(t, startAgent(t, "host", rdma.TransportSHM, rdma.TransportTCP), tinyLayout())
	sock := startCUDAAgent(t, "gpu", imp)
	d, err := cuda.OpenDevice(exp, "0")
	require.NoError(t, err)
	defer d.Close()
	dev := d.UUID().String()
	l0, sizes := perBufferLayout(t)
	p, err := compile(l0, true)
	require.NoError(t, err)
	rb := uint64(p.kv.BlockBytes()) / uint64(2*p.kv.Layers)
	var total uint64
	for _, n := range sizes {
		total += uint64(n)
	}
	a, err := d.NewArena(total + rb)
	require.NoError(t, err)
	defer a.Free()
	x, err := a.Export()
	require.NoError(t, err)
	// Buffer i at the sum of the sizes before it; one more buffer, the
	// last, over buffer 0 from shift: layer 0's V.
	layout := func(shift uint64) (Layout, []Buffer, []uint64) {
		l, _ := perBufferLayout(t)
		var bufs []Buffer
		var offs []uint64
		var at uint64
		for _, n := range sizes {
			bufs, offs = append(bufs, Buffer{Bytes: n, CUDA: &CUDAMemory{Handle: x.Handle.Reserved[:], Offset: at, Device: dev}}), append(offs, at)
			at += uint64(n)
		}
		bufs = append(bufs, Buffer{Bytes: sizes[0] - int64(shift), CUDA: &CUDAMemory{Handle: x.Handle.Reserved[:], Offset: shift, Device: dev}})
		offs = append(offs, shift)
		l.KV.Planes[0] = Plane{Offset: 0, Stride: int64(2 * rb), Buffer: 0}
		l.KV.Planes[1] = Plane{Offset: 0, Stride: int64(2 * rb), Buffer: len(sizes)}
		return l, bufs, offs
	}
	ctx := ctxT(t)
	l, bufs, _ := layout(rb / 2)
	c, err := Dial(context.Background(), sock)
	require.NoError(t, err)
	_, err = c.Call(ctx, Request{Op: OpRegister, Layout: &l, Buffers: bufs}, nil)
	require.ErrorIs(t, err, ErrInvalidLayout)
	require.Contains(t, err.Error(), "kv plane 0 (buffer 0) and kv plane 1 (buffer 6) overlap in one memory")
	require.Zero(t, imp.Stats().Imports)
	c.Close()

	l, bufs, offs := layout(rb)
	c, err = Dial(context.Background(), sock)
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Call(ctx, Request{Op: OpRegister, Layout: &l, Buffers: bufs}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, imp.Stats().Imports, "one allocation, one mapping")
	g, err := c.Call(ctx, Request{Op: OpGrant, RequestID: 91, Blocks: []int{5, 6}, Row: Row(3)}, nil)
	require.NoError(t, err)
	_, err = h.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{8, 9}, Row: Row(0)}, nil)
	require.NoError(t, err)
	event(t, h, EvSendDone)
	ev, err := c.WaitEvent(ctx, func(r Reply) bool { return r.Ev == EvGrantDone || r.Ev == EvGrantFailed })
	require.NoError(t, err)
	require.Equal(t, EvGrantDone, ev.Ev, "%s: %s", ev.Code, ev.Msg)
	pl, err := compile(l, true)
	require.NoError(t, err)
	mem := make([][]byte, len(bufs))
	for i, b := range bufs {
		mem[i] = make([]byte, b.Bytes)
		_, err := a.ReadAt(mem[i], int64(offs[i]))
		require.NoError(t, err)
	}
	e := &bufEngine{p: pl, mem: mem}
	require.Equal(t, h.block(8), e.vunit(false, 5))
	require.Equal(t, h.block(9), e.vunit(false, 6))
	require.Equal(t, h.row(0), e.vunit(true, 3))
}

// TestBuffersMany: more buffers than a message used to carry descriptors
// (8) are taken, up to the kernel's 253 per message; more are refused by
// name.
func TestBuffersMany(t *testing.T) {
	l := tinyLayout()
	l.Pattern, l.KV.Layers, l.Mamba.Layers = "M*M*M*M*M*M*", 6, 6
	p, err := compile(l, false)
	require.NoError(t, err)
	rb := p.kv.BlockBytes() / int64(2*p.kv.Layers)
	var sizes []int64
	for i := range 2 * p.kv.Layers { // K and V a buffer each
		l.KV.Planes = append(l.KV.Planes, Plane{Stride: rb, Buffer: i})
		sizes = append(sizes, int64(l.KV.Blocks)*rb)
	}
	for range p.mamba.Layers {
		l.Mamba.Planes = append(l.Mamba.Planes, Plane{Stride: p.mamba.ConvBytes(), Buffer: len(sizes)}, Plane{Stride: p.mamba.SSMBytes(), Buffer: len(sizes) + 1})
		sizes = append(sizes, int64(l.Mamba.Rows)*p.mamba.ConvBytes(), int64(l.Mamba.Rows)*p.mamba.SSMBytes())
	}
	require.Len(t, sizes, 24)
	sock := startAgent(t, "a", rdma.TransportSHM)
	c, err := Dial(context.Background(), sock)
	require.NoError(t, err)
	defer c.Close()
	var fds []int
	var bufs []Buffer
	for _, n := range sizes {
		fd, _ := memfd(t, n)
		fds, bufs = append(fds, fd), append(bufs, Buffer{Bytes: n})
	}
	_, err = c.Call(ctxT(t), Request{Op: OpRegister, Layout: &l, Buffers: bufs}, fds)
	require.NoError(t, err)

	c2, err := Dial(context.Background(), sock)
	require.NoError(t, err)
	defer c2.Close()
	many := make([]Buffer, maxBuffers+1)
	for i := range many {
		many[i] = Buffer{Bytes: 1 << 20, CUDA: &CUDAMemory{Handle: make([]byte, 64), Device: "GPU-0"}}
	}
	_, err = c2.Call(ctxT(t), Request{Op: OpRegister, Layout: &l, Buffers: many}, nil)
	require.ErrorIs(t, err, ErrInvalidLayout)
	require.Contains(t, err.Error(), "254 buffers, at most 253")
}
