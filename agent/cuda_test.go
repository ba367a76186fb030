//go:build linux && (amd64 || arm64)

package agent

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
	"github.com/handoff-io/handoff/rdma"
)

// devEngine is a test engine whose pools are in device memory: arenas of
// its own fake driver, each at an offset in a larger allocation as a
// caching allocator hands them out, shared with its agent by IPC handle.
type devEngine struct {
	c       *Client
	p       *pools
	kv, mam *cuda.Arena // the whole allocations
	off     uint64      // where each pool starts in its allocation
}

func (e *devEngine) read(t *testing.T, a *cuda.Arena, off, n uint64) []byte {
	t.Helper()
	b := make([]byte, n)
	_, err := a.ReadAt(b, int64(e.off+off))
	require.NoError(t, err)
	return b
}

func (e *devEngine) block(t *testing.T, b int) []byte {
	n := uint64(e.p.kv.BlockBytes())
	return e.read(t, e.kv, uint64(b)*n, n)
}

func (e *devEngine) row(t *testing.T, r int) []byte {
	return e.read(t, e.mam, e.p.rowOff(r), uint64(e.p.mamba.RowBytes()))
}

// startCUDAAgent starts an agent whose CUDA driver is imp.
func startCUDAAgent(t *testing.T, name string, imp cuda.Driver) string {
	t.Helper()
	sock, _, _ := serveAgent(t, Config{Name: name, Transports: []rdma.Transport{rdma.TransportSHM, rdma.TransportTCP},
		CUDA: func() (cuda.Driver, error) { return imp, nil }}, nil)
	return sock
}

// registerDevice registers pools in the exporter's device memory, filled
// from seed, with the agent at sock.
func registerDevice(t *testing.T, sock string, exp cuda.Driver, l Layout, seed uint64) *devEngine {
	t.Helper()
	p, err := compile(l, false)
	require.NoError(t, err)
	d, err := cuda.OpenDevice(exp, "0")
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, d.Close()) })
	e := &devEngine{p: p, off: 4096}
	share := func(size int64, seed uint64) (*cuda.Arena, *CUDAMemory) {
		a, err := d.NewArena(uint64(size) + 2*e.off)
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, a.Free()) })
		b := make([]byte, size)
		fill(b, seed)
		_, err = a.WriteAt(b, int64(e.off))
		require.NoError(t, err)
		x, err := a.Export()
		require.NoError(t, err)
		return a, &CUDAMemory{Handle: x.Handle.Reserved[:], Offset: e.off, Device: d.UUID().String()}
	}
	var kv, mam *CUDAMemory
	e.kv, kv = share(p.kvBytes(), seed)
	e.mam, mam = share(p.mambaBytes(), seed+1)
	e.c, err = Dial(context.Background(), sock)
	require.NoError(t, err)
	t.Cleanup(func() { e.c.Close() })
	rep, err := e.c.Call(context.Background(), Request{Op: OpRegister, Layout: &l, KVBytes: p.kvBytes(), MambaBytes: p.mambaBytes(),
		KVCUDA: kv, MambaCUDA: mam}, nil)
	require.NoError(t, err)
	require.Equal(t, p.fingerprint, rep.Fingerprint, "the same layout in device memory has the host layout's fingerprint")
	return e
}

// TestDeviceMemoryPools: an engine registers pools in device memory by
// CUDA IPC handle (the agent's driver is another "process", a second fake
// with another pid); a host engine's blocks and row land at the named
// blocks and row of its device memory, at the offset it gave, and its
// device blocks and row reach a host engine; its reserved row is refused;
// when it goes, the agent closes its mappings and leaves its memory.
func TestDeviceMemoryPools(t *testing.T) {
	exp := cudafake.New(cudafake.Config{})
	imp := cudafake.New(cudafake.Config{PID: os.Getpid() + 1<<22})
	h := register(t, startAgent(t, "host", rdma.TransportSHM, rdma.TransportTCP), tinyLayout())
	g := registerDevice(t, startCUDAAgent(t, "gpu", imp), exp, tinyLayout(), 3)
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
	// Nothing before the pool's offset was written.
	require.Equal(t, make([]byte, g.off), func() []byte { b := make([]byte, g.off); g.kv.ReadAt(b, 0); return b }())

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

	require.Equal(t, 2, imp.Stats().Imports, "one mapping per pool")
	g.c.Close()
	require.Eventually(t, func() bool { return imp.Stats().Imports == 0 }, 5*time.Second, 10*time.Millisecond,
		"the engine went: its mappings are closed")
	require.Equal(t, g.block(t, 7), h.block(1), "and its memory is its own")
}

