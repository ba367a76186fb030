//go:build linux && (amd64 || arm64)

package cuda_test

import (
	"bytes"
	"errors"
	"io"
	"os"
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
	a, err := de.NewArena(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Free() //nolint:errcheck
	b, err := a.Export()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := di.OpenIPC(b.Handle, 1<<19, 1<<19+1); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("a range past the allocation: %v", err)
	}
	if n := imp.Stats().Imports; n != 0 {
		t.Fatalf("a refused open left %d mappings", n)
	}
	o, err := di.OpenIPC(b.Handle, 4096, 8192)
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
	if err := o.Free(); err != nil {
		t.Fatal(err)
	}
	if n := imp.Stats().Imports; n != 0 {
		t.Fatalf("Free left %d mappings", n)
	}
	if _, err := a.ReadAt(got, 4096); err != nil || !bytes.Equal(got, row) {
		t.Fatalf("the exporter's allocation after the importer's Free: %v", err)
	}
}
