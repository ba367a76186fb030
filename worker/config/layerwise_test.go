package config

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/worker"
)

func TestLayerwiseFlags(t *testing.T) {
	c, err := Parse(worker.RolePrefill, nil, envOf(nil), &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, "auto", c.Layerwise)
	require.Equal(t, transfer.DefaultLayerwiseMinTokens, c.LayerwiseMinTokens)
	require.Zero(t, c.PrefillChunkTokens)

	c, err = Parse(worker.RolePrefill, []string{"--layerwise", "off", "--prefill-chunk-tokens", "256"},
		envOf(map[string]string{"HANDOFF_LAYERWISE": "on", "HANDOFF_LAYERWISE_MIN_TOKENS": "64"}), &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, "off", c.Layerwise, "the flag wins over the environment")
	require.Equal(t, 64, c.LayerwiseMinTokens)
	require.Equal(t, 256, c.PrefillChunkTokens)

	// Decode takes them too: its --standalone prefill worker uses them.
	c, err = Parse(worker.RoleDecode, nil, envOf(map[string]string{"HANDOFF_LAYERWISE": "on", "HANDOFF_PREFILL_CHUNK_TOKENS": "32"}), &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, "on", c.Layerwise)
	require.Equal(t, 32, c.PrefillChunkTokens)

	for _, args := range [][]string{
		{"--layerwise", "sometimes"},
		{"--layerwise-min-tokens", "-1"},
		{"--prefill-chunk-tokens", "-8"},
	} {
		_, err := Parse(worker.RolePrefill, args, envOf(nil), &bytes.Buffer{})
		require.ErrorIs(t, err, ErrInvalid, "%v", args)
	}
}
