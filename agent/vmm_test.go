//go:build linux && (amd64 || arm64)

package agent

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
	"github.com/handoff-io/handoff/rdma"
)

// vmmAlloc is an engine's VMM allocation (cuMemCreate) in the exporter's
// driver: mapped in the engine's own address space, to fill and read it,
// and exported as the fd the engine passes its agent.
type vmmAlloc struct {
	d    *cuda.Device
	p    cuda.DevicePtr
	size uint64
	fd   int
}

func newVMM(t *testing.T, d *cuda.Device, atLeast uint64) *vmmAlloc {
	t.Helper()
	v := &vmmAlloc{d: d, fd: -1}
	require.NoError(t, d.Do(func(drv cuda.Driver) (err error) {
		dev, err := drv.DeviceGet(d.Ordinal())
		if err != nil {
			return err
		}
		g, err := drv.MemGetAllocationGranularity(dev)
		if err != nil {
			return err
		}
		v.size = (atLeast + g - 1) / g * g
		h, err := drv.MemCreate(v.size, dev)
		if err != nil {
			return err
		}
		defer drv.MemRelease(h) // the mapping keeps the memory
		if v.fd, err = drv.MemExportToShareableHandle(h); err != nil {
			return err
		}
		if v.p, err = drv.MemAddressReserve(v.size, 0); err != nil {
			return err
		}
		if err = drv.MemMap(v.p, v.size, h); err != nil {
			return err
		}
		return drv.MemSetAccess(v.p, v.size, dev)
	}))
	t.Cleanup(func() {
		require.NoError(t, d.Do(func(drv cuda.Driver) error {
			if err := drv.MemUnmap(v.p, v.size); err != nil {
				return err
			}
			return drv.MemAddressFree(v.p, v.size)
		}))
		unix.Close(v.fd)
	})
	return v
}

func (v *vmmAlloc) write(t *testing.T, off uint64, b []byte) {
	t.Helper()
	require.NoError(t, v.d.CopyToDevice(v.p+cuda.DevicePtr(off), b))
}

func (v *vmmAlloc) read(t *testing.T, off, n uint64) []byte {
	t.Helper()
	b := make([]byte, n)
	require.NoError(t, v.d.CopyFromDevice(b, v.p+cuda.DevicePtr(off)))
	return b
}

// vmmEngine is a test engine whose pools lie in one VMM allocation.
type vmmEngine struct {
	c           *Client
	p           *pools
	v           *vmmAlloc
	kvOff, mOff uint64
}

func (e *vmmEngine) block(t *testing.T, b int) []byte {
	n := uint64(e.p.kv.BlockBytes())
	return e.v.read(t, e.kvOff+uint64(b)*n, n)
}

func (e *vmmEngine) row(t *testing.T, r int) []byte {
	return e.v.read(t, e.mOff+e.p.rowOff(r), uint64(e.p.mamba.RowBytes()))
}

// vmmPools lays both pools of l out in one new VMM allocation of the
// exporter's, filled from seed, and returns what registers them.
func vmmPools(t *testing.T, exp cuda.Driver, l Layout, seed uint64) (*vmmEngine, Request, []int) {
	t.Helper()
	p, err := compile(l, false)
	require.NoError(t, err)
	d, err := cuda.OpenDevice(exp, "0")
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, d.Close()) })
	e := &vmmEngine{p: p, kvOff: 4096}
	e.mOff = e.kvOff + uint64(p.kvBytes()) + 512
	e.v = newVMM(t, d, e.mOff+uint64(p.mambaBytes())+4096)
	kv, mam := make([]byte, p.kvBytes()), make([]byte, p.mambaBytes())
	fill(kv, seed)
	fill(mam, seed+1)
	e.v.write(t, e.kvOff, kv)
	e.v.write(t, e.mOff, mam)
	dev := d.UUID().String()
	q := Request{Op: OpRegister, Layout: &l, KVBytes: p.kvBytes(), MambaBytes: p.mambaBytes(),
		KVCUDA:    &CUDAMemory{VMMBytes: e.v.size, VMMID: 1, Offset: e.kvOff, Device: dev},
		MambaCUDA: &CUDAMemory{VMMBytes: e.v.size, VMMID: 1, Offset: e.mOff, Device: dev}}
	// One allocation passed for both pools (one id): one descriptor each,
	// as an engine passes what it registers.
	return e, q, []int{e.v.fd, e.v.fd}
}

