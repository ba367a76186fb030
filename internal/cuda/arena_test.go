//go:build linux && (amd64 || arm64)

package cuda_test

import (
	"bytes"
	"errors"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
)

func TestArenaReadWriteAt(t *testing.T) {
	eachDriver(t, func(t *testing.T, _ string, drv cuda.Driver) {
		d := openDev(t, drv, "0")
		const n = 5<<20 + 3
		a, err := d.NewArena(n)
		if err != nil {
			t.Fatal(err)
		}
		defer a.Free() //nolint:errcheck
		tail := make([]byte, 16)
		if _, err := a.ReadAt(tail, n-16); err != nil || !bytes.Equal(tail, make([]byte, 16)) {
			t.Fatalf("a new arena is not zeroed at its end: %v %x", err, tail)
		}
		row := fill(4096, 5)
		if k, err := a.WriteAt(row, 1<<20); err != nil || k != len(row) {
			t.Fatalf("WriteAt: %d, %v", k, err)
		}
		got := make([]byte, len(row))
		if _, err := a.ReadAt(got, 1<<20); err != nil || !bytes.Equal(got, row) {
			t.Fatalf("ReadAt after WriteAt: %v", err)
		}
		if k, err := a.ReadAt(make([]byte, 10), n-4); k != 4 || !errors.Is(err, io.EOF) {
			t.Errorf("read across the end: %d, %v; want 4, EOF", k, err)
		}
		if _, err := a.WriteAt(make([]byte, 10), n-4); !errors.Is(err, cuda.ErrInvalidValue) {
			t.Errorf("write across the end: %v", err)
		}
		x, err := a.Export()
		if err != nil || x.Size < n || x.Base != a.Ptr() {
			t.Errorf("export %+v, %v", x, err)
		}
	})
}

// TestArenaOpenIPC: an arena opened from another process's export (a
// second fake driver with another pid) at an offset reads and writes the
// exporter's bytes there; a range past the allocation is refused; Free
// closes the mapping and leaves the exporter's allocation.
func TestArenaOpenIPC(t *testing.T) {
	exp := cudafake.New(cudafake.Config{})
	imp := cudafake.New(cudafake.Config{PID: os.Getpid() + 1<<22})
	de, di := openDev(t, exp, "0"), openDev(t, imp, "0")
	a, b := exported(t, de, 1<<20)
	if _, err := di.OpenIPC(b.Handle, b.PID, 1<<19, 1<<19+1); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("a range past the allocation: %v", err)
	}
	if n := imp.Stats().Imports; n != 0 {
		t.Fatalf("a refused open left %d mappings", n)
	}
	o, err := di.OpenIPC(b.Handle, b.PID, 4096, 8192)
	if err != nil {
		t.Fatal(err)
	}
	row := fill(8192, 9)
	if _, err := o.WriteAt(row, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 8192)
	if _, err := a.ReadAt(got, 4096); err != nil || !bytes.Equal(got, row) {
		t.Fatalf("the exporter reads at the offset: %v", err)
	}
	// The opened arena exports the exporter's handle, so that a third
	// process opens the allocation itself; a view of it says where it
	// starts there.
	v, err := o.View(1024, 2048)
	if err != nil {
		t.Fatal(err)
	}
	x, err := v.Export()
	if err != nil || x.Handle != b.Handle || x.PID != b.PID || x.Offset != 4096+1024 || x.Size != b.Size {
		t.Fatalf("export of a view of an opened arena: %+v, %v", x, err)
	}
	third := cudafake.New(cudafake.Config{PID: os.Getpid() + 2<<22})
	dt := openDev(t, third, "0")
	p, err := dt.Import(x)
	if err != nil {
		t.Fatal(err)
	}
	part := make([]byte, 2048)
	if err := dt.CopyFromDevice(part, p+cuda.DevicePtr(x.Offset)); err != nil || !bytes.Equal(part, row[1024:1024+2048]) {
		t.Fatalf("a third process reads the exporter's bytes at the export's offset: %v", err)
	}
	if err := dt.ForgetPeer(x.PID); err != nil {
		t.Fatal(err)
	}
	if err := o.Free(); err != nil {
		t.Fatal(err)
	}
	if n := imp.Stats().Imports; n != 0 {
		t.Fatalf("Free left %d mappings", n)
	}
	// Mapped again (as by the next process at the same address), it
	// exports under another buffer id: a peer's cached mapping is stale.
	o2, err := di.OpenIPC(b.Handle, b.PID, 0, 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer o2.Free() //nolint:errcheck
	if x2, err := o2.Export(); err != nil || x2.BufferID == x.BufferID {
		t.Fatalf("re-export after a new mapping: %+v, %v (first buffer id %d)", x2, err, x.BufferID)
	}
	// Without the exporter's pid, an opened arena does not export.
	o3, err := openDev(t, cudafake.New(cudafake.Config{PID: os.Getpid() + 3<<22}), "0").OpenIPC(b.Handle, 0, 0, 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer o3.Free() //nolint:errcheck
	if _, err := o3.Export(); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("export without the exporter's pid: %v", err)
	}
	if _, err := a.ReadAt(got, 4096); err != nil || !bytes.Equal(got, row) {
		t.Fatalf("the exporter's allocation after the importer's Free: %v", err)
	}
}

