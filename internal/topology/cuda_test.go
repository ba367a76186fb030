package topology

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestGPUByUUID(t *testing.T) {
	topo := hgx()
	topo.GPUs[0].UUID = "GPU-6a1f0e3c-1111-2222-3333-444455556666"
	topo.GPUs[1].UUID = "GPU-0b2c0e3c-aaaa-bbbb-cccc-ddddeeeeffff"
	// The CUDA driver's bytes print lower-case; nvidia-smi may differ in case.
	g, ok := topo.GPUByUUID("GPU-0B2C0E3C-AAAA-BBBB-CCCC-DDDDEEEEFFFF")
	require.True(t, ok)
	require.Equal(t, topo.GPUs[1].Index, g.Index)
	g, ok = topo.GPUByUUID("6a1f0e3c-1111-2222-3333-444455556666")
	require.True(t, ok)
	require.Equal(t, topo.GPUs[0].Index, g.Index)
	for _, miss := range []string{"", "GPU-", "GPU-00000000-0000-0000-0000-000000000000", "MIG-6a1f0e3c-1111-2222-3333-444455556666"} {
		_, ok := topo.GPUByUUID(miss)
		require.False(t, ok, "%q", miss)
	}

	// The NIC for a CUDA device: CUDA_VISIBLE_DEVICES=1 makes GPU 1 "CUDA
	// device 0"; by UUID it still gets GPU 1's switch-local NIC.
	a, ok := topo.BestNICForUUID(topo.GPUs[1].UUID, true)
	require.True(t, ok)
	require.Equal(t, "mlx5_1", a.NIC.Name)
	_, ok = topo.BestNICForUUID("GPU-00000000-0000-0000-0000-000000000000", false)
	require.False(t, ok)
}
