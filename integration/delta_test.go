//go:build integration

package integration

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestDeltaHandoffMovesOnlyWhatDecodeLacks: a conversation against a
// prefill and a decode worker (remote prefill, prefix cache on). The decode
// keeps each finished turn's KV blocks, so from turn 2 on a handoff moves
// only the blocks of the tokens it has not seen (the new user message, and
// the block the previous reply ended in) and the state row, read from the
// decode worker's metrics: at most the new tokens' blocks plus one partial
// block. Every reply equals the aggregated cache-off one.
func TestDeltaHandoffMovesOnlyWhatDecodeLacks(t *testing.T) {
	ns := startNATS(t, nil)
	oracle := startProc(t, "decode", "--prefill", "local", "--prefix-cache", "off", "--nats-url", ns.url(), "--namespace", "delta-oracle")
	common := []string{"--nats-url", ns.url(), "--namespace", "delta", "--layerwise", "off"}
	pre := startProc(t, "prefill", common...)
	dec := startProc(t, "decode", append(common, "--prefill", "remote")...)
	for _, p := range []*proc{oracle, pre, dec} {
		p.waitReady(readyWithin)
	}
	name := modelName(t, dec.api)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const tpb = 16 // the workers' default --tokens-per-block
	kv := func() float64 {
		return sum(dec.metrics(), "handoff_transfer_bytes_total", map[string]string{"role": "decode", "kind": "kv"})
	}
	mamba := func() float64 {
		return sum(dec.metrics(), "handoff_transfer_bytes_total", map[string]string{"role": "decode", "kind": "mamba"})
	}
	msgs := []chatMessage{{Role: "system", Content: "You keep answers short. " + strings.Repeat("Be brief. ", 10)}}
	var blockBytes, rowBytes float64
	seen := 0 // tokens of the last prompt and its reply: what the decode holds
	for turn := range 5 {
		msgs = append(msgs, chatMessage{Role: "user", Content: fmt.Sprintf("Question number %d: what is in a state row?", turn+1)})
		want, err := chat(ctx, oracle.api, name, msgs, 12, 0, 1)
		require.NoError(t, err)
		kv0, m0 := kv(), mamba()
		got, err := chat(ctx, dec.api, name, msgs, 12, 0, 1)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, got.Status, "turn %d: %s", turn+1, got.Err)
		require.Equal(t, want.Content, got.Content, "turn %d: the reply differs from the cache-off one", turn+1)
		moved, row := kv()-kv0, mamba()-m0
		blocks := (got.Prompt + tpb - 1) / tpb
		if turn == 0 {
			blockBytes, rowBytes = moved/float64(blocks), row
			require.Positive(t, blockBytes)
		} else {
			bound := float64((got.Prompt-seen+tpb-1)/tpb+1) * blockBytes
			t.Logf("turn %d: %d prompt tokens, %d new: %.0f KV bytes moved (%.0f blocks of %d), bound %.0f; row %.0f bytes",
				turn+1, got.Prompt, got.Prompt-seen, moved, moved/blockBytes, blocks, bound, row)
			require.LessOrEqual(t, moved, bound, "turn %d moved more than the new tokens' blocks and a partial one", turn+1)
			require.Less(t, moved, float64(blocks)*blockBytes, "turn %d moved the whole prompt", turn+1)
		}
		require.Equal(t, rowBytes, row, "turn %d: one state row", turn+1)
		seen = got.Prompt + got.Completion
		msgs = append(msgs, chatMessage{Role: "assistant", Content: got.Content})
	}
	require.Positive(t, sum(dec.metrics(), "handoff_delta_skipped_blocks_total", nil))
	requireIdle(t, dec, "decode")
	requireIdle(t, pre, "prefill")
}
