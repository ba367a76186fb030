//go:build linux && (amd64 || arm64)

package cudacheck_test

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudacheck"
	"github.com/handoff-io/handoff/internal/leakcheck"
)

func TestMain(m *testing.M) {
	cudacheck.Child()
	leakcheck.Main(m)
}

// TestRunOverFakeLib runs the whole check, IPC child included, through the
// purego loader over the C fake driver: what scripts/gpu-check runs on a
// GPU works end to end before one is at hand. Bandwidths over the fake
// mean nothing; the checksums and the report's shape do.
func TestRunOverFakeLib(t *testing.T) {
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skipf("no C compiler to build the fake libcuda.so.1: %v", err)
	}
	lib := filepath.Join(t.TempDir(), "libcuda.so.1")
	if out, err := exec.Command(cc, "-O1", "-shared", "-fPIC", "-fvisibility=hidden", "-o", lib, "../testdata/fakecuda.c").CombinedOutput(); err != nil {
		t.Fatalf("cc: %v\n%s", err, out)
	}
	rep, err := cudacheck.Run(context.Background(), cudacheck.Config{Library: lib, Device: "0", Size: 6 << 20, Repeat: 2,
		Self: []string{os.Args[0], "-test.run=^$"}})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.MarshalIndent(rep, "", "  ")
	t.Logf("report:\n%s", b)
	if !rep.OK {
		t.Fatalf("checks failed: %v", rep.Errors)
	}
	if rep.IPC == nil || !rep.IPC.ChecksumsOK || rep.IPC.OpenFirstUs <= 0 || rep.IPC.D2DGBps <= 0 {
		t.Errorf("ipc result %+v", rep.IPC)
	}
	if rep.Staged == nil || !rep.Staged.ChecksumsOK {
		t.Errorf("staged result %+v", rep.Staged)
	}
	if rep.GBps.D2D <= 0 || rep.GBps.H2DPinned <= 0 || rep.Device.UUID == "" {
		t.Errorf("report %+v", rep)
	}
}

func TestRunNoDriver(t *testing.T) {
	_, err := cudacheck.Run(context.Background(), cudacheck.Config{Library: "/nonexistent/libcuda.so.1", Size: 1 << 20, Repeat: 1})
	if !errors.Is(err, cuda.ErrNoDriver) {
		t.Fatalf("%v, want ErrNoDriver", err)
	}
}
