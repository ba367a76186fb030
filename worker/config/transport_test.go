package config

import (
	"io"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/worker"
)

// TestTransportUCX: --transport ucx (and its env twin) parses in every
// build; whether the binary has UCX is checked when the node starts.
func TestTransportUCX(t *testing.T) {
	for _, role := range []worker.Role{worker.RolePrefill, worker.RoleDecode} {
		c, err := Parse(role, []string{"--transport", "ucx"}, envOf(nil), io.Discard)
		require.NoError(t, err)
		require.Equal(t, "ucx", c.Transport)
		c, err = Parse(role, nil, envOf(map[string]string{"HANDOFF_TRANSPORT": "ucx"}), io.Discard)
		require.NoError(t, err)
		require.Equal(t, "ucx", c.Transport)
		_, err = Parse(role, []string{"--transport", "verbs"}, envOf(nil), io.Discard)
		require.ErrorContains(t, err, "ucx")
	}
}
