package main

import (
	"context"
	"io"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

func TestLayerwiseFlags(t *testing.T) {
	o, err := parseLayerwiseFlags(nil, io.Discard)
	require.NoError(t, err)
	require.Equal(t, []int{1024, 4096}, o.tokens)
	require.Equal(t, "tcp", o.transport)
	o, err = parseLayerwiseFlags([]string{"--prompt-tokens", "16, 64", "--requests", "2", "--transport", "shm", "--output", "json"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, []int{16, 64}, o.tokens)
	for _, bad := range [][]string{
		{"--prompt-tokens", "0"}, {"--prompt-tokens", "a"}, {"--requests", "0"},
		{"--transport", "inproc"}, {"--output", "csv"},
	} {
		_, err := parseLayerwiseFlags(bad, io.Discard)
		require.Error(t, err, "%v", bad)
	}
	for _, n := range []int{1, 61, 62, 1000} {
		require.Len(t, model.Encode(layerwisePrompt(n)), n)
	}
}

// The bench runs its five workers in process, here with a TP-2 prefill
// streaming into a TP-1 decode, and reports one row per prompt length (no
// figure is checked: a loaded machine times anything).
func TestLayerwiseMeasures(t *testing.T) {
	if testing.Short() {
		t.Skip("starts five workers")
	}
	rep, err := measureLayerwise(context.Background(), layerwiseOptions{model: model.TinyHybrid + "?prefill_delay=100us",
		tokens: []int{40, 100}, requests: 1, transport: "tcp", chunk: 32, prefillTP: 2, decodeTP: 1, output: "json"})
	require.NoError(t, err)
	require.Len(t, rep.Rows, 2)
	require.Equal(t, 2, rep.PrefillTP)
	for _, r := range rep.Rows {
		require.Positive(t, r.LocalTTFT)
		require.Positive(t, r.OffTTFT)
		require.Positive(t, r.OnTTFT)
		require.Positive(t, r.CacheMiB)
	}
	_, err = measureLayerwise(context.Background(), layerwiseOptions{model: model.TinyHybrid, tokens: []int{5000}, requests: 1, transport: "tcp", prefillTP: 1, decodeTP: 1})
	require.Error(t, err, "a prompt beyond the model's context")
}