// TestDeviceMemoryRefused: a handle of the wrong size, a pool past its
// allocation and a device the driver does not have are refused by name,
// and leave no mapping.
func TestDeviceMemoryRefused(t *testing.T) {
	exp := cudafake.New(cudafake.Config{})
	imp := cudafake.New(cudafake.Config{PID: os.Getpid() + 1<<22})
	sock := startCUDAAgent(t, "gpu", imp)
	l := tinyLayout()
	p, err := compile(l, false)
	require.NoError(t, err)
	d, err := cuda.OpenDevice(exp, "0")
	require.NoError(t, err)
	defer d.Close()
	a, err := d.NewArena(uint64(p.kvBytes()))
	require.NoError(t, err)
	defer a.Free()
	x, err := a.Export()
	require.NoError(t, err)
	ok := CUDAMemory{Handle: x.Handle.Reserved[:], Device: d.UUID().String()}
	for _, tc := range []struct {
		name string
		kv   CUDAMemory
		want string
		code string
	}{
		{"short handle", CUDAMemory{Handle: ok.Handle[:10], Device: ok.Device}, "handle of 10 bytes", "invalid_layout"},
		{"past the allocation", CUDAMemory{Handle: ok.Handle, Offset: 64, Device: ok.Device}, "invalid value", "invalid_layout"},
		{"no such device", CUDAMemory{Handle: ok.Handle, Device: "GPU-00000000-0000-0000-0000-0000000000ff"}, "kv pool in device memory", "invalid_layout"},
		{"no device named", CUDAMemory{Handle: ok.Handle}, "without the device's UUID", "invalid_layout"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Dial(context.Background(), sock)
			require.NoError(t, err)
			defer c.Close()
			kv := tc.kv
			mfd, _ := memfd(t, p.mambaBytes())
			_, err = c.Call(ctxT(t), Request{Op: OpRegister, Layout: &l, KVBytes: p.kvBytes(), MambaBytes: p.mambaBytes(), KVCUDA: &kv}, []int{mfd})
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
			var re *RemoteError
			require.ErrorAs(t, err, &re)
			require.Equal(t, tc.code, re.Code, re.Msg)
			require.Zero(t, imp.Stats().Imports)
		})
	}
}

