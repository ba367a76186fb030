package model_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/model"
)

// memory is device memory as OnDevice sees it: bytes reached only through
// ReadAt and WriteAt, counting the bytes moved.
type memory struct {
	b           []byte
	read, wrote int
}

func (m *memory) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > int64(len(m.b)) {
		return 0, fmt.Errorf("read [%d, +%d) outside %d", off, len(p), len(m.b))
	}
	m.read += len(p)
	return copy(p, m.b[off:]), nil
}

func (m *memory) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > int64(len(m.b)) {
		return 0, fmt.Errorf("write [%d, +%d) outside %d", off, len(p), len(m.b))
	}
	m.wrote += len(p)
	return copy(m.b[off:], p), nil
}

// TestOnDevice: an executor over caches in device memory computes what it
// computes over host caches, even though its host copy is scribbled over
// between calls (each call reads the request's bytes from the device and
// writes them back), and the device ends up holding the request's state.
func TestOnDevice(t *testing.T) {
	for _, e := range smallExecutors(t) {
		t.Run(e.Spec().Name, func(t *testing.T) {
			spec := e.Spec()
			host := newArenas(t, spec, 16, 2)
			shadow := newArenas(t, spec, 16, 2)
			kvDev := &memory{b: make([]byte, len(shadow.kvMem))}
			mDev := &memory{b: make([]byte, len(shadow.mMem))}
			d := model.OnDevice(e, kvDev, mDev)
			require.Equal(t, spec, d.Spec())

			blocks := []int{5, 6, 9, 2}
			toks := prompt(2*spec.KV.TokensPerBlock+3, 1)
			hc := host.cache(1, blockIDs(blocks)...)
			dc := shadow.cache(1, blockIDs(blocks)...)
			want, err := e.Prefill(hc, toks)
			require.NoError(t, err)
			shadow.fill(0xEE)
			got, err := d.Prefill(dc, toks)
			require.NoError(t, err)
			require.Equal(t, bits(want), bits(got))
			for pos := len(toks); pos < len(toks)+spec.KV.TokensPerBlock+2; pos++ {
				tok := int32(pos % 200)
				want, err := e.Decode(hc, tok, pos)
				require.NoError(t, err)
				shadow.fill(byte(pos))
				got, err := d.Decode(dc, tok, pos)
				require.NoError(t, err)
				require.Equal(t, bits(want), bits(got), "position %d", pos)
			}
			n := len(toks) + spec.KV.TokensPerBlock + 2
			onDev := dc
			onDev.KVArena, onDev.MambaArena = kvDev.b, mDev.b
			require.Equal(t, state(hc, n), state(onDev, n), "the device holds the request's state")
			require.Positive(t, kvDev.read+mDev.read)
			require.Positive(t, kvDev.wrote+mDev.wrote)
		})
	}
}

func blockIDs(xs []int) []kvcache.BlockID {
	out := make([]kvcache.BlockID, len(xs))
	for i, x := range xs {
		out[i] = kvcache.BlockID(x)
	}
	return out
}
