//go:build linux && cgo && ucx

package rdma

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestUCXPackable(t *testing.T) {
	ps := func(sizes ...int) []piece {
		out := make([]piece, len(sizes))
		for i, n := range sizes {
			out[i] = piece{ext: uint32(i), src: make([]byte, n)}
		}
		return out
	}
	full := make([]int, ucxPackBytes/ucxPackPiece+1) // one piece more than the bound holds
	for i := range full {
		full[i] = ucxPackPiece
	}
	for _, tc := range []struct {
		name  string
		sizes []int
		max   int
		want  int
	}{
		{"small pieces", []int{4096, 4096, 4096}, 128, 3},
		{"up to max", []int{1, 1, 1, 1}, 2, 2},
		{"stops at a large piece", []int{4096, ucxPackPiece + 1, 4096}, 128, 1},
		{"a large first piece", []int{ucxPackPiece + 1, 4096}, 128, 0},
		{"up to the byte bound", full, 128, ucxPackBytes / ucxPackPiece},
		{"an empty piece ends it", []int{4096, 0, 4096}, 128, 1},
	} {
		require.Equal(t, tc.want, packable(ps(tc.sizes...), tc.max), tc.name)
	}
}

// TestUCXPackPiecesLayout: a packed message's tail lists its pieces in
// payload order (extent, offset, length) and its payload is their bytes
// one after another, as admitPacked reads them.
func TestUCXPackPiecesLayout(t *testing.T) {
	pieces := []piece{{ext: 2, off: 100, src: []byte{1, 2, 3}}, {ext: 5, off: 0, src: []byte{4, 5}}}
	h := header{grant: 7, epoch: 9}
	b, payload, err := packPieces(&h, 42, pieces)
	require.NoError(t, err)
	defer freeStage(payload)
	require.Equal(t, []byte{1, 2, 3, 4, 5}, payload)
	require.Equal(t, byte(framePacked), b[4])
	hb := [headerSize]byte(b[:headerSize])
	hb[4] = frameData
	got, err := decodeHeader(hb[:])
	require.NoError(t, err)
	require.Equal(t, uint32(2), got.index, "the piece count")
	require.Equal(t, uint64(5), got.length)
	require.Equal(t, uint64(7), got.grant)
	require.Equal(t, uint64(42), binary.LittleEndian.Uint64(b[headerSize:]), "the link")
	tail := b[headerSize+ucxTail:]
	require.Len(t, tail, 2*ucxPackEntry)
	require.Equal(t, uint32(5), binary.LittleEndian.Uint32(tail[ucxPackEntry:]))
	require.Equal(t, uint64(2), binary.LittleEndian.Uint64(tail[ucxPackEntry+12:]))
}

// TestUCXStageRecycled: a staging buffer of any length goes back whole, so
// the next one of its size class is the same memory. (With its capacity
// cut to its length, a buffer whose length was not its class's failed to
// unmap and leaked, and was never reused.)
func TestUCXStageRecycled(t *testing.T) {
	for _, n := range []int{1, 100 << 10, 128 << 10, 3<<20 + 5} {
		b, err := ucxStage(n)
		require.NoError(t, err)
		require.Len(t, b, n)
		freeStage(b)
		again, err := ucxStage(n)
		require.NoError(t, err)
		require.Same(t, &b[0], &again[0], "%d bytes: the buffer freed is the one reused", n)
		freeStage(again)
	}
}