// TestDeviceMemoryOneAllocation: both pools in one allocation (one IPC
// handle, as an engine that carves its caches out of one tensor) are
// mapped once and land where their offsets say; pools that overlap are
// refused by name.
func TestDeviceMemoryOneAllocation(t *testing.T) {
	exp := cudafake.New(cudafake.Config{})
	imp := cudafake.New(cudafake.Config{PID: os.Getpid() + 1<<22})
	h := register(t, startAgent(t, "host", rdma.TransportSHM, rdma.TransportTCP), tinyLayout())
	sock := startCUDAAgent(t, "gpu", imp)
	l := tinyLayout()
	p, err := compile(l, false)
	require.NoError(t, err)
	d, err := cuda.OpenDevice(exp, "0")
	require.NoError(t, err)
	defer d.Close()
	// [gap 4096][mamba][gap 4096][kv]
	mOff := uint64(4096)
	kOff := mOff + uint64(p.mambaBytes()) + 4096
	a, err := d.NewArena(kOff + uint64(p.kvBytes()))
	require.NoError(t, err)
	defer a.Free()
	x, err := a.Export()
	require.NoError(t, err)
	dev := d.UUID().String()
	ctx := ctxT(t)

	c, err := Dial(context.Background(), sock)
	require.NoError(t, err)
	_, err = c.Call(ctx, Request{Op: OpRegister, Layout: &l, KVBytes: p.kvBytes(), MambaBytes: p.mambaBytes(),
		KVCUDA:    &CUDAMemory{Handle: x.Handle.Reserved[:], Offset: mOff + 64, Device: dev},
		MambaCUDA: &CUDAMemory{Handle: x.Handle.Reserved[:], Offset: mOff, Device: dev}}, nil)
	require.ErrorIs(t, err, ErrInvalidLayout)
	require.Contains(t, err.Error(), "overlap")
	require.Zero(t, imp.Stats().Imports)
	c.Close()

	c, err = Dial(context.Background(), sock)
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Call(ctx, Request{Op: OpRegister, Layout: &l, KVBytes: p.kvBytes(), MambaBytes: p.mambaBytes(),
		KVCUDA:    &CUDAMemory{Handle: x.Handle.Reserved[:], Offset: kOff, Device: dev},
		MambaCUDA: &CUDAMemory{Handle: x.Handle.Reserved[:], Offset: mOff, Device: dev}}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, imp.Stats().Imports, "one mapping for both pools")

	gr, err := c.Call(ctx, Request{Op: OpGrant, RequestID: 1, Blocks: []int{6}, Row: Row(2)}, nil)
	require.NoError(t, err)
	_, err = h.c.Call(ctx, Request{Op: OpSend, Ticket: gr.Ticket, Blocks: []int{3}, Row: Row(1)}, nil)
	require.NoError(t, err)
	event(t, h, EvSendDone)
	ev, err := c.WaitEvent(ctx, func(r Reply) bool { return r.Ev == EvGrantDone || r.Ev == EvGrantFailed })
	require.NoError(t, err)
	require.Equal(t, EvGrantDone, ev.Ev, "%s: %s", ev.Code, ev.Msg)
	read := func(off, n uint64) []byte {
		b := make([]byte, n)
		_, err := a.ReadAt(b, int64(off))
		require.NoError(t, err)
		return b
	}
	bb, rb := uint64(p.kv.BlockBytes()), uint64(p.mamba.RowBytes())
	require.Equal(t, h.block(3), read(kOff+6*bb, bb))
	require.Equal(t, h.row(1), read(mOff+p.rowOff(2), rb))
	c.Close()
	require.Eventually(t, func() bool { return imp.Stats().Imports == 0 }, 5*time.Second, 10*time.Millisecond)
}

// TestDeviceMemoryCUDAIPC: between two agents whose engines registered
// pools in device memory, with cuda-ipc, the receiving agent copies device
// to device from the sending engine's own allocation (the sending agent
// hands on the engine's handle, which the driver lets a third process open,
// where a handle of its own mapping would be refused): the blocks and the
// row land byte-exact, every byte by the pull and none staged, the sender's
// allocations opened once. A second engine of the receiving agent pulls
// from the same allocations through the same mappings, and keeps them
// when the first engine goes; they are closed once the sending engine went.
// Each agent's driver is another "process" (a fake with its own pid), as
// are the engines'.
func TestDeviceMemoryCUDAIPC(t *testing.T) {
	exp := cudafake.New(cudafake.Config{})
	sockA, _, _ := startIPCAgent(t, "gpu-a", 1)
	sockB, agentB, impB := startIPCAgent(t, "gpu-b", 2)
	src := registerDevice(t, sockA, exp, tinyLayout(), 10)
	dst := registerDevice(t, sockB, exp, tinyLayout(), 20)
	require.Equal(t, 2, impB.Stats().Imports, "the receiving agent maps its engine's two pools")
	require.NotEqual(t, src.block(t, 1), dst.block(t, 7))

	rep := ipcSend(t, src, dst, 1, []int{1, 4}, 0, []int{7, 2}, 3)
	want := uint64(2*src.p.kv.BlockBytes() + src.p.mamba.RowBytes())
	require.Equal(t, want, rep.Bytes)
	st := engineStats(agentB)
	require.Equal(t, want, st.BytesPulled, "every byte copied device to device from the sender's allocation")
	require.Zero(t, st.BytesStaged, "none staged through host memory")
	require.Equal(t, 4, impB.Stats().Imports, "and the sender's two allocations mapped")
	require.Equal(t, 2, importOpens(t, agentB), "once each")

	// A second engine of agent B pulls from the same allocations through
	// the same mappings; the first one's going leaves them to it.
	dst2 := registerDevice(t, sockB, exp, tinyLayout(), 30)
	ipcSend(t, src, dst2, 2, []int{5}, 1, []int{3}, 2)
	dst.c.Close()
	require.Eventually(t, func() bool { return engineCount(agentB) == 1 }, 5*time.Second, 10*time.Millisecond)
	ipcSend(t, src, dst2, 3, []int{6}, 2, []int{4}, 0)
	require.Equal(t, 2, importOpens(t, agentB), "the sender's allocations were never reopened")
	require.Equal(t, 4, impB.Stats().Imports, "dst2's pools and the sender's two, still mapped")

	src.c.Close()
	require.Eventually(t, func() bool { return impB.Stats().Imports == 2 }, 5*time.Second, 10*time.Millisecond,
		"the sending engine went: the receiving agent closed its mappings of that engine's memory")
}

