package reshard

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/handoff-io/handoff/mambacache"

	"github.com/stretchr/testify/require"
)

// TestPropertyOracle draws random KV and Mamba (xBC and QKV; conv states
// channel by channel and position by position) shapes and,
// for every pair of TP sizes 1..8, checks that New accepts exactly the
// pairs where the shape splits on both sides, and for those that:
//
//   - every destination byte is written by exactly one copy (none twice,
//     none missed) and the plan is compact;
//   - applying the P→D plan to the oracle's P shards of a random unit gives
//     the oracle's D shards;
//   - applying the D→P plan to those gives back the P shards (identity);
//   - the copies repeated over a run of units equal the copies per unit.
func TestPropertyOracle(t *testing.T) {
	rng := rand.New(rand.NewPCG(12, 2026))
	const shapes = 100
	var plans, refused, replicated, nonInteger int
	for i := range 4 * shapes {
		var m oracle
		switch i % 4 {
		case 0:
			m = kvModel(randKV(rng))
		case 3:
			m = mambaSDModel(randMamba(rng)) // conv states position by position
		default:
			c := randMamba(rng)
			c.ConvLayout = 0
			if i%4 == 2 {
				c.ConvLayout = 1
			}
			m = mambaModel(c)
		}
		full := fill(rng, m.unit(1))
		shards := map[int][][]byte{}
		for tp := 1; tp <= 8; tp++ {
			if m.ok(tp) {
				shards[tp] = m.shards(full, tp)
				require.Equal(t, m.unit(tp), m.layout.UnitBytes(tp), "%s %+v: unit size at TP %d", m.name, m.layout, tp)
			}
		}
		for from := 1; from <= 8; from++ {
			for to := 1; to <= 8; to++ {
				p, err := New(m.layout, from, to)
				if !m.ok(from) || !m.ok(to) {
					require.ErrorIs(t, err, ErrIndivisible, "%s %+v %d→%d", m.name, m.layout, from, to)
					refused++
					continue
				}
				require.NoError(t, err, "%s %+v %d→%d", m.name, m.layout, from, to)
				plans++
				if from%to != 0 && to%from != 0 {
					nonInteger++
				}
				for _, s := range m.layout.Sections {
					if from > s.Items || to > s.Items {
						replicated++
						break
					}
				}
				require.NoError(t, exactlyOnce(p))
				got := reshard(t, p, shards[from])
				require.NoError(t, sameShards(got, shards[to]), "%s %d→%d\n%v", m.name, from, to, p)
				back, err := New(m.layout, to, from)
				require.NoError(t, err)
				require.NoError(t, sameShards(reshard(t, back, got), shards[from]), "%s %d→%d→%d", m.name, from, to, from)
				checkRepeat(t, rng, p)
				checkOrder(t, p, shards[from], shards[to])
				checkApplyRange(t, rng, p, shards[from], shards[to])
			}
		}
	}
	t.Logf("%d shapes, %d plans checked (%d with replicated heads or groups, %d with a non-integer ratio), %d pairs refused",
		4*shapes, plans, replicated, nonInteger, refused)
	require.Greater(t, plans, shapes*16) // of 4·shapes·64 pairs: not vacuous
	require.Positive(t, replicated)
	require.Positive(t, nonInteger)
	require.Positive(t, refused)
}

// checkRepeat checks that the copies of p repeated over a run of n units
// (n = 2..3) move each unit of a random source run as the per-unit copies
// do.
func checkRepeat(t *testing.T, rng *rand.Rand, p *Plan) {
	t.Helper()
	n := 2 + rng.IntN(2)
	rs, rd := rng.IntN(p.From), rng.IntN(p.To)
	src := fill(rng, int64(n)*p.SrcBytes)
	want := make([]byte, int64(n)*p.DstBytes)
	for u := range int64(n) {
		Apply(want[u*p.DstBytes:(u+1)*p.DstBytes], src[u*p.SrcBytes:(u+1)*p.SrcBytes], p.Copies(rs, rd))
	}
	var run []Copy
	for _, c := range p.Copies(rs, rd) {
		run = append(run, c.Repeat(n))
	}
	got := make([]byte, len(want))
	Apply(got, src, run)
	require.Equal(t, want, got, "%d units, pair %d→%d of\n%v", n, rs, rd, p)
}

