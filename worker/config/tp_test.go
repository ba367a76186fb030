package config

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/worker"
)

// --tp-size (HANDOFF_TP_SIZE) defaults to 1, and the combinations with
// attention DP, which keeps the full state on every rank, are refused by
// flag name.
func TestTPSize(t *testing.T) {
	c, err := Parse(worker.RolePrefill, nil, envOf(nil), &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, 1, c.TPSize)
	c, err = Parse(worker.RolePrefill, nil, envOf(map[string]string{"HANDOFF_TP_SIZE": "4"}), &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, 4, c.TPSize)
	c, err = Parse(worker.RoleDecode, []string{"--tp-size", "2"}, envOf(nil), &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, 2, c.TPSize)
	for _, args := range [][]string{
		{"--tp-size", "0"},
		{"--tp-size", "65"},
		{"--tp-size", "2", "--dp-size", "2"},
		{"--tp-size", "2", "--attention-dp", "true"},
	} {
		_, err := Parse(worker.RoleDecode, args, envOf(nil), &bytes.Buffer{})
		require.ErrorContains(t, err, "--tp-size", "%v", args)
	}
	var help bytes.Buffer
	_, _ = Parse(worker.RoleDecode, []string{"--help"}, envOf(nil), &help)
	require.Contains(t, help.String(), "HANDOFF_TP_SIZE")
	require.Contains(t, help.String(), "attention DP")
}
