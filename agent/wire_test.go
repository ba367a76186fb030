package agent

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

// listFrame is a register request whose list at path (keys of nested maps)
// is an array of n empty maps: a byte of frame per element.
func listFrame(path []string, n int) []byte {
	str := func(b []byte, s string) []byte { return append(append(b, 0xa0|byte(len(s))), s...) }
	b := str(append([]byte{0x82}, 0xa2, 'o', 'p'), OpRegister)
	for i, k := range path {
		b = str(b, k)
		if i < len(path)-1 {
			b = append(b, 0x81) // a map of the next key
		}
	}
	b = binary.BigEndian.AppendUint32(append(b, 0xdd), uint32(n))
	for range n {
		b = append(b, 0x80)
	}
	return b
}

// TestDecodeRequestBoundsLists: a request's lists of planes and buffers
// are refused past their bound before the agent makes room for them (a
// 16 MiB frame of empty planes took 768 MB to decode), and decode up to
// it.
func TestDecodeRequestBoundsLists(t *testing.T) {
	for _, c := range []struct {
		path []string
		max  int
		list func(Request) int
	}{
		{[]string{"layout", "kv", "planes"}, maxDecodedPlanes, func(q Request) int { return len(q.Layout.KV.Planes) }},
		{[]string{"layout", "mamba", "planes"}, maxDecodedPlanes, func(q Request) int { return len(q.Layout.Mamba.Planes) }},
		{[]string{"buffers"}, maxDecodedBuffers, func(q Request) int { return len(q.Buffers) }},
	} {
		t.Run(strings.Join(c.path, "."), func(t *testing.T) {
			q, err := decodeRequest(listFrame(c.path, c.max))
			require.NoError(t, err)
			require.Equal(t, c.max, c.list(q))

			_, err = decodeRequest(listFrame(c.path, c.max+1))
			require.ErrorIs(t, err, ErrBadRequest)
			require.Contains(t, err.Error(), "more than a request may list")

			big := listFrame(c.path, MaxFrame-64)
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			_, err = decodeRequest(big)
			runtime.ReadMemStats(&after)
			require.ErrorIs(t, err, ErrBadRequest)
			require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(64<<20), "the agent made room for what the frame claimed")
		})
	}
}

// TestRegisterTooManyLayersRefused: a layout over maxLayers, its planes
// within what a request may list, gets validation's error by name, and
// the connection goes on.
func TestRegisterTooManyLayersRefused(t *testing.T) {
	c, l, p, kfd, mfd := unregistered(t)
	big := l
	kv := *l.KV
	kv.Layers = maxLayers + 1
	kv.Planes = make(Planes, 2*kv.Layers)
	big.KV = &kv
	_, err := c.Call(ctxT(t), Request{Op: OpRegister, Layout: &big, KVBytes: p.kvBytes(), MambaBytes: p.mambaBytes()}, []int{kfd, mfd})
	require.ErrorIs(t, err, ErrInvalidLayout)
	require.ErrorContains(t, err, "kv: 4097 layers, at most 4096")
	rep, err := c.Register(ctxT(t), l, kfd, p.kvBytes(), mfd, p.mambaBytes())
	require.NoError(t, err)
	require.Equal(t, p.fingerprint, rep.Fingerprint)
}

// TestDecodeIntsInPlace: integer arrays in every msgpack encoding of an
// integer (and nil) decode in place (unmarshal) to what msgpack's own
// decoder gives, element by element; cut short anywhere, or claiming more
// elements than bytes, they fail without a panic; anything but an integer
// is refused.
func TestDecodeIntsInPlace(t *testing.T) {
	type lists struct {
		B BlockList `msgpack:"b"`
		W words     `msgpack:"w"`
	}
	r := rand.New(rand.NewPCG(3, 4))
	elem := func(e *msgpack.Encoder) {
		v := r.Uint64() >> r.IntN(64)
		var err error
		switch r.IntN(10) {
		case 0:
			err = e.EncodeNil()
		case 1:
			err = e.EncodeInt8(int8(v))
		case 2:
			err = e.EncodeInt16(int16(v))
		case 3:
			err = e.EncodeInt32(int32(v))
		case 4:
			err = e.EncodeInt64(int64(v))
		case 5:
			err = e.EncodeUint8(uint8(v))
		case 6:
			err = e.EncodeUint16(uint16(v))
		case 7:
			err = e.EncodeUint32(uint32(v))
		case 8:
			err = e.EncodeUint64(v)
		default:
			err = e.EncodeInt(-int64(v % 64)) // fixints, both signs
		}
		require.NoError(t, err)
	}
	for round := range 300 {
		var buf bytes.Buffer
		e := msgpack.NewEncoder(&buf)
		require.NoError(t, e.EncodeMapLen(2))
		for _, k := range []string{"b", "w"} {
			require.NoError(t, e.EncodeString(k))
			n := r.IntN(40)
			require.NoError(t, e.EncodeArrayLen(n))
			for range n {
				elem(e)
			}
		}
		b := buf.Bytes()
		var got, want lists
		require.NoError(t, unmarshal(b, &got), "round %d", round)
		require.NoError(t, msgpack.Unmarshal(b, &want), "round %d", round)
		require.Equal(t, want, got, "round %d: %x", round, b)
		for cut := 1; cut < len(b); cut++ {
			var l lists
			d := msgpack.NewDecoder(&frameReader{b: b[:cut]})
			require.Error(t, d.Decode(&l), "round %d, cut at %d of %d", round, cut, len(b))
		}
	}
	var l lists
	// An array claiming 2^32-1 elements in 5 bytes, past unmarshal's check.
	d := msgpack.NewDecoder(&frameReader{b: []byte{0x81, 0xa1, 'w', 0xdd, 0xff, 0xff, 0xff, 0xff, 1}})
	require.ErrorContains(t, d.Decode(&l), "4294967295 integers in 1 bytes")
	require.ErrorContains(t, unmarshal([]byte{0x81, 0xa1, 'b', 0x92, 1, 0xa1, 'x'}, &l), "code 0xa1 in an array of integers")

	// 2^20 empty strings where integers belong: the bytes hold the claim,
	// but no room is made for it (8 MiB) before they are found wrong.
	junk := append([]byte{0x81, 0xa1, 'w', 0xdd, 0, 0x10, 0, 0}, bytes.Repeat([]byte{0xa0}, 1<<20)...)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	err := unmarshal(junk, &l)
	runtime.ReadMemStats(&after)
	require.ErrorContains(t, err, "code 0xa0 in an array of integers")
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(1<<20))
}
