//go:build linux

package service

import (
	"errors"
	"io"
	"net/http"
	"os"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/worker"
)

// TestDeviceMemoryMatchesLocal runs the oracle with the caches in device
// memory (a fake CUDA driver with two devices, shared by the workers of
// this process; the real driver with HANDOFF_CUDA_REAL=1): prefill and
// decode on devices 1 and 0 over cuda-ipc, and a host-memory prefill
// writing into a device-memory decode over tcp (staged), each also with
// tensor-parallel shards on one side. Every output must
// equal a host-memory local decode's, so every transferred byte landed
// where the model reads it through the driver.
func TestDeviceMemoryMatchesLocal(t *testing.T) {
	fake := cudafake.New(cudafake.Config{Devices: 2})
	var drv cuda.Driver = fake
	prefillDevice := "1"
	if os.Getenv("HANDOFF_CUDA_REAL") == "1" {
		real, err := cuda.Open()
		require.NoError(t, err)
		drv, fake = real, nil
		require.NoError(t, drv.Init(0))
		if n, err := drv.DeviceGetCount(); err != nil || n < 2 {
			prefillDevice = "0" // one GPU holds both workers' caches
		}
	}
	withFake := func(o *Options) { o.CUDA = func() (cuda.Driver, error) { return drv, nil } }
	ns := natstest.Run(t)
	lep, _ := startWorker(t, testConfig(t, worker.RoleDecode, "--prefill", "local", "--dp-size", "2", "--max-batch-size", "1"))
	adp := []string{"--dp-size", "2"}
	for _, tc := range []struct {
		name, transport string
		prefill, decode []string
	}{
		{"cuda-ipc", "cuda-ipc", append([]string{"--memory", "cuda", "--cuda-device", prefillDevice}, adp...), adp},
		{"host-prefill-tcp", "tcp", append([]string{"--memory", "host"}, adp...), adp},
		// Tensor parallelism in device memory: every shard's pools on the
		// device, resharded on the way (2 → 1 over cuda-ipc, 1 → 2 into a
		// device-memory decode over tcp).
		{"tp2-to-tp1-cuda-ipc", "cuda-ipc", []string{"--memory", "cuda", "--cuda-device", prefillDevice, "--tp-size", "2", "--dp-size", "1"}, []string{"--dp-size", "1"}},
		{"host-tp1-to-tp2-tcp", "tcp", []string{"--memory", "host", "--dp-size", "1"}, []string{"--tp-size", "2", "--dp-size", "1"}},
		// Speculative decoding in device memory: each verification keeps
		// the row's state in the scratch row and rolls back there, on one
		// device rank and on a TP group's device shards.
		{"speculative-cuda-ipc", "cuda-ipc", append([]string{"--memory", "cuda", "--cuda-device", prefillDevice}, adp...),
			append([]string{"--speculative", "ngram", "--num-speculative-tokens", "3"}, adp...)},
		{"speculative-tp2-tcp", "tcp", []string{"--memory", "host", "--dp-size", "1"},
			[]string{"--tp-size", "2", "--dp-size", "1", "--speculative", "ngram", "--num-speculative-tokens", "3"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			common := []string{"--nats-url", ns.ClientURL(), "--transport", tc.transport, "--max-batch-size", "1",
				"--namespace", "device-" + tc.name}
			pep, _ := startWorker(t, testConfig(t, worker.RolePrefill, append(common, tc.prefill...)...), withFake)
			rep, _ := startWorker(t, testConfig(t, worker.RoleDecode, append(append(common, "--prefill", "remote", "--memory", "cuda", "--cuda-device", "0"), tc.decode...)...), withFake)
			for k, p := range prompts {
				remote, local := complete(t, rep.HTTP, p, 10, 0, k), complete(t, lep.HTTP, p, 10, 0, k)
				require.Equal(t, http.StatusOK, remote.status, remote.text)
				require.Equal(t, local, remote, "request %d with device memory differs from local", k)
			}
			if slices.Contains(tc.decode, "--speculative") {
				require.Positive(t, metricValue(t, rep.Admin, `handoff_spec_accepted_tokens_total{method="ngram",role="decode"}`))
				require.Less(t, metricValue(t, rep.Admin, `handoff_spec_accepted_tokens_total{method="ngram",role="decode"}`),
					metricValue(t, rep.Admin, `handoff_spec_draft_tokens_total{method="ngram",role="decode"}`), "rollbacks happened")
			}
			require.Equal(t, 1.0, metricValue(t, pep.Admin, `handoff_transport_info{transport="`+tc.transport+`"}`))
			require.Equal(t, float64(len(prompts)), metricValue(t, rep.Admin, `handoff_transfers_total{result="ok",role="decode"}`))
		})
	}
	if fake != nil {
		t.Cleanup(func() { // after the workers' own cleanups stopped them
			require.Zero(t, fake.Stats().Allocs, "every arena freed once the workers stopped")
		})
	}
}

// TestDeviceMemoryWithoutDriver: --memory cuda without a usable driver
// fails at start-up by name; host memory never loads the driver.
func TestDeviceMemoryWithoutDriver(t *testing.T) {
	noDriver := func(o *Options) {
		o.CUDA = func() (cuda.Driver, error) { return nil, cuda.ErrNoDriver }
	}
	cfg := testConfig(t, worker.RoleDecode, "--prefill", "local", "--memory", "cuda")
	o := Options{Stdout: io.Discard, Stderr: io.Discard}
	noDriver(&o)
	err := RunDecode(t.Context(), cfg, o)
	require.True(t, errors.Is(err, cuda.ErrNoDriver), "%v", err)
	loaded := false
	startWorker(t, testConfig(t, worker.RoleDecode, "--prefill", "local"), func(o *Options) {
		o.CUDA = func() (cuda.Driver, error) { loaded = true; return nil, cuda.ErrNoDriver }
	})
	require.False(t, loaded, "host memory loaded the driver")
}
