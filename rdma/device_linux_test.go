package rdma

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
)

// testDriver is the CUDA driver of this test process: a fake with two
// devices in one address space and the real driver's rules (cudafake), or
// with HANDOFF_CUDA_REAL=1 the real libcuda.so.1 (scripts/gpu-check).
var testDriver = sync.OnceValue(func() cuda.Driver {
	if realDriver() {
		drv, err := cuda.Open()
		if err == nil {
			// The driver opens descriptors and threads of its own on first
			// use and keeps them while a primary context lives: hold one
			// for the process, before any test takes its leak baselines.
			warm, err = cuda.OpenDevice(drv, "0")
		}
		if err != nil {
			panic(fmt.Sprintf("HANDOFF_CUDA_REAL=1: %v", err))
		}
		return drv
	}
	return cudafake.New(cudafake.Config{Devices: 2})
})

var warm *cuda.Device // real driver only: see testDriver

func realDriver() bool { return os.Getenv("HANDOFF_CUDA_REAL") == "1" }

// fakeDriver returns the fake, or nil over the real driver.
func fakeDriver() *cudafake.Driver {
	f, _ := testDriver().(*cudafake.Driver)
	return f
}

// devicePairCases are the conformance cases with device memory: the
// receiver's region on device 0, the writer's on device 1.
func devicePairCases() []pairCase {
	if realDriver() {
		testDriver() // before any pair takes its leak baselines
	}
	return []pairCase{
		{"inproc-cuda", TransportInproc, MemoryCUDA, MemoryCUDA},
		{"inproc-host-to-cuda", TransportInproc, MemoryCUDA, MemoryHost},
		{"inproc-cuda-to-host", TransportInproc, MemoryHost, MemoryCUDA},
		{"tcp-cuda", TransportTCP, MemoryCUDA, MemoryCUDA},
		{"tcp-host-to-cuda", TransportTCP, MemoryCUDA, MemoryHost},
		{"tcp-cuda-to-host", TransportTCP, MemoryHost, MemoryCUDA},
		{"cuda-ipc", TransportCUDAIPC, MemoryCUDA, MemoryCUDA},
	}
}

// deviceRegion registers a zeroed device region of size bytes on device
// ordinal of the fake driver; release frees it and closes the device, once
// the engine closed.
func deviceRegion(t testing.TB, e *Engine, name string, size int64, ordinal int) (*Region, func()) {
	t.Helper()
	drv := testDriver()
	require.NoError(t, drv.Init(0))
	n, err := drv.DeviceGetCount()
	require.NoError(t, err)
	d, err := cuda.OpenDevice(drv, strconv.Itoa(ordinal%n)) // one GPU serves both ends

	require.NoError(t, err)
	a, err := d.NewArena(uint64(size))
	require.NoError(t, err)
	r, err := e.RegisterDevice(name, a)
	require.NoError(t, err)
	return r, func() {
		require.NoError(t, a.Free())
		require.NoError(t, d.Close())
	}
}

func bufFor(size uint64, pid int) cuda.IPCBuffer {
	return cuda.IPCBuffer{Base: 1 << 40, Size: size, BufferID: 1, PID: pid}
}

// TestDevicePaths checks which way device bytes went for each device case:
// staged through pinned buffers on the side(s) in device memory over tcp,
// pulled by the receiver over cuda-ipc, neither inproc.
func TestDevicePaths(t *testing.T) {
	for _, c := range devicePairCases() {
		t.Run(c.name, func(t *testing.T) {
			p := newPairCase(t, c, false, false)
			ctx := context.Background()
			dst := dstExtents()
			g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dst})
			require.NoError(t, err)
			tk := g.Ticket()
			_, err = p.tx.Write(ctx, p.desc, tk, srcExtents(tk.Bytes))
			require.NoError(t, err)
			_, err = g.Wait(ctx)
			require.NoError(t, err)
			require.Equal(t, concat(p.src, srcExtents(tk.Bytes)), concat(p.dst, dst))
			rs, ts := p.rx.Stats(), p.tx.Stats()
			var rxStaged, txStaged, pulled uint64
			switch c.t {
			case TransportTCP:
				if c.rx == MemoryCUDA {
					rxStaged = tk.Bytes
				}
				if c.tx == MemoryCUDA {
					txStaged = tk.Bytes
				}
			case TransportCUDAIPC:
				pulled = tk.Bytes
			}
			require.Equal(t, rxStaged, rs.BytesStaged, "receiver staged")
			require.Equal(t, txStaged, ts.BytesStaged, "writer staged")
			require.Equal(t, pulled, rs.BytesPulled, "receiver pulled")
		})
	}
}

