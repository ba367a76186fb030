//go:build !race

package model_test

import (
	"testing"

	"github.com/handoff-io/handoff/model"
)

// The real presets' states are tens of MiB: too slow under the race detector.

func TestPresetStateSensitivity(t *testing.T) {
	for _, name := range []string{model.NemotronH8B, model.Qwen3Next80B} {
		t.Run(name, func(t *testing.T) { checkStateSensitivity(t, lookup(t, name)) })
	}
}

func TestPresetFillsState(t *testing.T) {
	for _, name := range []string{model.NemotronH8B, model.Qwen3Next80B} {
		t.Run(name, func(t *testing.T) { checkFillsState(t, lookup(t, name)) })
	}
}

func TestPresetInvalidCalls(t *testing.T) {
	checkInvalidCalls(t, lookup(t, model.NemotronH8B))
}
