package transfer

import (
	"fmt"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/kvcache"
)

// Delta handoffs. A decode worker whose prefix cache holds the leading KV
// blocks of a prompt (a conversation's earlier turns, which it generated)
// shares them with the request and asks only for the rest: the ticket's KV
// extents cover the blocks after the first Skip, and the prefill worker
// writes the same blocks of its own and the state row, nothing else
// (Request.Skip, wire.PrefillRequest.Skip). Both sides cut the same
// number of blocks from the resources they hold for the request, so the
// manifest check holds for a layout that matches (a mismatch fails the
// commit, never lands bytes at the wrong place). The receiver's blocks
// are its cache's, shared read-only and pinned for the request; the
// prefix cache compares tokens, not only names, so they hold the prompt's
// tokens. A delta handoff goes in one write, never layer-wise (a stream's
// parts name the whole prompt's blocks).

// SkipBlocks returns res less its first k KV blocks: what a delta handoff
// moves of a request holding res. It fails with ErrLayoutMismatch when res
// holds k blocks or fewer (the last block always travels).
func SkipBlocks(res hybrid.Resources, k int) (hybrid.Resources, error) {
	if k <= 0 {
		return res, nil
	}
	total := 0
	for _, r := range res.Runs {
		total += int(r.Len)
	}
	if k >= total {
		return hybrid.Resources{}, fmt.Errorf("%w: skip %d of %d KV blocks", ErrLayoutMismatch, k, total)
	}
	out := hybrid.Resources{Row: res.Row}
	for _, r := range res.Runs {
		switch {
		case k >= int(r.Len):
			k -= int(r.Len)
		case k > 0:
			out.Runs = append(out.Runs, kvcache.Run{Start: r.Start + kvcache.BlockID(k), Len: r.Len - uint32(k)})
			k = 0
		default:
			out.Runs = append(out.Runs, r)
		}
	}
	return out, nil
}
