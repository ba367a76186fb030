package worker

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

// skipSource is a loopback source that records each fetch's Skip.
type skipSource struct {
	gateSource
	skips []int
	n     atomic.Int32
}

func (s *skipSource) Fetch(ctx context.Context, f FetchRequest) (FetchResult, error) {
	s.skips = append(s.skips, f.Skip) // fetches of one conversation run one at a time
	s.n.Add(1)
	return s.gateSource.Fetch(ctx, f)
}

// TestDeltaHandoffSharesWhatTheRankHolds: a decode worker with a remote
// prefill and the prefix cache keeps each finished turn's blocks; the next
// turn shares them and asks only for the rest (FetchRequest.Skip), and the
// output is the reference's. Without the prefix cache nothing is skipped.
func TestDeltaHandoffSharesWhatTheRankHolds(t *testing.T) {
	for _, cached := range []bool{true, false} {
		t.Run(fmt.Sprintf("prefix cache %v", cached), func(t *testing.T) {
			pre := newScheduler(t, Config{Role: RolePrefill}, newRanks(t, rankOpts{ranks: 1, batch: 2}))
			dranks := newRanks(t, rankOpts{ranks: 1, batch: 2})
			src := &skipSource{gateSource: gateSource{pre: pre, dst: dranks}}
			dec := runCached(t, Config{PrefixCache: cached, Source: src}, dranks) // pools back to baseline at the end
			tpb := dranks[0].kvCfg.TokensPerBlock
			p := model.Encode(systemPrompt + "<|user|>Tell me about state rows.\n<|assistant|>")
			var want []int // the blocks each turn may skip
			held := 0      // full blocks of the tokens the last turn absorbed
			for turn := range 3 {
				want = append(want, min(held, (len(p)-1)/tpb))
				ref := reference(t, model.TinyHybrid, p, 12, 0, 0)
				got, _ := generate(t, dec, p)
				require.Equal(t, ref, got, "turn %d", turn+1)
				held = (len(p) + len(got) - 1) / tpb // the last token is sampled, not absorbed
				p = slices.Concat(p, got, model.Encode(fmt.Sprintf("\n<|user|>go on %d\n<|assistant|>", turn)))
			}
			require.Positive(t, want[2], "the workload must be able to skip")
			if !cached {
				want = []int{0, 0, 0}
			}
			require.Equal(t, want, src.skips, "blocks each turn shared instead of receiving")
		})
	}
}
