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
