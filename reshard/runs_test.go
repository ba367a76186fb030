package reshard

import (
	"math/rand/v2"
	"testing"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/stretchr/testify/require"
)

func TestAlign(t *testing.T) {
	run := func(start, n int) kvcache.Run { return kvcache.Run{Start: kvcache.BlockID(start), Len: uint32(n)} }
	require.Equal(t, []Stretch{{Src: 0, Dst: 10, Len: 2}, {Src: 2, Dst: 20, Len: 1}, {Src: 5, Dst: 21, Len: 3}},
		Align(nil, []kvcache.Run{run(0, 3), run(5, 3)}, []kvcache.Run{run(10, 2), run(20, 4)}))
	require.Equal(t, []Stretch{{Src: 4, Dst: 7, Len: 5}},
		Align(nil, []kvcache.Run{run(4, 2), run(6, 3)}, []kvcache.Run{run(7, 5)}), "runs consecutive on both sides merge")
	require.Empty(t, Align(nil, nil, nil))
	require.Panics(t, func() { Align(nil, []kvcache.Run{run(0, 3)}, []kvcache.Run{run(0, 2)}) })
}

// TestAlignProperty checks Align against the block-by-block mapping of
// random run lists: the stretches map the i-th source block to the i-th
// destination block, in token order, and are maximal and few.
func TestAlignProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	runs := func(n int) (rs []kvcache.Run, ids []kvcache.BlockID) {
		next := rng.IntN(4)
		for n > 0 {
			k := 1 + rng.IntN(min(n, 5))
			rs = append(rs, kvcache.Run{Start: kvcache.BlockID(next), Len: uint32(k)})
			for b := range k {
				ids = append(ids, kvcache.BlockID(next+b))
			}
			next += k + rng.IntN(3) // sometimes adjacent: runs that could merge
			n -= k
		}
		return rs, ids
	}
	for range 500 {
		n := rng.IntN(40)
		src, sb := runs(n)
		to, db := runs(n)
		st := Align(nil, src, to)
		var gotS, gotD []kvcache.BlockID
		for k, s := range st {
			require.Positive(t, s.Len)
			if k > 0 {
				p := st[k-1]
				require.False(t, p.Src+kvcache.BlockID(p.Len) == s.Src && p.Dst+kvcache.BlockID(p.Len) == s.Dst, "not maximal: %v", st)
			}
			for b := range s.Len {
				gotS, gotD = append(gotS, s.Src+kvcache.BlockID(b)), append(gotD, s.Dst+kvcache.BlockID(b))
			}
		}
		require.Equal(t, sb, gotS)
		require.Equal(t, db, gotD)
		require.LessOrEqual(t, len(st), max(len(src)+len(to)-1, 0))
	}
}
