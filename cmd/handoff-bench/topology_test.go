package main

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"

	"github.com/handoff-io/handoff/internal/topology"
	"github.com/stretchr/testify/require"
)

func TestWriteTopology(t *testing.T) {
	topo := topology.Host{
		GPUs: []topology.GPU{
			{Index: 0, Name: "H200", PCIBusID: "0000:18:00.0", NUMANode: 0, MemoryBytes: 141 << 30, NVLinks: 18,
				Peers: []topology.GPUPeer{{Index: 1, Level: topology.LevelSys, P2PRead: topology.P2POK, P2PWrite: topology.P2POK, P2PNVLink: topology.P2POK}}},
			{Index: 1, Name: "H200", PCIBusID: "0000:9a:00.0", NUMANode: 1, MemoryBytes: 141 << 30, NVLinks: 18,
				Peers: []topology.GPUPeer{{Index: 0, Level: topology.LevelSys, P2PRead: topology.P2PChipsetNotSupported}}},
		},
		NICs: []topology.NIC{{Name: "mlx5_0", PCIBusID: "0000:19:00.0", NUMANode: 0, RDMA: true, RDMADevices: []string{"mlx5_0"}, SpeedMbps: 400000}},
	}
	var tab bytes.Buffer
	require.NoError(t, writeTopology(&tab, topo, "table"))
	out := tab.String()
	require.Contains(t, out, "2 GPUs (2x H200 141GiB nvlink18), 1 NIC")
	require.Contains(t, out, "1:sys/p2p+nvlink")
	require.Contains(t, out, "0:sys/no-p2p")
	require.Contains(t, out, "mlx5_0/node")

	var js bytes.Buffer
	require.NoError(t, writeTopology(&js, topo, "json"))
	var back topology.Host
	require.NoError(t, json.Unmarshal(js.Bytes(), &back))
	require.Equal(t, topo, back)
}

func TestRunTopologyFlags(t *testing.T) {
	require.Error(t, runTopology(context.Background(), []string{"--output", "xml"}))
	require.Error(t, runTopology(context.Background(), []string{"extra"}))
}
