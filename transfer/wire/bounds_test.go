package wire

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
)

// boundsFrame is the size of the frames these tests decode: the most a
// NATS server of cmd/handoff-nats lets through.
const boundsFrame = 8 << 20

// allocated returns how many bytes f allocated.
func allocated(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// emptyStrings appends an array of maxListLen empty strings: a byte of
// frame each, 16 of memory.
func emptyStrings(b []byte) []byte {
	b = appendArrayLen(b, maxListLen)
	for range maxListLen {
		b = appendStr(b, "")
	}
	return b
}

// emptyRegions appends an array of maxListLen empty maps: a byte of frame
// each, a RegionInfo (64 bytes) of memory.
func emptyRegions(b []byte) []byte {
	b = appendArrayLen(b, maxListLen)
	for range maxListLen {
		b = appendMapLen(b, 0)
	}
	return b
}

// repeatedPeerList is a frame of a map {"peer": {key: list, key: list, ...}}
// of about boundsFrame bytes.
func repeatedPeerList(key string) []byte {
	one := emptyStrings(appendStr(nil, key))
	k := (boundsFrame - 64) / len(one)
	b := appendMapLen(appendStr(appendMapLen(nil, 1), "peer"), k)
	for range k {
		b = append(b, one...)
	}
	return b
}

// TestDecodePeerRefusesRepeatedLists: a peer that names its transports or
// CUDA devices twice is refused before the second list is decoded, in a
// request and in an instance, instead of decoding a list of empty strings
// (16 bytes of memory for a byte of frame) once per repeat: 150 MB for an
// 8 MiB request, 190 MB for an instance.
func TestDecodePeerRefusesRepeatedLists(t *testing.T) {
	decoders := map[string]func([]byte) error{
		"request":  func(b []byte) error { _, err := DecodePrefillRequest(b); return err },
		"instance": func(b []byte) error { _, err := DecodeInstance(b); return err },
	}
	for _, key := range []string{"tr", "cd"} {
		b := repeatedPeerList(key)
		for name, decode := range decoders {
			var err error
			n := allocated(func() { err = decode(b) })
			require.ErrorIs(t, err, ErrBadMessage, "%s %s", name, key)
			require.Less(t, n, uint64(64<<20), "%s %s: the list was decoded for each repeat", name, key)
			require.ErrorContains(t, err, `repeated key "`+key+`"`, "%s %s", name, key)
		}
	}
}

// TestDecodeInstanceRefusesRepeatedPeer: an instance that names its peer
// twice is refused before reflection decodes the second one, instead of
// decoding a peer of 1,024 empty regions (1 KiB of frame, 64 KiB of
// memory) once per repeat: 560 MB for an 8 MiB instance.
func TestDecodeInstanceRefusesRepeatedPeer(t *testing.T) {
	one := emptyRegions(appendStr(appendMapLen(appendStr(nil, "peer"), 1), "r"))
	k := (boundsFrame - 64) / len(one)
	b := appendMapLen(nil, k)
	for range k {
		b = append(b, one...)
	}
	var err error
	n := allocated(func() { _, err = DecodeInstance(b) })
	require.ErrorIs(t, err, ErrBadMessage)
	require.Less(t, n, uint64(64<<20), "the peer was decoded for each repeat")
	require.ErrorContains(t, err, `repeated key "peer"`)

	// One peer, the same but once, decodes.
	m := sampleInstance()
	m.Peer.Regions = make([]RegionInfo, maxListLen)
	enc, err := EncodeInstance(m)
	require.NoError(t, err)
	got, err := DecodeInstance(enc)
	require.NoError(t, err)
	require.Equal(t, m.Peer, got.Peer)
}