// TestDeviceMemoryVMM: an engine registers both pools in one VMM
// allocation by the POSIX fd it exported (the agent's driver another
// "process"): they are mapped once; a host engine's blocks and row land
// at the named blocks and row, at the offsets given, and the engine's
// reach a host engine (by tcp: no CUDA IPC handle names VMM memory);
// its reserved row is refused; when it goes, the agent unmaps its memory
// and leaves it.
func TestDeviceMemoryVMM(t *testing.T) {
	exp := cudafake.New(cudafake.Config{})
	imp := cudafake.New(cudafake.Config{PID: os.Getpid() + 1<<22})
	h := register(t, startAgent(t, "host", rdma.TransportSHM, rdma.TransportTCP), tinyLayout())
	sock := startCUDAAgent(t, "gpu", imp)
	registerVMM := func(seed uint64) *vmmEngine {
		e, q, fds := vmmPools(t, exp, tinyLayout(), seed)
		var err error
		e.c, err = Dial(context.Background(), sock)
		require.NoError(t, err)
		t.Cleanup(func() { e.c.Close() })
		rep, err := e.c.Call(ctxT(t), q, fds)
		require.NoError(t, err)
		require.Equal(t, e.p.fingerprint, rep.Fingerprint, "the same layout in VMM memory has the host layout's fingerprint")
		return e
	}
	g := registerVMM(3)
	s := imp.Stats()
	require.Equal(t, 1, s.Mapped, "one allocation, one mapping")
	require.Equal(t, 1, s.Reserved)
	require.Zero(t, s.Handles, "the mapping holds the memory, not the handle")
	// A second engine on the agent's GPU keeps the device, so what the
	// first one's end lets go is its own doing, not the context's.
	other := registerVMM(9)
	ctx := ctxT(t)

	// host -> device
	gr, err := g.c.Call(ctx, Request{Op: OpGrant, RequestID: 1, Blocks: []int{7, 2}, Row: Row(3)}, nil)
	require.NoError(t, err)
	_, err = h.c.Call(ctx, Request{Op: OpSend, Ticket: gr.Ticket, Blocks: []int{1, 4}, Row: Row(0)}, nil)
	require.NoError(t, err)
	event(t, h, EvSendDone)
	ev, err := g.c.WaitEvent(ctx, func(r Reply) bool { return r.Ev == EvGrantDone || r.Ev == EvGrantFailed })
	require.NoError(t, err)
	require.Equal(t, EvGrantDone, ev.Ev, "%s: %s", ev.Code, ev.Msg)
	require.Equal(t, h.block(1), g.block(t, 7))
	require.Equal(t, h.block(4), g.block(t, 2))
	require.Equal(t, h.row(0), g.row(t, 3))
	require.Equal(t, make([]byte, g.kvOff), g.v.read(t, 0, g.kvOff), "nothing before the pool's offset was written")

	// device -> host
	gr, err = h.c.Call(ctx, Request{Op: OpGrant, RequestID: 2, Blocks: []int{9}, Row: Row(1)}, nil)
	require.NoError(t, err)
	_, err = g.c.Call(ctx, Request{Op: OpSend, Ticket: gr.Ticket, Blocks: []int{5}, Row: Row(4)}, nil)
	require.NoError(t, err)
	ev, err = g.c.WaitEvent(ctx, func(r Reply) bool { return r.Ev == EvSendDone || r.Ev == EvSendFailed })
	require.NoError(t, err)
	require.Equal(t, EvSendDone, ev.Ev, "%s: %s", ev.Code, ev.Msg)
	event(t, h, EvGrantDone)
	require.Equal(t, g.block(t, 5), h.block(9))
	require.Equal(t, g.row(t, 4), h.row(1))

	_, err = g.c.Call(ctx, Request{Op: OpGrant, RequestID: 3, Blocks: []int{1}, Row: Row(5)}, nil)
	require.ErrorIs(t, err, ErrReserved)

	g.c.Close()
	require.Eventually(t, func() bool {
		s := imp.Stats()
		return s.Mapped == 1 && s.Reserved == 1 && s.Handles == 0
	}, 5*time.Second, 10*time.Millisecond, "the engine went: its memory is unmapped and its range freed")
	require.Equal(t, g.block(t, 7), h.block(1), "and its memory is its own")
	other.c.Close()
	require.Eventually(t, func() bool {
		s := imp.Stats()
		return s.Mapped == 0 && s.Reserved == 0 && s.Allocs == 0
	}, 5*time.Second, 10*time.Millisecond, "%+v", imp.Stats())
}

