package worker

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func loads(phases ...[]Phase) []RankLoad {
	out := make([]RankLoad, len(phases))
	for i, p := range phases {
		out[i] = RankLoad{Phases: p}
	}
	return out
}

func ph(p ...Phase) []Phase { return p }

func TestPlanStep(t *testing.T) {
	tests := []struct {
		name  string
		loads []RankLoad
		adp   bool
		step  bool
		dummy []bool
	}{
		{"all idle: no step, no dummy", loads(nil, nil), true, false, []bool{false, false}},
		{"one rank works: idle rank pads", loads(ph(PhaseGenerate), nil), true, true, []bool{false, true}},
		{"context counts as work", loads(nil, ph(PhaseContext)), true, true, []bool{true, false}},
		{"both work: nobody pads", loads(ph(PhaseGenerate), ph(PhaseContext)), true, true, []bool{false, false}},
		{
			"waiting for cache is not work: nobody steps",
			loads(ph(PhaseAwaitCache), ph(PhaseAwaitCache)), true, false, []bool{false, false},
		},
		{
			// The seed scenario, dp-size 2 and max-batch-size 1: rank 0's only
			// real row is held by a request in transfer, rank 1 has work, so
			// rank 0 looks idle and must pad.
			"seed: in-transfer rank pads while the other works",
			loads(ph(PhaseAwaitCache), ph(PhaseGenerate)), true, true, []bool{true, false},
		},
		{
			"seed on prefill: pushing rank pads",
			loads(ph(PhaseContext), ph(PhasePush)), true, true, []bool{false, true},
		},
		{
			"mixed rank with work and transfer does not pad",
			loads(ph(PhaseAwaitCache, PhaseGenerate), nil, ph(PhasePush)), true, true, []bool{false, true, true},
		},
		{"no attention DP: no dummies", loads(ph(PhaseGenerate), nil), false, true, []bool{false, false}},
		{"single rank with work", loads(ph(PhaseGenerate)), true, true, []bool{false}},
		{"single rank in transfer", loads(ph(PhaseAwaitCache)), true, false, []bool{false}},
		{"no ranks", nil, true, false, []bool{}},
		// A state served from the cache or adopted steps but runs no
		// forward pass: its rank pads beside it while another computes,
		// and alone they step with no forward pass anywhere.
		{
			"no-compute work pads beside it",
			[]RankLoad{{Phases: ph(PhaseGenerate)}, {Phases: ph(PhaseContext), NoCompute: 1}}, true, true, []bool{false, true},
		},
		{
			"no-compute and compute work: no pad",
			[]RankLoad{{Phases: ph(PhaseGenerate)}, {Phases: ph(PhaseContext, PhaseGenerate), NoCompute: 1}}, true, true, []bool{false, false},
		},
		{
			"no-compute work alone: a step, no forward pass",
			[]RankLoad{{Phases: ph(PhaseGenerate), NoCompute: 1}, {}}, true, true, []bool{false, false},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := PlanStep(tt.loads, tt.adp)
			require.Equal(t, tt.step, p.Step)
			require.Equal(t, tt.dummy, p.Dummy)
			n := 0
			for _, d := range tt.dummy {
				if d {
					n++
				}
			}
			require.Equal(t, n, p.Dummies())
		})
	}
}

// TestPlanStepProperties checks the planner's invariants over every load of
// up to three ranks with up to two requests each.
func TestPlanStepProperties(t *testing.T) {
	all := []Phase{PhaseAwaitCache, PhaseContext, PhaseGenerate, PhasePush}
	var rankChoices [][]Phase
	rankChoices = append(rankChoices, nil)
	for _, a := range all {
		rankChoices = append(rankChoices, ph(a))
		for _, b := range all {
			rankChoices = append(rankChoices, ph(a, b))
		}
	}
	var walk func(ls []RankLoad)
	walk = func(ls []RankLoad) {
		if len(ls) > 0 {
			for _, adp := range []bool{false, true} {
				p := PlanStep(ls, adp)
				anyWork := false
				for _, l := range ls {
					anyWork = anyWork || l.Schedulable() > 0
				}
				require.Equal(t, anyWork, p.Step)
				for i, l := range ls {
					// A rank pads exactly when attention DP is on, the
					// iteration steps, and it has no schedulable work.
					require.Equal(t, adp && anyWork && l.Schedulable() == 0, p.Dummy[i])
				}
			}
		}
		if len(ls) == 3 {
			return
		}
		for _, c := range rankChoices {
			walk(append(ls[:len(ls):len(ls)], RankLoad{Phases: c}))
		}
	}
	walk(nil)
}

func TestPickRank(t *testing.T) {
	tests := []struct {
		name   string
		rooms  []RankRoom
		blocks int
		want   int
	}{
		{"no ranks", nil, 1, -1},
		{"only rank fits", []RankRoom{{Rows: 1, Blocks: 4}}, 4, 0},
		{"no row left", []RankRoom{{Rows: 0, Blocks: 100}}, 1, -1},
		{"not enough blocks", []RankRoom{{Rows: 1, Blocks: 3}}, 4, -1},
		{"least loaded wins", []RankRoom{{Rows: 1, Blocks: 8, Held: 1}, {Rows: 2, Blocks: 8}}, 2, 1},
		{"tie on load: more blocks", []RankRoom{{Rows: 1, Blocks: 5}, {Rows: 1, Blocks: 9}}, 2, 1},
		{"full tie: lowest index", []RankRoom{{Rows: 1, Blocks: 9}, {Rows: 1, Blocks: 9}}, 2, 0},
		{"skip the rank without a row", []RankRoom{{Rows: 0, Blocks: 50}, {Rows: 1, Blocks: 2, Held: 3}}, 2, 1},
		{
			// dp-size 2, max-batch-size 1: rank 0's row is held by a transfer.
			"seed: only the free rank qualifies",
			[]RankRoom{{Rows: 0, Blocks: 10, Held: 1}, {Rows: 1, Blocks: 10}}, 1, 1,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			require.Equal(t, tt.want, PickRank(tt.rooms, tt.blocks))
		})
	}
}

func TestPhase(t *testing.T) {
	require.Equal(t, "await-cache", PhaseAwaitCache.String())
	require.Equal(t, "unknown", Phase(99).String())
	for _, p := range []Phase{PhaseQueued, PhaseDone} {
		require.False(t, p.Schedulable())
		require.False(t, p.HoldsResources())
	}
	for _, p := range []Phase{PhaseAwaitCache, PhasePush, PhaseHeld} {
		require.False(t, p.Schedulable())
		require.True(t, p.HoldsResources())
	}
	for _, p := range []Phase{PhaseContext, PhaseGenerate} {
		require.True(t, p.Schedulable())
		require.True(t, p.HoldsResources())
	}
}

// A scheduler with attention DP pads the dummy on the row its pools
// reserve for it: over pools that reserve none, the dummy would take a real
// row (which a request may need, and the seed bug left it without), so the
// scheduler is refused.
func TestAttentionDPNeedsTheDummysRow(t *testing.T) {
	_, err := NewScheduler(Config{Role: RoleDecode, AttentionDP: true}, newRanks(t, rankOpts{ranks: 2, batch: 1}))
	require.ErrorIs(t, err, ErrInvalidConfig)
	_, err = NewScheduler(Config{Role: RoleDecode, AttentionDP: true}, newRanks(t, rankOpts{ranks: 2, batch: 1, adp: true}))
	require.NoError(t, err)
}
