package reshard

import (
	"errors"
	"testing"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/stretchr/testify/require"
)

// FuzzExactlyOnce builds a KV or Mamba shape and a pair of TP sizes from
// the fuzzer's numbers. New must refuse it exactly when a dimension does
// not split over a size, and otherwise return a plan that writes every
// destination byte exactly once and agrees with the oracle.
//
//	go test -run '^$' -fuzz FuzzExactlyOnce -fuzztime 20s ./reshard/
func FuzzExactlyOnce(f *testing.F) {
	f.Add(uint8(0), uint8(8), uint8(8), uint8(2), uint8(2), uint8(2), uint8(4))   // KV 2→4
	f.Add(uint8(0), uint8(2), uint8(2), uint8(1), uint8(3), uint8(4), uint8(1))   // KV, replicated heads 4→1
	f.Add(uint8(1), uint8(24), uint8(12), uint8(2), uint8(3), uint8(4), uint8(6)) // Mamba2 4→6
	f.Add(uint8(1), uint8(8), uint8(1), uint8(3), uint8(2), uint8(2), uint8(1))   // #55208: 1 group, 2→1
	f.Add(uint8(2), uint8(16), uint8(2), uint8(1), uint8(2), uint8(8), uint8(4))  // GDN, replicated groups
	f.Fuzz(func(t *testing.T, kind, heads, groups, dim, elem, from, to uint8) {
		h, g := 1+int(heads%32), 1+int(groups%32)
		d, e := 1+int(dim%3), []int{1, 2, 4}[elem%3]
		p, q := 1+int(from%16), 1+int(to%16)
		var m oracle
		switch kind % 3 {
		case 0:
			m = kvModel(kvcache.Config{Layers: 1 + int(elem/3%2), KVHeads: h, HeadDim: d, ElemSize: e, TokensPerBlock: 2})
		default:
			m = mambaModel(mambacache.Config{Layers: 1 + int(elem/3%2), DState: d, DConv: 2 + int(dim/3%3), Heads: h, HeadDim: 1 + int(dim/9%2),
				NGroups: g, ConvElemSize: e, SSMElemSize: []int{1, 2, 4}[groups/32%3], ConvLayout: mambacache.ConvLayout(kind%3 - 1)})
		}
		plan, err := New(m.layout, p, q)
		if !m.ok(p) || !m.ok(q) {
			require.True(t, errors.Is(err, ErrIndivisible), "%s %+v %d→%d: %v", m.name, m.layout, p, q, err)
			return
		}
		require.NoError(t, err)
		require.NoError(t, exactlyOnce(plan))
		full := fill(newRand(), m.unit(1))
		require.NoError(t, sameShards(reshard(t, plan, m.shards(full, p)), m.shards(full, q)), "%s %d→%d\n%v", m.name, p, q, plan)
	})
}
