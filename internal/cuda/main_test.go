//go:build linux && (amd64 || arm64)

package cuda_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
	"github.com/handoff-io/handoff/internal/cuda/cudatest"
)

// The fake libcuda.so.1 variants, built once per test binary from
// testdata/fakecuda.c (env, so child processes find them).
const (
	libEnv   = "CUDATEST_FAKELIB_DIR"
	realEnv  = "HANDOFF_CUDA_REAL" // 1: also run the suites over the real driver
	childLib = "CUDATEST_LIB"      // which driver a child process opens
)

var libDir, libErr = os.Getenv(libEnv), error(nil)

func fakeLib(variant string) string { return filepath.Join(libDir, variant, "libcuda.so.1") }

// openFor returns the opener a child process uses, named by childLib.
func openFor(name string) func() (cuda.Driver, error) {
	switch name {
	case "real":
		return cuda.Open
	case "go":
		return func() (cuda.Driver, error) { return cudafake.New(cudafake.Config{}), nil }
	default:
		return func() (cuda.Driver, error) { return cuda.Load(fakeLib("default")) }
	}
}

func TestMain(m *testing.M) {
	if libDir != "" {
		cudatest.Child(openFor(os.Getenv(childLib)))
		childMain()
	}
	dir, err := os.MkdirTemp("", "fakecuda")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	libDir, libErr = dir, buildFakes(dir)
	os.Setenv(libEnv, dir)
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func buildFakes(dir string) error {
	name := "cc"
	if f := strings.Fields(os.Getenv("CC")); len(f) > 0 {
		name = f[0]
	}
	cc, err := exec.LookPath(name)
	if err != nil {
		return fmt.Errorf("no C compiler (%s) to build testdata/fakecuda.c: %v", name, err)
	}
	for variant, def := range map[string]string{"default": "", "stub": "-DFORCE_STUB", "old": "-DOMIT_MEMALLOC_V2"} {
		out := filepath.Join(dir, variant, "libcuda.so.1")
		if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
			return err
		}
		args := []string{"-O1", "-shared", "-fPIC", "-fvisibility=hidden", "-o", out, "testdata/fakecuda.c"}
		if def != "" {
			args = append(args, def)
		}
		if b, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
			return fmt.Errorf("%s %v: %v\n%s", cc, args, err, b)
		}
	}
	return nil
}

// needFake skips a test that needs the C fake where it could not be built.
func needFake(t *testing.T) {
	t.Helper()
	if libErr != nil {
		t.Skipf("fake libcuda.so.1 not built: %v", libErr)
	}
}

// needReal skips a test that needs the real driver unless asked for.
func needReal(t *testing.T) {
	t.Helper()
	if os.Getenv(realEnv) != "1" {
		t.Skipf("real-driver test: set %s=1 on a machine with an NVIDIA driver (scripts/gpu-check)", realEnv)
	}
}
