package config

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/worker"
)

func TestSpeculativeFlags(t *testing.T) {
	for _, role := range []worker.Role{worker.RolePrefill, worker.RoleDecode} {
		c, err := Parse(role, nil, envOf(nil), &bytes.Buffer{})
		require.NoError(t, err)
		require.Equal(t, "off", c.Speculative, "off by default")
		require.Zero(t, c.SpecTokens())
		require.Zero(t, c.DraftLenSchedule.Len())

		c, err = Parse(role, []string{"--speculative", "ngram", "--draft-len-schedule", "1:4,4:2,8:0"},
			envOf(map[string]string{"HANDOFF_SPECULATIVE": "off", "HANDOFF_NUM_SPECULATIVE_TOKENS": "4"}), &bytes.Buffer{})
		require.NoError(t, err)
		require.Equal(t, "ngram", c.Speculative, "the flag wins over the environment")
		require.Equal(t, 4, c.SpecTokens(), "the environment fills what no flag set")
		require.Equal(t, "1:4,4:2,8:0", c.DraftLenSchedule.String())
		require.False(t, c.AcceptanceGating())

		c, err = Parse(role, []string{"--speculative", "ngram", "--acceptance-rate-window", "16"},
			envOf(map[string]string{"HANDOFF_ACCEPTANCE_RATE_THRESHOLD": "0.25"}), &bytes.Buffer{})
		require.NoError(t, err)
		require.True(t, c.AcceptanceGating())
		require.Equal(t, 16, c.AcceptanceRateWindow)
		require.Equal(t, 0.25, c.AcceptanceRateThreshold)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--speculative", "eagle"}, `--speculative "eagle": want off, ngram or mtp`},
		{[]string{"--speculative", "mtp"}, `--speculative mtp: model "tiny-hybrid" has no draft head (name it with ?mtp=1`},
		{[]string{"--speculative", "ngram", "--num-speculative-tokens", "0"}, "--num-speculative-tokens 0: want 1..16"},
		{[]string{"--speculative", "ngram", "--num-speculative-tokens", "17"}, "--num-speculative-tokens 17"},
		{[]string{"--speculative", "ngram", "--draft-len-schedule", "1:4,4:5"}, `--draft-len-schedule "1:4,4:5": mambacache: invalid draft-length schedule: entry 2 4:5`},
		{[]string{"--speculative", "ngram", "--draft-len-schedule", "1:x"}, `--draft-len-schedule "1:x"`},
		{[]string{"--speculative", "ngram", "--draft-len-schedule", "1:4"}, "entry 1:4 drafts more than --num-speculative-tokens 3"},
		{[]string{"--draft-len-schedule", "1:2"}, `--draft-len-schedule "1:2" without --speculative`},
		{[]string{"--speculative", "mtp", "--model", "tiny-hybrid?mtp=1", "--memory", "cuda"}, `--model "tiny-hybrid?mtp=1" with --memory cuda`},
		{[]string{"--speculative", "ngram", "--acceptance-rate-window", "8"}, "--acceptance-rate-window 8 --acceptance-rate-threshold 0: want both 0"},
		{[]string{"--speculative", "ngram", "--acceptance-rate-threshold", "0.3"}, "--acceptance-rate-window 0 --acceptance-rate-threshold 0.3"},
		{[]string{"--speculative", "ngram", "--acceptance-rate-window", "8", "--acceptance-rate-threshold", "1.5"}, "threshold in (0, 1]"},
		{[]string{"--acceptance-rate-window", "8", "--acceptance-rate-threshold", "0.3"}, "without --speculative"},
	} {
		_, err := Parse(worker.RoleDecode, tc.args, envOf(nil), &bytes.Buffer{})
		require.ErrorIs(t, err, ErrInvalid, "%v", tc.args)
		require.ErrorContains(t, err, tc.want, "%v", tc.args)
	}
	// A prefill worker drafts with its model's head whatever its own flags,
	// so a model with a head is refused over device memory there too.
	_, err := Parse(worker.RolePrefill, []string{"--model", "tiny-hybrid?mtp=1", "--memory", "cuda"}, envOf(nil), &bytes.Buffer{})
	require.ErrorIs(t, err, ErrInvalid)
	require.ErrorContains(t, err, `--model "tiny-hybrid?mtp=1" with --memory cuda`)
}
