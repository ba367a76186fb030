//go:build integration

package integration

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// fakeLibCUDA builds internal/cuda's fake libcuda.so.1 from its C source
// (device memory backed by shared memfds, IPC handles opened across
// processes) and returns its path, or skips where no C compiler exists.
func fakeLibCUDA(t *testing.T) string {
	t.Helper()
	name := "cc"
	if f := strings.Fields(os.Getenv("CC")); len(f) > 0 {
		name = f[0]
	}
	cc, err := exec.LookPath(name)
	if err != nil {
		t.Skipf("no C compiler (%s) to build the fake libcuda.so.1: %v", name, err)
	}
	lib := filepath.Join(t.TempDir(), "libcuda.so.1")
	out, err := exec.Command(cc, "-O1", "-shared", "-fPIC", "-fvisibility=hidden", "-o", lib, "../internal/cuda/testdata/fakecuda.c").CombinedOutput()
	require.NoError(t, err, "%s", out)
	return lib
}

// TestRemoteEqualsLocalDeviceMemory is the oracle with both workers' caches
// in device memory (--memory cuda over the fake driver, which the binaries
// load through HANDOFF_LIBCUDA as they would libcuda.so.1): prefill and
// decode, two processes on one host, pick cuda-ipc, decode pulls each
// request's KV blocks and Mamba row out of prefill's exported allocations,
// and its output equals a host-memory local decode's token for token.
func TestRemoteEqualsLocalDeviceMemory(t *testing.T) {
	t.Setenv("HANDOFF_LIBCUDA", fakeLibCUDA(t))
	ns := startNATS(t, nil)
	pre := startProc(t, "prefill", "--nats-url", ns.url(), "--namespace", "oracle-cuda", "--memory", "cuda")
	remote := startProc(t, "decode", "--nats-url", ns.url(), "--namespace", "oracle-cuda", "--prefill", "remote", "--memory", "cuda")
	local := startProc(t, "decode", "--prefill", "local", "--nats-url", ns.url(), "--namespace", "oracle-cuda-local")
	pre.waitReady(readyWithin)
	remote.waitReady(readyWithin)
	local.waitReady(readyWithin)
	name := modelName(t, remote.api)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	warmUp(ctx, t, remote.api, name)
	before := sum(remote.metrics(), "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"})
	prompts := randomPrompts(12, 11)
	requireSameAnswers(ctx, t, remote.api, local.api, name, prompts, 12, "device-memory remote and host local")
	mf := remote.metrics()
	require.Equal(t, float64(len(prompts)), sum(mf, "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"})-before)
	require.Equal(t, 1.0, sum(pre.metrics(), "handoff_transport_info", map[string]string{"transport": "cuda-ipc"}), "prefill's transport")
	require.Contains(t, pre.log.String(), `"transport":"cuda-ipc"`)
	require.Contains(t, remote.log.String(), "caches in device memory")
	requireIdle(t, remote, "decode")
	requireIdle(t, pre, "prefill")
}
