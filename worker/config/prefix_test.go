package config

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/worker"
)

func TestPrefixCacheFlags(t *testing.T) {
	for _, role := range []worker.Role{worker.RolePrefill, worker.RoleDecode} {
		c, err := Parse(role, nil, envOf(nil), &bytes.Buffer{})
		require.NoError(t, err)
		require.Equal(t, "on", c.PrefixCache, "on by default")
		require.Equal(t, -1, c.StateCheckpoints)
		require.Equal(t, worker.DefaultCheckpointInterval, c.StateCheckpointInterval)
		require.Equal(t, "state", c.PrefillRouting)
		require.Equal(t, "on", c.StateReturn)

		c, err = Parse(role, []string{"--prefix-cache", "off", "--state-checkpoints", "3"},
			envOf(map[string]string{"HANDOFF_PREFIX_CACHE": "on", "HANDOFF_STATE_CHECKPOINT_INTERVAL": "0", "HANDOFF_PREFILL_ROUTING": "load",
				"HANDOFF_STATE_RETURN": "off"}), &bytes.Buffer{})
		require.NoError(t, err)
		require.Equal(t, "off", c.PrefixCache, "the flag wins over the environment")
		require.Equal(t, 3, c.StateCheckpoints)
		require.Zero(t, c.StateCheckpointInterval)
		require.Equal(t, "load", c.PrefillRouting)
		require.Equal(t, "off", c.StateReturn)
	}
	for _, args := range [][]string{
		{"--prefix-cache", "yes"},
		{"--state-checkpoints", "-2"},
		{"--state-checkpoint-interval", "-1"},
		{"--prefill-routing", "random"},
		{"--state-return", "maybe"},
	} {
		_, err := Parse(worker.RolePrefill, args, envOf(nil), &bytes.Buffer{})
		require.ErrorIs(t, err, ErrInvalid, "%v", args)
	}
}

func TestDefaultStateCheckpoints(t *testing.T) {
	require.Equal(t, 32, worker.DefaultStateCheckpoints(8, 4096), "small rows: four per real row")
	require.Equal(t, 20, worker.DefaultStateCheckpoints(8, 49<<20), "large rows: within 1 GiB")
	require.Equal(t, 1, worker.DefaultStateCheckpoints(8, 2<<30), "at least one")
}
