package size

import (
	"math"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// The cases of the two grammars this one replaced (handoff-nats's and
// handoff-bench's), both kept.
func TestParse(t *testing.T) {
	tests := []struct {
		in      string
		want    int64
		wantErr bool
	}{
		{"0", 0, false},
		{"1048576", 1 << 20, false},
		{"8MiB", 8 << 20, false},
		{"8M", 8 << 20, false},
		{"8 MiB", 8 << 20, false},
		{"1MB", 1_000_000, false},
		{"2GiB", 2 << 30, false},
		{"3KB", 3000, false},
		{"10B", 10, false},
		{"4KiB", 4096, false},
		{"64k", 64 << 10, false},
		{"65536", 65536, false},
		{" 4 KiB ", 4096, false},
		{"7 TiB", 7 << 40, false},
		{"", 0, true},
		{"MiB", 0, true},
		{"KiB", 0, true},
		{"-1", 0, true},
		{"-1KiB", 0, true},
		{"1.5GiB", 0, true},
		{"1.5MiB", 0, true},
		{"9223372036854775807GiB", 0, true},
		{"9999999999GiB", 0, true},
		{"99999999999999999999", 0, true},
		{"12XB", 0, true},
		{"4XiB", 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := Parse(tt.in)
			if tt.wantErr {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, got)
		})
	}
}

func FuzzParse(f *testing.F) {
	for _, s := range []string{"0", "8MiB", "1GB", "-3", "", "KiB", "99999999999999999999", "7 TiB", "64k"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := Parse(s)
		if err != nil {
			return
		}
		require.GreaterOrEqual(t, n, int64(0))
		// A plain count parses back to itself.
		back, err := Parse(strconv.FormatInt(n, 10))
		require.NoError(t, err)
		require.Equal(t, n, back)
	})
}

func TestParseRoundTrip(t *testing.T) {
	for _, n := range []int64{0, 1, 1023, 1 << 20, math.MaxInt64} {
		got, err := Parse(strconv.FormatInt(n, 10))
		require.NoError(t, err)
		require.Equal(t, n, got)
	}
}
