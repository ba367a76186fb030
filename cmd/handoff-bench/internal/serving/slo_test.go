package serving

import (
	"encoding/json"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func point(rate, attainment float64) SweepPoint {
	return SweepPoint{Rate: rate, Metrics: Metrics{SLOAttainment: attainment}}
}

func TestMaxRateAtAttainment(t *testing.T) {
	for _, tc := range []struct {
		name   string
		points []SweepPoint
		want   float64
		ok     bool
	}{
		{"monotone", []SweepPoint{point(1, 1), point(2, 0.95), point(4, 0.9), point(8, 0.5)}, 4, true},
		{"unsorted", []SweepPoint{point(8, 0.5), point(2, 0.95), point(1, 1), point(4, 0.9)}, 4, true},
		{"all pass", []SweepPoint{point(1, 1), point(2, 0.99)}, 2, true},
		{"none pass", []SweepPoint{point(1, 0.89), point(2, 0.5)}, 0, false},
		{"a pass above a miss is noise", []SweepPoint{point(1, 1), point(2, 0.8), point(3, 0.92)}, 1, true},
		{"no SLO", []SweepPoint{point(1, math.NaN())}, 0, false},
		{"empty", nil, 0, false},
	} {
		got, ok := MaxRateAtAttainment(tc.points, 0.9)
		require.Equal(t, tc.ok, ok, tc.name)
		require.Equal(t, tc.want, got, tc.name)
	}
}

func TestSweepReport(t *testing.T) {
	pts := []SweepPoint{point(1, 1), point(2, 0.5)}
	b, err := json.Marshal(SweepReport(pts, SLO{"ttft": 100, "tpot": 10}, 0.9, []string{"ttft"}, false))
	require.NoError(t, err)
	var v struct {
		Best   *float64         `json:"max_rate_at_attainment"`
		SLO    map[string]any   `json:"goodput_slo_ms"`
		Target float64          `json:"attainment_target"`
		Runs   []map[string]any `json:"runs"`
	}
	require.NoError(t, json.Unmarshal(b, &v))
	require.NotNil(t, v.Best)
	require.Equal(t, 1.0, *v.Best)
	require.Equal(t, 0.9, v.Target)
	require.Len(t, v.Runs, 2)
	require.Contains(t, v.Runs[0], "p90_ttft_ms")
	require.Contains(t, v.Runs[0], "p90_tpot_ms")

	var out strings.Builder
	require.NoError(t, WriteSweepTable(&out, pts, 0.9, true))
	require.Contains(t, out.String(), "goodput: 1 req/s, the highest swept rate with >= 90 % SLO attainment")
	require.Contains(t, out.String(), "PARTIAL")
	out.Reset()
	require.NoError(t, WriteSweepTable(&out, []SweepPoint{point(3, 0.2)}, 0.9, false))
	require.Contains(t, out.String(), "none of the swept rates reached 90 %")
}
