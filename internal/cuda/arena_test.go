//go:build linux && (amd64 || arm64)

package cuda_test

import (
	"bytes"
	"errors"
	"io"
	"testing"

	"github.com/handoff-io/handoff/internal/cuda"
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
