package config

import (
	"errors"
	"io"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/worker"
)

func TestMemoryFlags(t *testing.T) {
	env := func(kv map[string]string) func(string) string { return func(k string) string { return kv[k] } }
	for _, role := range []worker.Role{worker.RolePrefill, worker.RoleDecode} {
		c, err := Parse(role, nil, env(nil), io.Discard)
		require.NoError(t, err)
		require.Equal(t, "host", c.Memory, "host memory by default")
		require.Equal(t, "0", c.CUDADevice)

		c, err = Parse(role, []string{"--memory", "CUDA", "--cuda-device", "GPU-8f3a2b1c-0000-0000-0000-000000000001"}, env(nil), io.Discard)
		require.NoError(t, err)
		require.Equal(t, "cuda", c.Memory)
		require.Equal(t, "GPU-8f3a2b1c-0000-0000-0000-000000000001", c.CUDADevice)

		c, err = Parse(role, []string{"--transport", "cuda-ipc"}, env(map[string]string{"HANDOFF_MEMORY": "cuda", "HANDOFF_CUDA_DEVICE": "1"}), io.Discard)
		require.NoError(t, err)
		require.Equal(t, "cuda", c.Memory)
		require.Equal(t, "1", c.CUDADevice)
		require.Equal(t, "cuda-ipc", c.Transport)

		c, err = Parse(role, []string{"--memory", "cuda", "--tp-size", "2", "--dp-size", "1"}, env(nil), io.Discard)
		require.NoError(t, err, "every shard's pools in device memory")
		require.Equal(t, 2, c.TPSize)

		for _, bad := range [][]string{
			{"--memory", "gpu"},
			{"--transport", "cuda-ipc"}, // host memory has nothing to pull
		} {
			_, err := Parse(role, bad, env(nil), io.Discard)
			require.True(t, errors.Is(err, ErrInvalid), "%v: %v", bad, err)
		}
	}
}
