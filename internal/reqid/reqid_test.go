package reqid

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/purity"
)

// TestIDs pins the edges of both ranges for the draft lengths a model uses
// (0: no speculative decoding; 1; 3: MTP-3) and for a negative one, which
// counts as 0.
func TestIDs(t *testing.T) {
	const top = math.MaxUint64
	cases := []struct {
		id      uint64
		draft   int
		padding bool
		dummy   bool
		why     string
	}{
		{0, 0, false, true, "the ADP dummy is no sentinel"},
		{0, 1, false, true, ""},
		{0, 3, false, true, ""},
		{0, -1, false, true, ""},
		{1, 0, false, false, "the first real id"},
		{1, 3, false, false, ""},
		{42, 3, false, false, ""},
		{top, 0, true, true, "the sentinel itself, whatever the draft"},
		{top - 1, 0, false, false, "just below a draft-0 range"},
		{top, 1, true, true, ""},
		{top - 1, 1, true, true, "the bottom of a draft-1 range"},
		{top - 2, 1, false, false, "just below a draft-1 range"},
		{top, 3, true, true, ""},
		{top - 3, 3, true, true, "the bottom of a draft-3 range"},
		{top - 4, 3, false, false, "just below a draft-3 range"},
		{top, -1, true, true, "a negative draft counts as 0"},
		{top - 1, -1, false, false, ""},
		{top - 1, -5, false, false, ""},
		{1 << 63, math.MaxInt, true, true, "the widest range reaches 2^63, not past 0"},
		{1<<63 - 1, math.MaxInt, false, false, ""},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("id=%d/draft=%d", c.id, c.draft), func(t *testing.T) {
			require.Equal(t, c.padding, IsPadding(c.id, c.draft), c.why)
			require.Equal(t, c.dummy, IsDummy(c.id, c.draft), c.why)
		})
	}
}

// TestDeps keeps the package a leaf: the standard library's math only.
func TestDeps(t *testing.T) { purity.CheckDeps(t, map[string]bool{"math": true}) }

// TestNoGoroutines keeps the package pure.
func TestNoGoroutines(t *testing.T) { purity.CheckNoGoroutines(t) }
