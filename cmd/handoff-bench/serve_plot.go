package main

import (
	"cmp"
	"fmt"
	"image/color"
	"os"
	"slices"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"github.com/handoff-io/handoff/cmd/handoff-bench/internal/serving"
)

// writeSweepPlot draws a sweep as three panels sharing the rate axis: p90
// TTFT with its objective, p90 TPOT with its objective, and SLO attainment
// with the target, and writes them to path as a PNG.
func writeSweepPlot(path string, points []serving.SweepPoint, slo serving.SLO, target float64, partial bool) error {
	pts := slices.Clone(points)
	slices.SortStableFunc(pts, func(a, b serving.SweepPoint) int { return cmp.Compare(a.Rate, b.Rate) })
	xy := func(f func(serving.SweepPoint) float64) plotter.XYs {
		out := make(plotter.XYs, len(pts))
		for i, p := range pts {
			out[i] = plotter.XY{X: p.Rate, Y: f(p)}
		}
		return out
	}
	lo, hi := pts[0].Rate, pts[len(pts)-1].Rate
	title := "handoff-bench serve: rate sweep"
	if partial {
		title += " (PARTIAL: interrupted)"
	}
	panels := []struct {
		title, ylabel, legend string
		data                  plotter.XYs
		goal                  float64
		goalLabel             string
		c                     color.RGBA
	}{
		{title, "p90 TTFT (ms)", "p90 TTFT", xy(func(p serving.SweepPoint) float64 { return p.Metrics.PercentileOf("ttft", 90) }),
			slo["ttft"], fmt.Sprintf("TTFT SLO %g ms", slo["ttft"]), color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}},
		{"", "p90 TPOT (ms)", "p90 TPOT", xy(func(p serving.SweepPoint) float64 { return p.Metrics.PercentileOf("tpot", 90) }),
			slo["tpot"], fmt.Sprintf("TPOT SLO %g ms", slo["tpot"]), color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff}},
		{"", "SLO attainment (%)", "attainment", xy(func(p serving.SweepPoint) float64 { return 100 * p.Metrics.SLOAttainment }),
			100 * target, fmt.Sprintf("target %g %%", 100*target), color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff}},
	}
	ticks := make(plot.ConstantTicks, len(pts)) // a tick at each swept rate
	for i, p := range pts {
		ticks[i] = plot.Tick{Value: p.Rate, Label: strconv.FormatFloat(p.Rate, 'g', -1, 64)}
	}
	plots := make([][]*plot.Plot, len(panels))
	for i, pn := range panels {
		p := plot.New()
		p.Title.Text = pn.title
		p.Y.Label.Text = pn.ylabel
		p.X.Label.Text = "request rate (req/s)"
		p.X.Tick.Marker = ticks
		p.Y.Min = 0
		top := pn.goal
		for _, d := range pn.data {
			top = max(top, d.Y)
		}
		p.Y.Max = 1.3 * top // room for the legend above the curves and the objective
		p.Add(plotter.NewGrid())
		line, dots, err := plotter.NewLinePoints(pn.data)
		if err != nil {
			return fmt.Errorf("serve: plot: %w", err)
		}
		line.Color, dots.Color = pn.c, pn.c
		goal, err := plotter.NewLine(plotter.XYs{{X: lo, Y: pn.goal}, {X: hi, Y: pn.goal}})
		if err != nil {
			return fmt.Errorf("serve: plot: %w", err)
		}
		goal.Color = color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}
		goal.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		p.Add(line, dots, goal)
		p.Legend.Add(pn.legend, line, dots)
		p.Legend.Add(pn.goalLabel, goal)
		p.Legend.Left = true // latencies grow to the right and attainment falls there
		p.Legend.Top = i < 2
		if i == 2 {
			p.Y.Max = 105 // the legend goes bottom left, under the high attainment of low rates
		}
		plots[i] = []*plot.Plot{p}
	}
	if err := writeColumnPNG(path, plots); err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	return nil
}

