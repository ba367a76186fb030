package wire

import (
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/rdma"
)

// A descriptor with device regions crosses the wire whole: what cuda-ipc
// selection reads (the IPC namespace, the visible devices, each region's
// memory and device) survives, in the format reflection produces, and a
// host descriptor encodes as before (no new keys).
func TestPeerDeviceFields(t *testing.T) {
	d := rdma.Descriptor{Agent: "decode-0", Host: "h1", TCPAddr: "127.0.0.1:7000",
		Transports:   []rdma.Transport{rdma.TransportCUDAIPC, rdma.TransportTCP},
		Regions:      []rdma.RegionDesc{{ID: 1, Name: "kv", Length: 1 << 30, Memory: rdma.MemoryCUDA, Device: "GPU-0"}, {ID: 2, Name: "host", Length: 4096}},
		IPCNamespace: "ipc:[4026531839]", CUDADevices: []string{"GPU-0", "GPU-1"}}
	p := PeerOf(d)
	require.Equal(t, d, p.Descriptor())
	b := p.appendTo(nil)
	var plain plainPeer
	require.NoError(t, msgpack.Unmarshal(b, &plain))
	require.Equal(t, plainPeer(p), plain)
	var back Peer
	require.NoError(t, back.decode(&reader{b: b}))
	require.Equal(t, p, back)

	host := PeerOf(rdma.Descriptor{Agent: "a", Regions: []rdma.RegionDesc{{ID: 1, Name: "kv", Length: 1}}})
	var m map[string]any
	require.NoError(t, msgpack.Unmarshal(host.appendTo(nil), &m))
	require.Len(t, m, 6, "a host peer has no device keys")
}