// TestDeviceMemoryVMMRefused: a VMM registration the agent cannot map is
// refused by name and leaves nothing mapped, reserved or held; the agent
// keeps no descriptor of it.
func TestDeviceMemoryVMMRefused(t *testing.T) {
	exp := cudafake.New(cudafake.Config{})
	imp := cudafake.New(cudafake.Config{PID: os.Getpid() + 1<<22})
	sock := startCUDAAgent(t, "gpu", imp)
	e, ok, fds := vmmPools(t, exp, tinyLayout(), 5)
	plain, _ := memfd(t, int64(e.v.size))
	for _, tc := range []struct {
		name string
		edit func(q *Request) []int
		want string
	}{
		{"not a VMM export", func(q *Request) []int { return []int{plain, plain} }, "cuMemImportFromShareableHandle"},
		{"a size off the granularity", func(q *Request) []int {
			q.KVCUDA.VMMBytes, q.MambaCUDA.VMMBytes = e.v.size-4096, e.v.size-4096
			return fds
		}, "granularity"},
		{"past the allocation", func(q *Request) []int { q.MambaCUDA.Offset = e.v.size - 64; return fds }, "VMM allocation of"},
		{"two sizes of one allocation", func(q *Request) []int { q.KVCUDA.VMMBytes *= 2; return fds }, "one VMM allocation of"},
		{"a handle too", func(q *Request) []int { q.KVCUDA.Handle = make([]byte, 64); return fds }, "both a CUDA IPC handle and a VMM allocation"},
		{"one descriptor short", func(q *Request) []int { return fds[:1] }, "descriptors"},
		{"one allocation's pools overlapping", func(q *Request) []int { q.MambaCUDA.Offset = q.KVCUDA.Offset + 64; return fds }, "overlap"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Dial(context.Background(), sock)
			require.NoError(t, err)
			defer c.Close()
			q := ok
			kv, mam := *ok.KVCUDA, *ok.MambaCUDA
			q.KVCUDA, q.MambaCUDA = &kv, &mam
			held := func() int { return fdsOf(t, e.v.fd) + fdsOf(t, plain) }
			before := held()
			_, err = c.Call(ctxT(t), q, tc.edit(&q))
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
			var re *RemoteError
			require.ErrorAs(t, err, &re)
			require.Contains(t, []string{"invalid_layout", "bad_request"}, re.Code, re.Msg)
			s := imp.Stats()
			require.Zero(t, s.Mapped+s.Reserved+s.Handles, "%+v", s)
			require.Eventually(t, func() bool { return held() == before }, 5*time.Second, 10*time.Millisecond,
				"the descriptors passed with a refused registration are closed")
		})
	}
}

// fdsOf counts this process's descriptors of the file fd is.
func fdsOf(t *testing.T, fd int) int {
	t.Helper()
	var want unix.Stat_t
	require.NoError(t, unix.Fstat(fd, &want))
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	n := 0
	for _, e := range ents {
		var st unix.Stat_t
		if unix.Stat("/proc/self/fd/"+e.Name(), &st) == nil && st.Dev == want.Dev && st.Ino == want.Ino {
			n++
		}
	}
	return n
}

// TestDeviceMemoryVMMTwoAllocations: pools in two VMM allocations of one
// size, each at offset 0, are two memories (two ids: the driver's fds do
// not tell allocations apart): each is mapped, no overlap is claimed, and
// each pool's bytes land in its own allocation. Without ids, the same.
func TestDeviceMemoryVMMTwoAllocations(t *testing.T) {
	for _, ids := range [][2]uint64{{1, 2}, {0, 0}} {
		t.Run(fmt.Sprint(ids), func(t *testing.T) { vmmTwoAllocations(t, ids) })
	}
}

func vmmTwoAllocations(t *testing.T, ids [2]uint64) {
	exp := cudafake.New(cudafake.Config{})
	imp := cudafake.New(cudafake.Config{PID: os.Getpid() + 1<<22})
	h := register(t, startAgent(t, "host", rdma.TransportSHM, rdma.TransportTCP), tinyLayout())
	l := tinyLayout()
	p, err := compile(l, false)
	require.NoError(t, err)
	d, err := cuda.OpenDevice(exp, "0")
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, d.Close()) }) // after the allocations' cleanups
	size := uint64(max(p.kvBytes(), p.mambaBytes()))
	kvA, mamA := newVMM(t, d, size), newVMM(t, d, size)
	require.Equal(t, kvA.size, mamA.size)
	dev := d.UUID().String()
	c, err := Dial(context.Background(), startCUDAAgent(t, "gpu", imp))
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Call(ctxT(t), Request{Op: OpRegister, Layout: &l, KVBytes: p.kvBytes(), MambaBytes: p.mambaBytes(),
		KVCUDA:    &CUDAMemory{VMMBytes: kvA.size, VMMID: ids[0], Device: dev},
		MambaCUDA: &CUDAMemory{VMMBytes: mamA.size, VMMID: ids[1], Device: dev}}, []int{kvA.fd, mamA.fd})
	require.NoError(t, err, "ids %v", ids)
	require.Equal(t, 2, imp.Stats().Mapped)
	gr, err := c.Call(ctxT(t), Request{Op: OpGrant, RequestID: 1, Blocks: []int{3}, Row: Row(2)}, nil)
	require.NoError(t, err)
	_, err = h.c.Call(ctxT(t), Request{Op: OpSend, Ticket: gr.Ticket, Blocks: []int{1}, Row: Row(0)}, nil)
	require.NoError(t, err)
	event(t, h, EvSendDone)
	bb := uint64(p.kv.BlockBytes())
	require.Equal(t, h.block(1), kvA.read(t, 3*bb, bb))
	require.Equal(t, h.row(0), mamA.read(t, p.rowOff(2), uint64(p.mamba.RowBytes())))
}
