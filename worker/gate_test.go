package worker

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestAcceptanceGate(t *testing.T) {
	type ev struct {
		drafted, accepted int
	}
	tests := []struct {
		name   string
		obs    []ev
		closed bool
	}{
		{"window not full", []ev{{4, 0}, {4, 0}, {4, 0}}, false},
		{"good acceptance", []ev{{4, 2}, {4, 2}, {4, 1}, {4, 3}}, false},
		{"acceptance below threshold", []ev{{4, 1}, {4, 0}, {4, 1}, {4, 0}}, true},
		{"exactly the threshold is open", []ev{{4, 1}, {4, 1}, {4, 1}, {4, 1}}, false},
		{"reopens as accepted drafts slide in", []ev{{4, 0}, {4, 0}, {4, 0}, {4, 0}, {4, 4}, {4, 4}}, false},
		{"only the last window counts", []ev{{4, 4}, {4, 4}, {4, 0}, {4, 0}, {4, 0}, {4, 0}}, true},
		{"verifications of no drafts do not close it", []ev{{0, 0}, {0, 0}, {0, 0}, {0, 0}}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := newAcceptanceGate(4, 0.25)
			for _, e := range tt.obs {
				g.observe(e.drafted, e.accepted)
			}
			require.Equal(t, tt.closed, g.isClosed())
		})
	}
}

// TestAcceptanceGateProbes: a closed gate lets one step in every window
// draft, so that acceptance information keeps coming (trtllm#16888: a gate
// that drafts nothing never learns that drafts would be accepted again).
func TestAcceptanceGateProbes(t *testing.T) {
	g := newAcceptanceGate(3, 0.5)
	for range 3 {
		require.True(t, g.allow(), "open")
		g.observe(4, 0)
	}
	require.True(t, g.isClosed())
	var allowed []bool
	for range 9 {
		allowed = append(allowed, g.allow())
	}
	require.Equal(t, []bool{false, false, true, false, false, true, false, false, true}, allowed)
	// The probes' verifications accept everything: the gate reopens.
	for range 3 {
		g.observe(4, 4)
	}
	require.False(t, g.isClosed())
	require.True(t, g.allow())
}