// TestDeviceMemoryCUDAIPCOneAgent: two engines of one agent, both in
// device memory, with cuda-ipc: the receiving engine's side pulls from the
// allocation the sending engine's side mapped already (the driver would
// refuse a second open of the handle in one process) and shares that
// mapping, which outlives the sending engine's session until the pull's
// connection ended.
func TestDeviceMemoryCUDAIPCOneAgent(t *testing.T) {
	exp := cudafake.New(cudafake.Config{})
	sock, a, imp := startIPCAgent(t, "gpu", 1)
	src := registerDevice(t, sock, exp, tinyLayout(), 10)
	dst := registerDevice(t, sock, exp, tinyLayout(), 20)
	require.Equal(t, 4, imp.Stats().Imports)
	ipcSend(t, src, dst, 1, []int{1, 4}, 0, []int{7, 2}, 3)
	require.Equal(t, uint64(2*src.p.kv.BlockBytes()+src.p.mamba.RowBytes()), engineStats(a).BytesPulled)
	require.Equal(t, 4, imp.Stats().Imports, "no second mapping of the sender's allocations")
	src.c.Close()
	require.Eventually(t, func() bool { return imp.Stats().Imports == 2 }, 5*time.Second, 10*time.Millisecond,
		"the sending engine went: its mappings closed once the pull's connection ended too")
	require.Equal(t, src.block(t, 1), dst.block(t, 7), "and the bytes that landed stay")
}

// startIPCAgent starts an agent serving cuda-ipc and tcp whose driver is a
// fake standing for another process (its pid shifted by shift<<22).
func startIPCAgent(t *testing.T, name string, shift int) (string, *Agent, *cudafake.Driver) {
	t.Helper()
	imp := cudafake.New(cudafake.Config{PID: os.Getpid() + shift<<22})
	sock, a, _ := serveAgent(t, Config{Name: name, Transports: []rdma.Transport{rdma.TransportCUDAIPC, rdma.TransportTCP},
		CUDA: func() (cuda.Driver, error) { return imp, nil }}, nil)
	return sock, a, imp
}

// ipcSend sends src's blocks and row into dst's (one send, answered when it
// ended), checks that it landed byte-exact and returns the send's reply.
func ipcSend(t *testing.T, src, dst *devEngine, req uint64, from []int, fromRow int, to []int, toRow int) Reply {
	t.Helper()
	ctx := ctxT(t)
	gr, err := dst.c.Call(ctx, Request{Op: OpGrant, RequestID: req, Blocks: to, Row: Row(toRow)}, nil)
	require.NoError(t, err)
	rep, err := src.c.Call(ctx, Request{Op: OpSend, Ticket: gr.Ticket, Blocks: from, Row: Row(fromRow), Wait: true}, nil)
	require.NoError(t, err)
	ev, err := dst.c.WaitEvent(ctx, func(r Reply) bool { return r.Ev == EvGrantDone || r.Ev == EvGrantFailed })
	require.NoError(t, err)
	require.Equal(t, EvGrantDone, ev.Ev, "%s: %s", ev.Code, ev.Msg)
	for i := range from {
		require.Equal(t, src.block(t, from[i]), dst.block(t, to[i]), "block %d -> %d", from[i], to[i])
	}
	require.Equal(t, src.row(t, fromRow), dst.row(t, toRow))
	return rep
}

// importOpens is how many IPC handles a's devices opened for Import.
func importOpens(t *testing.T, a *Agent) int {
	t.Helper()
	a.cuda.mu.Lock()
	defer a.cuda.mu.Unlock()
	n := 0
	for _, d := range a.cuda.devs {
		opens, _ := d.ImportStats()
		n += opens
	}
	return n
}

