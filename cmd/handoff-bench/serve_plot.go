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