// checkOrder checks that streaming each destination shard's Order, piece
// by piece from the named source shards, produces that shard's unit.
func checkOrder(t *testing.T, p *Plan, src, want [][]byte) {
	t.Helper()
	for rd := range p.To {
		var got []byte
		for _, s := range p.Order(rd) {
			require.Equal(t, int64(len(got)), s.Dst, "%d→%d shard %d", p.From, p.To, rd)
			got = append(got, src[s.Shard][s.Src:s.Src+s.Len]...)
		}
		require.Equal(t, want[rd], got, "%d→%d shard %d streamed in Order", p.From, p.To, rd)
	}
}

// checkApplyRange checks that the plan applied range by range, over a
// random cut of each destination unit, gives that unit, and that a range
// writes nothing outside itself.
func checkApplyRange(t *testing.T, rng *rand.Rand, p *Plan, src, want [][]byte) {
	t.Helper()
	for rd := range p.To {
		got := make([]byte, p.DstBytes)
		for lo := int64(0); lo < p.DstBytes; {
			hi := min(p.DstBytes, lo+1+rng.Int64N(p.DstBytes))
			before := slices.Clone(got)
			for rs := range p.From {
				ApplyRange(got, src[rs], p.Copies(rs, rd), lo, hi)
			}
			require.Equal(t, before[:lo], got[:lo], "%d→%d shard %d: [%d, %d) wrote below", p.From, p.To, rd, lo, hi)
			require.Equal(t, before[hi:], got[hi:], "%d→%d shard %d: [%d, %d) wrote above", p.From, p.To, rd, lo, hi)
			lo = hi
		}
		require.Equal(t, want[rd], got, "%d→%d shard %d applied by ranges", p.From, p.To, rd)
	}
}

// TestPropertyFailsWhenBroken breaks a correct plan in the ways a
// resharder goes wrong and checks that the exactly-once check or the
// oracle catches each: the property tests can fail.
func TestPropertyFailsWhenBroken(t *testing.T) {
	c := mambacache.Config{Layers: 2, DState: 2, DConv: 3, Heads: 8, HeadDim: 2, NGroups: 2,
		ConvElemSize: 2, SSMElemSize: 2}
	m := mambaModel(c)
	edit := func(p *Plan, rs, rd int, f func(cs []Copy) []Copy) {
		p.copies[rs*p.To+rd] = f(slices.Clone(p.copies[rs*p.To+rd]))
	}
	breakers := []struct {
		name    string
		once    bool // caught by the exactly-once check
		content bool // caught by the oracle (a second writer of the same bytes is not)
		brk     func(p *Plan)
	}{
		{"second writer of a replicated group", true, false, func(p *Plan) {
			// Shard 1 holds group 0 as shard 0 does; the naive resharder
			// lets both write it.
			edit(p, 1, 0, func(cs []Copy) []Copy { return append(cs, p.Copies(0, 0)[1]) })
		}},
		{"missed byte", true, true, func(p *Plan) {
			edit(p, 0, 0, func(cs []Copy) []Copy { cs[0].Len--; return cs })
		}},
		{"shifted by one byte", true, true, func(p *Plan) {
			edit(p, 0, 0, func(cs []Copy) []Copy { cs[0].Src++; cs[0].Dst++; cs[0].Len--; return cs })
		}},
		{"B read where C is", false, true, func(p *Plan) {
			edit(p, 0, 0, func(cs []Copy) []Copy { cs[1].Src, cs[2].Src = cs[2].Src, cs[1].Src; return cs })
		}},
	}
	rng := rand.New(rand.NewPCG(1, 1))
	full := fill(rng, m.unit(1))
	for _, b := range breakers {
		t.Run(b.name, func(t *testing.T) {
			p, err := New(m.layout, 4, 1)
			require.NoError(t, err)
			require.Len(t, p.Copies(0, 0), 4, "x, B, C, ssm from shard 0:\n%v", p)
			require.NoError(t, exactlyOnce(p))
			require.NoError(t, sameShards(reshard(t, p, m.shards(full, 4)), m.shards(full, 1)))
			b.brk(p)
			if b.once {
				require.Error(t, exactlyOnce(p))
			}
			if b.content {
				require.Error(t, sameShards(reshard(t, p, m.shards(full, 4)), m.shards(full, 1)))
			}
		})
	}
}