// TestDeviceForbiddenRows: reserved rows of a device region are refused at
// the data plane exactly as in host memory.
func TestDeviceForbiddenRows(t *testing.T) {
	p := newPairCase(t, pairCase{"cuda-ipc", TransportCUDAIPC, MemoryCUDA, MemoryCUDA}, false, false)
	p.dst.Forbid(0, 4096) // the ADP dummy row, say
	_, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{Region: p.dst.ID(), Offset: 4000, Length: 200}}})
	require.ErrorIs(t, err, ErrForbidden)
	require.Equal(t, MemoryCUDA, p.dst.Memory())
	require.Nil(t, p.dst.Bytes())
	d := p.rx.Descriptor()
	require.Equal(t, MemoryCUDA, d.Regions[0].Memory)
	require.NotEmpty(t, d.IPCNamespace)
	require.NotEmpty(t, d.CUDADevices)
}

// TestDeviceTransportChoice: with every transport served, two device
// engines on one host pick cuda-ipc, and a host engine and a device engine
// pick tcp (shm maps memfds only).
func TestDeviceTransportChoice(t *testing.T) {
	for _, tc := range []struct {
		name   string
		rx, tx Memory
		want   Transport
	}{
		{"both device", MemoryCUDA, MemoryCUDA, TransportCUDAIPC},
		{"host writer", MemoryCUDA, MemoryHost, TransportTCP},
		{"host receiver", MemoryHost, MemoryCUDA, TransportTCP},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var free []func()
			defer func() {
				for _, f := range free {
					f()
				}
			}()
			engine := func(agent string, m Memory, ordinal int) *Engine {
				e, err := New(Config{Agent: AgentID(agent), Transports: []Transport{TransportCUDAIPC, TransportSHM, TransportTCP}, Logger: quietLogger()})
				require.NoError(t, err)
				if m == MemoryCUDA {
					_, f := deviceRegion(t, e, "r", 1<<20, ordinal)
					free = append(free, f)
				} else {
					_, err := e.Register("r", 1<<20)
					require.NoError(t, err)
				}
				free = append([]func(){func() { require.NoError(t, e.Close()) }}, free...)
				return e
			}
			rx := engine("choice-rx", tc.rx, 0)
			tx := engine("choice-tx", tc.tx, 1)
			got, err := tx.Connect(context.Background(), rx.Descriptor())
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

// TestHelperDeviceWriter is the child of TestCrossProcessCUDAIPC: a writer
// whose source is a device allocation of its own fake driver (another
// process's "device memory", reached only through the exported handle). It
// does nothing in a normal run.
func TestHelperDeviceWriter(t *testing.T) {
	raw := os.Getenv("RDMA_DEVICE_JOB")
	if raw == "" {
		t.Skip("helper process for TestCrossProcessCUDAIPC")
	}
	var job helperJob
	require.NoError(t, json.Unmarshal([]byte(raw), &job))
	e, err := New(Config{Agent: "device-writer", Transports: []Transport{job.Transport}, Logger: quietLogger()})
	require.NoError(t, err)
	src, release := deviceRegion(t, e, "src", int64(job.Ticket.Bytes), 1)
	defer release()
	defer e.Close()
	b := make([]byte, job.Ticket.Bytes)
	for i := range b {
		b[i] = helperPattern(i)
	}
	setRegion(src, b)
	ctx := context.Background()
	tr, err := e.Connect(ctx, job.Peer)
	require.NoError(t, err)
	fmt.Printf("connected %s\n", tr)
	m, err := e.Write(ctx, job.Peer, job.Ticket, []Extent{{Region: src.ID(), Offset: 0, Length: job.Ticket.Bytes}})
	if err != nil {
		fmt.Printf("error %v\n", err)
		return
	}
	out, _ := json.Marshal(m)
	fmt.Printf("manifest %s\n", out)
}

// TestCrossProcessCUDAIPC: a writer in another process whose source is in
// its device memory writes into this process's device region over
// cuda-ipc: the receiver opens the writer's handle (the fake maps the
// writer's memfd through /proc), copies device to device, checks the
// manifest over its own bytes, and closes the mapping once the writer's
// connections are gone.
func TestCrossProcessCUDAIPC(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns processes")
	}
	rx, err := New(Config{Agent: "cross-ipc-rx", Transports: []Transport{TransportCUDAIPC}, Logger: quietLogger()})
	require.NoError(t, err)
	dst, release := deviceRegion(t, rx, "dst", 4<<20, 0)
	defer release()
	defer rx.Close()
	fillRegion(dst, canary)
	fake := fakeDriver()
	var imports int
	if fake != nil {
		imports = fake.Stats().Imports
	}
	exts := []Extent{{1, 100, 1 << 20}, {1, 2 << 20, 512 << 10}, {1, 3 << 20, 4096}}
	g, err := rx.OpenGrant(GrantSpec{RequestID: 12, Extents: exts, Deadline: time.Now().Add(time.Minute)})
	require.NoError(t, err)
	job := helperJob{Transport: TransportCUDAIPC, Peer: rx.Descriptor(), Ticket: g.Ticket()}
	raw, err := json.Marshal(job)
	require.NoError(t, err)
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperDeviceWriter$", "-test.v")
	cmd.Env = append(os.Environ(), "RDMA_DEVICE_JOB="+string(raw))
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	sc := bufio.NewScanner(out)
	var lines []string
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	require.NoError(t, cmd.Wait())
	require.Contains(t, lines, "connected cuda-ipc", "%q", lines)
	var m Manifest
	for _, l := range lines {
		if len(l) > 9 && l[:9] == "manifest " {
			require.NoError(t, json.Unmarshal([]byte(l[9:]), &m))
		}
	}
	require.NotEmpty(t, m.Bytes, "the writer reported no manifest: %q", lines)
	got, err := g.Wait(context.Background())
	require.NoError(t, err)
	require.Equal(t, m, got)
	mem := regionBytes(dst)
	i := 0
	for _, x := range exts {
		for j := range x.Length {
			require.Equal(t, helperPattern(i), mem[x.Offset+j], "byte %d of the write", i)
			i++
		}
	}
	for off, b := range mem {
		inside := false
		for _, x := range exts {
			inside = inside || uint64(off) >= x.Offset && uint64(off) < x.Offset+x.Length
		}
		if !inside && b != canary {
			t.Fatalf("byte %d outside the grant changed to %#x", off, b)
		}
	}
	require.Equal(t, total(exts), rx.Stats().BytesPulled)
	require.Zero(t, rx.Stats().BytesStaged)
	if fake == nil {
		return // the real driver does not say what it has mapped
	}
	// The writer exited: its mapping is closed once its connection ended.
	start := time.Now()
	deadline := start.Add(5 * time.Second)
	defer func() { t.Logf("mapping closed %s after the writer exited", time.Since(start)) }()
	for fake.Stats().Imports != imports {
		require.True(t, time.Now().Before(deadline), "the gone writer's cuda-ipc mapping stays open")
		time.Sleep(5 * time.Millisecond)
	}
}

// BenchmarkDeviceWrite moves 32 MiB from a device region into another per
// write, over each transport that takes device memory, with and without
// crc32c (which device-to-device copies pay for with a read-back). On a GPU
// (HANDOFF_CUDA_REAL=1, scripts/gpu-check) cuda-ipc against inproc's
// device-local copy is the ratio that matters; over the fake every copy is
// a memcpy.
func BenchmarkDeviceWrite(b *testing.B) {
	const size = 32 << 20
	for _, tr := range []Transport{TransportInproc, TransportCUDAIPC, TransportTCP} {
		for _, skip := range []bool{false, true} {
			b.Run(fmt.Sprintf("%s/skipcrc=%v", tr, skip), func(b *testing.B) {
				rx, err := New(Config{Agent: AgentID("bench-rx-" + b.Name()), Transports: []Transport{tr}, Logger: quietLogger(), SkipCRC: skip})
				require.NoError(b, err)
				tx, err := New(Config{Agent: AgentID("bench-tx-" + b.Name()), Transports: []Transport{tr}, Logger: quietLogger(), SkipCRC: skip})
				require.NoError(b, err)
				dst, freeDst := deviceRegion(b, rx, "dst", size, 0)
				src, freeSrc := deviceRegion(b, tx, "src", size, 1)
				defer func() {
					require.NoError(b, tx.Close())
					require.NoError(b, rx.Close())
					freeSrc()
					freeDst()
				}()
				got, err := tx.Connect(context.Background(), rx.Descriptor())
				require.NoError(b, err)
				require.Equal(b, tr, got)
				b.SetBytes(size)
				b.ResetTimer()
				for i := 0; b.Loop(); i++ {
					g, err := rx.OpenGrant(GrantSpec{RequestID: uint64(i + 1), Extents: []Extent{{dst.ID(), 0, size}}})
					require.NoError(b, err)
					if _, err := tx.Write(context.Background(), rx.Descriptor(), g.Ticket(), []Extent{{src.ID(), 0, size}}); err != nil {
						b.Fatal(err)
					}
					if _, err := g.Wait(context.Background()); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