// TestImportSharesOpenedHandle: a process that opened an allocation with
// OpenIPC and then Imports it (a pull naming the same handle) gets the same
// mapping, since the driver refuses a second open of a handle in one
// process; the mapping is closed only once both let it go, in either order.
func TestImportSharesOpenedHandle(t *testing.T) {
	exp := cudafake.New(cudafake.Config{})
	de := openDev(t, exp, "0")
	_, b := exported(t, de, 1<<20)
	for _, freeFirst := range []bool{true, false} {
		imp := cudafake.New(cudafake.Config{PID: os.Getpid() + 1<<22})
		di := openDev(t, imp, "0")
		o, err := di.OpenIPC(b.Handle, b.PID, 4096, 8192)
		if err != nil {
			t.Fatal(err)
		}
		di.RetainPeer(b.PID)
		p, err := di.Import(b)
		if err != nil {
			t.Fatalf("import of a handle opened by OpenIPC: %v", err)
		}
		if p+4096 != o.Ptr() || imp.Stats().Imports != 1 {
			t.Fatalf("import at %#x, arena at %#x, %d mappings: want one, shared", p, o.Ptr(), imp.Stats().Imports)
		}
		first, second := o.Free, func() error { return di.ReleasePeer(b.PID) }
		if !freeFirst {
			first, second = second, first
		}
		if err := first(); err != nil {
			t.Fatal(err)
		}
		if freeFirst {
			if err := o.Free(); !errors.Is(err, cuda.ErrInvalidValue) {
				t.Fatalf("a second Free: %v", err)
			}
		}
		if n := imp.Stats().Imports; n != 1 {
			t.Fatalf("free first %v: the other user's mapping was closed (%d left)", freeFirst, n)
		}
		if err := second(); err != nil {
			t.Fatal(err)
		}
		if n := imp.Stats().Imports; n != 0 {
			t.Fatalf("free first %v: %d mappings left after both let go", freeFirst, n)
		}
	}
}

// What a peer tells Import and what an engine hands OpenIPC is checked
// against the driver: an allocation smaller than the peer claims (cached
// or not) and an address of this process that is no allocation's base are
// refused, as is an arena (OpenIPC) in memory of a device other than the
// one opened, and nothing stays mapped; a pull's source (Import) may be on
// another device.
func TestIPCClaimsChecked(t *testing.T) {
	exp := cudafake.New(cudafake.Config{Devices: 2})
	imp := cudafake.New(cudafake.Config{Devices: 2, PID: os.Getpid() + 1<<22})
	de, di := openDev(t, exp, "0"), openDev(t, imp, "0")
	_, b := exported(t, de, 1<<20)
	big := b
	big.Size = b.Size + 1
	if _, err := di.Import(big); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("a claim past the allocation, first import: %v", err)
	}
	if n := imp.Stats().Imports; n != 0 {
		t.Fatalf("the refused import left %d mappings", n)
	}
	if _, err := di.Import(b); err != nil {
		t.Fatal(err)
	}
	if _, err := di.Import(big); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("a claim past the allocation, cached: %v", err)
	}

	// This process's own: the base of an allocation it holds, no more.
	_, ob := exported(t, di, 1<<16)
	if p, err := di.Import(ob); err != nil || p != ob.Base {
		t.Fatalf("this process's own allocation: %#x, %v", p, err)
	}
	for _, bad := range []cuda.IPCBuffer{
		{PID: ob.PID, Base: ob.Base + 4096, Size: 4096, Device: ob.Device},
		{PID: ob.PID, Base: ob.Base, Size: ob.Size + 1, Device: ob.Device},
		{PID: ob.PID, Base: 0x7000_0000_0000, Size: 4096, Device: ob.Device},
	} {
		if _, err := di.Import(bad); err == nil {
			t.Fatalf("an address of this process that no allocation of that size starts at: %+v", bad)
		}
	}

	// Memory on the exporter's device 1, opened by a Device on device 0.
	de1 := openDev(t, exp, "1")
	_, b1 := exported(t, de1, 1<<16)
	before := imp.Stats().Imports
	if _, err := di.OpenIPC(b1.Handle, b1.PID, 0, 4096); !errors.Is(err, cuda.ErrInvalidValue) || !strings.Contains(err.Error(), "on device 1") {
		t.Fatalf("memory of another device: %v", err)
	}
	if n := imp.Stats().Imports; n != before {
		t.Fatalf("the refusal left %d mappings more", n-before)
	}
	di1 := openDev(t, imp, "1")
	o1, err := di1.OpenIPC(b1.Handle, b1.PID, 0, 4096)
	if err != nil {
		t.Fatalf("the same memory from its own device: %v", err)
	}
	if err := o1.Free(); err != nil {
		t.Fatal(err)
	}
	// A pull's source may be another GPU's memory (peer access).
	if _, err := di.Import(b1); err != nil {
		t.Fatalf("memory of another device, imported for a pull: %v", err)
	}
}

// exported allocates size bytes on d, freed when the test ends, and
// describes them for CUDA IPC.
func exported(t *testing.T, d *cuda.Device, size uint64) (*cuda.Arena, cuda.IPCBuffer) {
	t.Helper()
	a, err := d.NewArena(size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Free() })
	b, err := a.Export()
	if err != nil {
		t.Fatal(err)
	}
	return a, b
}
