package wire

import (
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/session"
)

// goldenPeer is a descriptor with every field set, device ones included.
var goldenPeer = rdma.Descriptor{Agent: "decode-0", Host: "h1", TCPAddr: "127.0.0.1:7000", ShmAddr: "/tmp/s",
	Transports:   []rdma.Transport{rdma.TransportCUDAIPC, rdma.TransportTCP},
	Regions:      []rdma.RegionDesc{{ID: 1, Name: "kv", Length: 1 << 30, Memory: rdma.MemoryCUDA, Device: "GPU-0"}, {ID: 2, Name: "mamba", Length: 1 << 20}},
	IPCNamespace: "ipc:[4026531839]", CUDADevices: []string{"GPU-0"}}

func goldenRequest(tp uint16, deadline time.Time) PrefillRequest {
	var tok [16]byte
	for i := range tok {
		tok[i] = byte(i * 17)
	}
	tk := rdma.Ticket{Agent: "decode-0", Grant: 1 << 40, Epoch: 3, Token: tok, RequestID: 1<<63 + 5, Bytes: 8492, Deadline: deadline}
	tk.Extents = []rdma.Extent{{Region: 1, Offset: 4096, Length: 8192}, {Region: 2, Offset: 1 << 33, Length: 300}}
	return PrefillRequest{RequestID: 1<<63 + 5, From: "decode-0", Attempt: 2, Fingerprint: "fp",
		Tokens: Tokens{1, -2, 1 << 30}, Sampling: Sampling{Temperature: 0.7, Seed: 9, TopP: 0.9, Logprobs: 3},
		Deadline: -5, Peer: PeerOf(goldenPeer), Ticket: tk,
		KVBytes: 8192, MambaBytes: 300, Budget: 1e9, TP: tp}
}

// TestWireGolden pins every message's bytes to the files in
// testdata/golden, written by the codecs of WireVersion 1 before the
// messages moved here (and the ticket and manifest became the rdma
// types): a change to them is a change of the wire format, which needs a
// new WireVersion. Each golden message decodes back to the value encoded.
func TestWireGolden(t *testing.T) {
	golden := func(name string) []byte {
		s, err := os.ReadFile(filepath.Join("testdata", "golden", name))
		require.NoError(t, err)
		b, err := hex.DecodeString(strings.TrimSpace(string(s)))
		require.NoError(t, err)
		return b
	}
	check := func(name string, b []byte, err error) []byte {
		t.Helper()
		require.NoError(t, err)
		want := golden(name)
		require.Equal(t, hex.EncodeToString(want), hex.EncodeToString(b), name)
		return want
	}

	for name, req := range map[string]PrefillRequest{
		"request.hex":            goldenRequest(4, time.Unix(0, 1767225601000000000)),
		"request_nodeadline.hex": goldenRequest(0, time.Time{}),
	} {
		b, err := EncodePrefillRequest(req, 0)
		got, err := DecodePrefillRequest(check(name, b, err))
		require.NoError(t, err)
		req.V = WireVersion
		require.Equal(t, req, got, name)
	}

	for name, man := range map[string]rdma.Manifest{
		"reply.hex":       {Bytes: []uint64{8192, 300}, CRC: []uint32{0xdeadbeef, 7}},
		"reply_empty.hex": {},
	} {
		rep := PrefillReply{RequestID: 5, Instance: "p1", FirstToken: 42, PrefillNanos: 1, WriteNanos: 2,
			Manifest: man, Logprobs: []byte{1, 2}}
		b, err := EncodePrefillReply(rep, 0)
		got, err := DecodePrefillReply(check(name, b, err))
		require.NoError(t, err)
		rep.V = WireVersion
		require.Equal(t, rep, got, name)
	}

	c := Cancel{RequestID: 5, Grant: 9, Code: session.CodeTimeout, From: "d1"}
	b, err := EncodeCancel(c)
	gotC, err := DecodeCancel(check("cancel.hex", b, err))
	require.NoError(t, err)
	c.V = WireVersion
	require.Equal(t, c, gotC)

	inst := Instance{ID: "p1", Role: RolePrefill, Fingerprint: "fp", Peer: PeerOf(goldenPeer),
		Capacity: Capacity{Ranks: 1, Rows: 2}, Updated: 7, Draining: true, Service: "svc"}
	b, err = EncodeInstance(inst)
	gotI, err := DecodeInstance(check("instance.hex", b, err))
	require.NoError(t, err)
	inst.V = WireVersion
	require.Equal(t, inst, gotI)
}
