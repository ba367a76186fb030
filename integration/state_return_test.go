//go:build integration

package integration

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvevents"
)

// TestStateReturnsBothWays: a conversation against a prefill and a decode
// worker (remote prefill, prefix cache and --state-return on; the prefill
// worker with TP 2, the decode with TP 1, so each returned state reshards).
// After each turn the decode offers the end-of-turn state to the prefill
// worker, which pulls the blocks it lacks and the row; the next turn's
// prefill then starts after the previous reply: the cached tokens reported
// cover the previous prompt and all of its reply but the last token. Read
// from the metrics, decode -> prefill moves at most the reply's blocks plus
// one partial block and one row per turn, and prefill -> decode (a delta)
// at most the new tokens' blocks plus one. Every reply equals the
// aggregated cache-off one. Then the decode worker is killed: the next
// turn, on a new decode, is served from what the prefill worker kept.
func TestStateReturnsBothWays(t *testing.T) {
	ns := startNATS(t, nil)
	oracle := startProc(t, "decode", "--prefill", "local", "--prefix-cache", "off", "--nats-url", ns.url(), "--namespace", "ret-oracle")
	common := []string{"--nats-url", ns.url(), "--namespace", "ret", "--layerwise", "off", "--request-timeout", "60s", "--state-return", "on"}
	pre := startProc(t, "prefill", append(common, "--tp-size", "2")...)
	dec := startProc(t, "decode", append(common, "--prefill", "remote", "--instance-id", "ret-decode-1")...)
	// The decode worker publishes what its cache holds, as prefill workers
	// do: the end-of-turn states it keeps are StateStored events.
	nc, err := nats.Connect(ns.url())
	require.NoError(t, err)
	defer nc.Close()
	var states atomic.Int64
	sub, err := nc.Subscribe("handoff.ret.inst.ret-decode-1.kvevents", func(m *nats.Msg) {
		b, err := kvevents.Decode(m.Data)
		if err != nil {
			return
		}
		for _, e := range b.Events {
			if e.Kind == kvevents.StateStored {
				states.Add(1)
			}
		}
	})
	require.NoError(t, err)
	defer sub.Unsubscribe()
	for _, p := range []*proc{oracle, pre, dec} {
		p.waitReady(readyWithin)
	}
	name := modelName(t, dec.api)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const tpb = 16 // the workers' default --tokens-per-block
	metric := func(p *proc, name, role, label, value string) float64 {
		return sum(p.metrics(), name, map[string]string{"role": role, label: value})
	}
	adopted := func() float64 { return metric(pre, "handoff_state_returns_total", "prefill", "result", "adopted") }
	sentKV := func() float64 { return metric(dec, "handoff_state_return_bytes_total", "decode", "kind", "kv") }
	sentRow := func() float64 { return metric(dec, "handoff_state_return_bytes_total", "decode", "kind", "mamba") }
	deltaKV := func() float64 { return metric(dec, "handoff_transfer_bytes_total", "decode", "kind", "kv") }

	msgs := []chatMessage{{Role: "system", Content: "You keep answers short. " + strings.Repeat("Be brief. ", 10)}}
	var blockBytes, rowBytes float64
	seen, absorbed := 0, 0 // the last prompt and reply's tokens; the last state's
	for turn := range 5 {
		if turn == 4 {
			require.Eventually(t, func() bool { return states.Load() >= 4 }, 10*time.Second, 20*time.Millisecond,
				"the decode worker published no state events for the turns it kept")
			dec.kill() // the holder of the last turn's state goes; the prefill worker kept it
			dec = startProc(t, "decode", append(common, "--prefill", "remote")...)
			dec.waitReady(readyWithin)
		}
		msgs = append(msgs, chatMessage{Role: "user", Content: fmt.Sprintf("Question number %d: what is in a state row?", turn+1)})
		want, err := chat(ctx, oracle.api, name, msgs, 12, 0, 1)
		require.NoError(t, err)
		kv0, dkv0, row0 := sentKV(), deltaKV(), sentRow()
		got, err := chat(ctx, dec.api, name, msgs, 12, 0, 1)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, got.Status, "turn %d: %s", turn+1, got.Err)
		require.Equal(t, want.Content, got.Content, "turn %d: the reply differs from the cache-off one", turn+1)
		if turn == 0 {
			blockBytes = deltaKV() / float64((got.Prompt+tpb-1)/tpb)
		} else {
			require.Equal(t, absorbed, got.Cached, "turn %d: the prefill started after the previous reply", turn+1)
			if turn < 4 {
				moved := deltaKV() - dkv0
				bound := float64((got.Prompt-seen+tpb-1)/tpb+1) * blockBytes
				require.LessOrEqual(t, moved, bound, "turn %d: prefill -> decode moved more than the new tokens' blocks and a partial one", turn+1)
			}
		}
		// The end-of-turn state goes back to the prefill worker.
		require.Eventually(t, func() bool { return adopted() == float64(turn+1) }, 20*time.Second, 20*time.Millisecond,
			"turn %d: the state was not returned", turn+1)
		back, row := sentKV()-kv0, sentRow()-row0
		if rowBytes == 0 {
			rowBytes = row
		}
		bound := float64((got.Completion+tpb-1)/tpb+1) * blockBytes
		t.Logf("turn %d: %d prompt tokens (%d cached), %d generated; returned %.0f KV bytes (bound %.0f) and a %.0f-byte row",
			turn+1, got.Prompt, got.Cached, got.Completion, back, bound, row)
		require.LessOrEqual(t, back, bound, "turn %d: decode -> prefill moved more than the reply's blocks and a partial one", turn+1)
		require.Equal(t, rowBytes, row, "turn %d: one state row back", turn+1)
		seen = got.Prompt + got.Completion
		absorbed = seen - 1 // the last token is sampled, not absorbed
		msgs = append(msgs, chatMessage{Role: "assistant", Content: got.Content})
	}
	require.Positive(t, rowBytes)
	requireIdle(t, dec, "decode")
	requireIdle(t, pre, "prefill")
}