// writeColumnPNG draws plots one above the other, aligned, into a PNG at
// path (each row of plots holds one plot).
func writeColumnPNG(path string, plots [][]*plot.Plot) error {
	img := vgimg.New(7*vg.Inch, 9*vg.Inch)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: len(plots), Cols: 1, PadX: vg.Millimeter, PadY: 4 * vg.Millimeter,
		PadTop: vg.Points(4), PadBottom: vg.Points(4), PadLeft: vg.Points(4), PadRight: vg.Points(8)}
	canvases := plot.Align(plots, tiles, dc)
	for i := range plots {
		plots[i][0].Draw(canvases[i][0])
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("plot: %w", err)
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return fmt.Errorf("plot %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("plot %s: %w", path, err)
	}
	return nil
}

// writeMultiTurnPlot draws a multi-turn workload's runs against the turn
// index: TTFT p50 (solid) and p90 (dashed) per turn, then the prompt tokens
// computed per turn (mean; prompt_tokens − cached_tokens) beside what a
// perfect cache would compute, one color per run (cache on, off), and
// writes them to path as a PNG.
func writeMultiTurnPlot(path string, runs []multiTurnRun, partial bool) error {
	colors := []color.RGBA{{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}, {R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
		{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff}, {R: 0xd6, G: 0x27, B: 0x28, A: 0xff}, {R: 0x94, G: 0x67, B: 0xbd, A: 0xff}}
	title := "handoff-bench serve: multi-turn, TTFT per turn"
	if partial {
		title += " (PARTIAL: interrupted)"
	}
	ttft, comp := plot.New(), plot.New()
	ttft.Title.Text = title
	ttft.Y.Label.Text = "TTFT (ms)"
	comp.Y.Label.Text = "computed prompt tokens (mean)"
	var ticks plot.ConstantTicks
	for _, p := range []*plot.Plot{ttft, comp} {
		p.X.Label.Text = "turn"
		p.Y.Min = 0
		p.Add(plotter.NewGrid())
		p.Legend.Top, p.Legend.Left = true, true
	}
	name := func(r multiTurnRun) string {
		if r.PrefixCache == "" {
			return "run"
		}
		return "cache " + r.PrefixCache
	}
	var ideal plotter.XYs
	for i, r := range runs {
		c := colors[i%len(colors)]
		var p50, p90, cp plotter.XYs
		for t, s := range r.PerTurn {
			if s.Turns == 0 {
				continue
			}
			x := float64(t + 1)
			p50 = append(p50, plotter.XY{X: x, Y: s.TTFTp50})
			p90 = append(p90, plotter.XY{X: x, Y: s.TTFTp90})
			cp = append(cp, plotter.XY{X: x, Y: float64(s.ComputedTokens) / float64(s.Turns)})
			if i == 0 {
				ideal = append(ideal, plotter.XY{X: x, Y: float64(s.PromptTokens-s.IdealHit) / float64(s.Turns)})
				ticks = append(ticks, plot.Tick{Value: x, Label: strconv.Itoa(t + 1)})
			}
		}
		if len(p50) == 0 {
			continue
		}
		for _, l := range []struct {
			p      *plot.Plot
			xy     plotter.XYs
			dashed bool
			legend string
		}{{ttft, p50, false, name(r) + " p50"}, {ttft, p90, true, name(r) + " p90"}, {comp, cp, false, name(r)}} {
			line, dots, err := plotter.NewLinePoints(l.xy)
			if err != nil {
				return fmt.Errorf("serve: plot: %w", err)
			}
			line.Color, dots.Color = c, c
			if l.dashed {
				line.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
			}
			l.p.Add(line, dots)
			l.p.Legend.Add(l.legend, line, dots)
		}
	}
	if len(ideal) > 0 {
		line, err := plotter.NewLine(ideal)
		if err != nil {
			return fmt.Errorf("serve: plot: %w", err)
		}
		line.Color = color.RGBA{R: 0x7f, G: 0x7f, B: 0x7f, A: 0xff}
		line.Dashes = []vg.Length{vg.Points(2), vg.Points(2)}
		comp.Add(line)
		comp.Legend.Add("a perfect cache", line)
	}
	for _, p := range []*plot.Plot{ttft, comp} {
		p.X.Tick.Marker = ticks
		p.Y.Max *= 1.3 // room for the legend
	}
	if err := writeColumnPNG(path, [][]*plot.Plot{{ttft}, {comp}}); err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	return nil
}
