package agent

import (
	"encoding/binary"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
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