// engineCount is how many engines a serves.
func engineCount(a *Agent) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.sessions)
}

// TestDeviceMemoryOneGPUPerAgent: once an engine registered memory on one
// device, memory on another is refused by name (one agent per GPU), and
// leaves no mapping.
func TestDeviceMemoryOneGPUPerAgent(t *testing.T) {
	exp := cudafake.New(cudafake.Config{Devices: 2})
	imp := cudafake.New(cudafake.Config{PID: os.Getpid() + 1<<22, Devices: 2})
	sock := startCUDAAgent(t, "gpu", imp)
	registerDevice(t, sock, exp, tinyLayout(), 3) // on device 0
	require.Equal(t, 2, imp.Stats().Imports)

	register := func(sel string, name func(cuda.UUID) string) (string, error) {
		uuid, _, err := registerKVOn(t, sock, exp, sel, 0, name)
		return uuid, err
	}
	uuid, err := register("1", cuda.UUID.String)
	require.ErrorContains(t, err, "memory on device "+uuid+" needs an agent of its own")
	require.Equal(t, 2, imp.Stats().Imports)

	// Device 0 named in another spelling (no "GPU-", upper case) is the
	// agent's device.
	_, err = register("0", func(u cuda.UUID) string { return strings.ToUpper(strings.TrimPrefix(u.String(), "GPU-")) })
	require.NoError(t, err)
}

// An agent's GPU is the one of the engines it serves: a registration
// that failed holds none, and once the last engine on a GPU went, another
// GPU's engine is served (found in review: the first device named stayed
// the agent's until it restarted, even when its registration failed).
func TestDeviceMemoryGPUHeldWhileUsed(t *testing.T) {
	exp := cudafake.New(cudafake.Config{Devices: 2})
	imp := cudafake.New(cudafake.Config{PID: os.Getpid() + 1<<22, Devices: 2})
	sock := startCUDAAgent(t, "gpu", imp)
	p, err := compile(tinyLayout(), false)
	require.NoError(t, err)
	register := func(sel string, size uint64) (*Client, error) {
		_, c, err := registerKVOn(t, sock, exp, sel, size, cuda.UUID.String)
		return c, err
	}
	_, err = register("1", uint64(p.kvBytes())-4096) // the pool runs past its allocation
	require.ErrorIs(t, err, ErrInvalidLayout)
	c0, err := register("0", uint64(p.kvBytes()))
	require.NoError(t, err, "a failed registration on device 1 held the agent's GPU")
	_, err = register("1", uint64(p.kvBytes()))
	require.ErrorContains(t, err, "needs an agent of its own", "device 0 is in use")
	c0.Close()
	require.Eventually(t, func() bool {
		_, err = register("1", uint64(p.kvBytes()))
		return err == nil
	}, 5*time.Second, 50*time.Millisecond, "the last engine on device 0 went: %v", err)
}

// registerKVOn registers, with the agent at sock, tinyLayout's KV pool in
// an allocation of size bytes (0: the pool's) on the exporter's device sel,
// naming the device as name spells it, and its Mamba pool in host memory.
// It returns the device's UUID and the engine's connection.
func registerKVOn(t *testing.T, sock string, exp cuda.Driver, sel string, size uint64, name func(cuda.UUID) string) (string, *Client, error) {
	t.Helper()
	l := tinyLayout()
	p, err := compile(l, false)
	require.NoError(t, err)
	if size == 0 {
		size = uint64(p.kvBytes())
	}
	d, err := cuda.OpenDevice(exp, sel)
	require.NoError(t, err)
	t.Cleanup(func() { d.Close() })
	a, err := d.NewArena(size)
	require.NoError(t, err)
	t.Cleanup(func() { a.Free() })
	x, err := a.Export()
	require.NoError(t, err)
	c, err := Dial(context.Background(), sock)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	mfd, _ := memfd(t, p.mambaBytes())
	_, err = c.Call(ctxT(t), Request{Op: OpRegister, Layout: &l, KVBytes: p.kvBytes(), MambaBytes: p.mambaBytes(),
		KVCUDA: &CUDAMemory{Handle: x.Handle.Reserved[:], Device: name(d.UUID())}}, []int{mfd})
	return d.UUID().String(), c, err
}
