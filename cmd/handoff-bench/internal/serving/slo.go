package serving

import (
	"cmp"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"text/tabwriter"
)

// DefaultAttainmentTarget is DistServe's: a rate is served when at least
// 90 % of the requests meet both the TTFT and the TPOT objective.
const DefaultAttainmentTarget = 0.9

// SweepPoint is one rate of a sweep and its run.
type SweepPoint struct {
	Rate    float64
	Header  Header
	Metrics Metrics
	Results []Result // the per-request results for the report, or nil
}

// MaxRateAtAttainment returns DistServe's goodput over a sweep: the highest
// swept rate at which SLO attainment is at least target and at every lower
// swept rate too (a rate that passes only above one that failed is taken for
// noise, not capacity). ok is false when the lowest rate already misses.
// Points may come in any order.
func MaxRateAtAttainment(points []SweepPoint, target float64) (rate float64, ok bool) {
	sorted := slices.Clone(points)
	slices.SortStableFunc(sorted, func(a, b SweepPoint) int { return cmp.Compare(a.Rate, b.Rate) })
	for _, p := range sorted {
		if math.IsNaN(p.Metrics.SLOAttainment) || p.Metrics.SLOAttainment < target {
			break
		}
		rate, ok = p.Rate, true
	}
	return rate, ok
}

// SweepReport is the JSON of a sweep: the SLO, the target, the goodput rate
// (null when no rate met the target) and each rate's report, with its p90
// TTFT and TPOT (and its per-request arrays where the point has Results).
func SweepReport(points []SweepPoint, slo SLO, target float64, selected []string, partial bool) Fields {
	runs := make([]Fields, len(points))
	for i, p := range points {
		f := Report(p.Header, p.Metrics, selected, p.Results)
		f = append(f, Field{"p90_ttft_ms", p.Metrics.PercentileOf("ttft", 90)},
			Field{"p90_tpot_ms", p.Metrics.PercentileOf("tpot", 90)})
		runs[i] = f
	}
	var best any
	if r, ok := MaxRateAtAttainment(points, target); ok {
		best = r
	}
	sloF := Fields{}
	for _, k := range SLOMetrics {
		if v, ok := slo[k]; ok {
			sloF = append(sloF, Field{k, v})
		}
	}
	return Fields{
		{"partial", partial},
		{"goodput_slo_ms", sloF},
		{"attainment_target", target},
		{"max_rate_at_attainment", best},
		{"runs", runs},
	}
}

// WriteSweepTable prints one line per rate and the goodput rate.
func WriteSweepTable(w io.Writer, points []SweepPoint, target float64, partial bool) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "rate (req/s)\tcompleted\tfailed\treq/s\tgoodput (req/s)\tp90 TTFT (ms)\tp90 TPOT (ms)\tattainment (%)\t")
	for _, p := range points {
		m := p.Metrics
		fmt.Fprintf(tw, "%g\t%d\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t%.1f\t\n", p.Rate, m.Completed, m.Failed,
			m.RequestThroughput, m.RequestGoodput, m.PercentileOf("ttft", 90), m.PercentileOf("tpot", 90),
			100*m.SLOAttainment)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	var b strings.Builder
	if partial {
		b.WriteString("PARTIAL: the sweep was interrupted; the last rate's run is partial\n")
	}
	if r, ok := MaxRateAtAttainment(points, target); ok {
		fmt.Fprintf(&b, "goodput: %g req/s, the highest swept rate with >= %.0f %% SLO attainment\n", r, 100*target)
	} else {
		fmt.Fprintf(&b, "goodput: none of the swept rates reached %.0f %% SLO attainment\n", 100*target)
	}
	_, err := io.WriteString(w, b.String())
	return err
}
