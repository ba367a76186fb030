package main

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

const sweepA = `{"partial": false, "goodput_slo_ms": {"ttft": 1000, "tpot": 10}, "attainment_target": 0.9,
 "max_rate_at_attainment": 2, "runs": [
  {"label": "long-agg", "request_rate": 4, "completed": 40, "failed": 1, "slo_attainment": 0.5, "p90_ttft_ms": 2500.4, "p90_tpot_ms": 14.26},
  {"label": "long-agg", "request_rate": 2, "completed": 40, "failed": 0, "slo_attainment": 0.95, "p90_ttft_ms": 400, "p90_tpot_ms": 8}]}`

const sweepB = `{"partial": true, "goodput_slo_ms": {"ttft": 1000, "tpot": 10}, "attainment_target": 0.9,
 "max_rate_at_attainment": null, "runs": [
  {"label": "", "request_rate": 2, "completed": 40, "failed": 0, "slo_attainment": 0.8, "p90_ttft_ms": 900, "p90_tpot_ms": 12}]}`

func TestCompareTableAndPlot(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.json"), filepath.Join(dir, "long-disagg.json")
	require.NoError(t, os.WriteFile(a, []byte(sweepA), 0o644))
	require.NoError(t, os.WriteFile(b, []byte(sweepB), 0o644))
	png := filepath.Join(dir, "cmp.png")
	var out, errOut bytes.Buffer
	require.NoError(t, runCompare([]string{"--plot", png, a, b}, &out, &errOut))
	require.Equal(t, `| setup | goodput (req/s) | rate (req/s): attainment (%) | p90 TTFT (ms) | p90 TPOT (ms) |
|---|---:|---|---|---|
| long-agg | 2 | 2: 95.0, 4: 50.0 (1 failed) | 400, 2500 | 8.0, 14.3 |
| long-disagg | none (partial) | 2: 80.0 | 900 | 12.0 |
`, out.String(), "rates sorted; the label from the report, else the file name")
	b2, err := os.ReadFile(png)
	require.NoError(t, err)
	require.True(t, bytes.HasPrefix(b2, []byte("\x89PNG\r\n\x1a\n")))
}

func TestCompareRefusesBadInput(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.json")
	require.NoError(t, os.WriteFile(bad, []byte(`{"runs": []}`), 0o644))
	var out, errOut bytes.Buffer
	require.ErrorContains(t, runCompare([]string{bad}, &out, &errOut), "no runs")
	require.NoError(t, os.WriteFile(bad, []byte(`{"runs": [`), 0o644))
	require.ErrorContains(t, runCompare([]string{bad}, &out, &errOut), "bad.json")
	require.ErrorContains(t, runCompare(nil, &out, &errOut), "no sweep report")
	require.ErrorContains(t, runCompare([]string{filepath.Join(dir, "missing.json")}, &out, &errOut), "missing.json")
}
