package main

import (
	"cmp"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"image/color"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

const compareUsage = `usage: handoff-bench compare [--plot FILE] SWEEP.json...

Reads the JSON reports of serve --sweep-rates runs (--result-file) of one
workload on several setups, prints a markdown table of each setup's goodput (the highest swept
rate with the target SLO attainment) and each rate's attainment, p90 TTFT
and p90 TPOT, and with --plot draws them against rate, one line per setup.
A setup is named by its report's --label, else by its file name.

`

// sweepFile is what compare reads of a serve sweep report.
type sweepFile struct {
	Label    string             `json:"-"`
	SLO      map[string]float64 `json:"goodput_slo_ms"`
	Target   float64            `json:"attainment_target"`
	Goodput  *float64           `json:"max_rate_at_attainment"`
	Partial  bool               `json:"partial"`
	Runs     []sweepRun         `json:"runs"`
	filename string
}

type sweepRun struct {
	Label      string  `json:"label"`
	Rate       float64 `json:"request_rate"`
	Completed  int     `json:"completed"`
	Failed     int     `json:"failed"`
	Attainment float64 `json:"slo_attainment"`
	P90TTFT    float64 `json:"p90_ttft_ms"`
	P90TPOT    float64 `json:"p90_tpot_ms"`
}

// parseSweep decodes a sweep report; name labels it when its runs have no
// label.
func parseSweep(b []byte, name string) (sweepFile, error) {
	var s sweepFile
	if err := json.Unmarshal(b, &s); err != nil {
		return s, fmt.Errorf("compare: %s: %w", name, err)
	}
	if len(s.Runs) == 0 {
		return s, fmt.Errorf("compare: %s: no runs (not a serve --sweep-rates report?)", name)
	}
	slices.SortStableFunc(s.Runs, func(a, b sweepRun) int { return cmp.Compare(a.Rate, b.Rate) })
	s.Label = s.Runs[0].Label
	if s.Label == "" {
		s.Label = strings.TrimSuffix(filepath.Base(name), filepath.Ext(name))
	}
	s.filename = name
	return s, nil
}

// writeCompareMarkdown prints one table row per setup.
func writeCompareMarkdown(w io.Writer, sweeps []sweepFile) error {
	fmt.Fprintln(w, "| setup | goodput (req/s) | rate (req/s): attainment (%) | p90 TTFT (ms) | p90 TPOT (ms) |")
	fmt.Fprintln(w, "|---|---:|---|---|---|")
	for _, s := range sweeps {
		good := "none"
		if s.Goodput != nil {
			good = strconv.FormatFloat(*s.Goodput, 'g', -1, 64)
		}
		if s.Partial {
			good += " (partial)"
		}
		var att, ttft, tpot []string
		for _, r := range s.Runs {
			a := fmt.Sprintf("%g: %.1f", r.Rate, 100*r.Attainment)
			if r.Failed > 0 {
				a += fmt.Sprintf(" (%d failed)", r.Failed)
			}
			att = append(att, a)
			ttft = append(ttft, fmt.Sprintf("%.0f", r.P90TTFT))
			tpot = append(tpot, fmt.Sprintf("%.1f", r.P90TPOT))
		}
		if _, err := fmt.Fprintf(w, "| %s | %s | %s | %s | %s |\n", s.Label, good,
			strings.Join(att, ", "), strings.Join(ttft, ", "), strings.Join(tpot, ", ")); err != nil {
			return err
		}
	}
	return nil
}

func runCompare(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("compare", flag.ContinueOnError)
	fs.SetOutput(stderr)
	plotPath := fs.String("plot", "", "write the comparison plot (PNG) here")
	fs.Usage = func() {
		fmt.Fprint(stderr, compareUsage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return errors.New("compare: no sweep report given")
	}
	var sweeps []sweepFile
	for _, name := range fs.Args() {
		b, err := os.ReadFile(name)
		if err != nil {
			return fmt.Errorf("compare: %w", err)
		}
		s, err := parseSweep(b, name)
		if err != nil {
			return err
		}
		sweeps = append(sweeps, s)
	}
	if err := writeCompareMarkdown(stdout, sweeps); err != nil {
		return err
	}
	if *plotPath != "" {
		return writeComparePlot(*plotPath, sweeps)
	}
	return nil
}

// comparePalette colours the setups' lines in turn.
var comparePalette = []color.RGBA{
	{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}, {R: 0xff, G: 0x7f, B: 0x0e, A: 0xff}, {R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	{R: 0x94, G: 0x67, B: 0xbd, A: 0xff}, {R: 0x8c, G: 0x56, B: 0x4b, A: 0xff}, {R: 0x7f, G: 0x7f, B: 0x7f, A: 0xff},
}

// writeComparePlot draws three panels against rate, one line per setup:
// p90 TTFT and p90 TPOT with the first report's objectives, and SLO
// attainment with its target.
func writeComparePlot(path string, sweeps []sweepFile) error {
	first := sweeps[0]
	panels := []struct {
		ylabel string
		y      func(sweepRun) float64
		goal   float64
		label  string
	}{
		{"p90 TTFT (ms)", func(r sweepRun) float64 { return r.P90TTFT }, first.SLO["ttft"], fmt.Sprintf("TTFT SLO %g ms", first.SLO["ttft"])},
		{"p90 TPOT (ms)", func(r sweepRun) float64 { return r.P90TPOT }, first.SLO["tpot"], fmt.Sprintf("TPOT SLO %g ms", first.SLO["tpot"])},
		{"SLO attainment (%)", func(r sweepRun) float64 { return 100 * r.Attainment }, 100 * first.Target, fmt.Sprintf("target %g %%", 100*first.Target)},
	}
	var rates []float64
	for _, s := range sweeps {
		for _, r := range s.Runs {
			if !slices.Contains(rates, r.Rate) {
				rates = append(rates, r.Rate)
			}
		}
	}
	slices.Sort(rates)
	ticks := make(plot.ConstantTicks, len(rates))
	for i, r := range rates {
		ticks[i] = plot.Tick{Value: r, Label: strconv.FormatFloat(r, 'g', -1, 64)}
	}
	plots := make([][]*plot.Plot, len(panels))
	for i, pn := range panels {
		p := plot.New()
		if i == 0 {
			p.Title.Text = "handoff-bench compare: rate sweeps"
		}
		p.Y.Label.Text = pn.ylabel
		p.X.Label.Text = "request rate (req/s)"
		p.X.Tick.Marker = ticks
		p.Y.Min = 0
		top := pn.goal
		p.Add(plotter.NewGrid())
		for j, s := range sweeps {
			xy := make(plotter.XYs, len(s.Runs))
			for k, r := range s.Runs {
				xy[k] = plotter.XY{X: r.Rate, Y: pn.y(r)}
			}
			line, dots, err := plotter.NewLinePoints(xy)
			if err != nil {
				return fmt.Errorf("compare: plot: %w", err)
			}
			c := comparePalette[j%len(comparePalette)]
			line.Color, dots.Color = c, c
			p.Add(line, dots)
			p.Legend.Add(s.Label, line, dots)
		}
		goal, err := plotter.NewLine(plotter.XYs{{X: rates[0], Y: pn.goal}, {X: rates[len(rates)-1], Y: pn.goal}})
		if err != nil {
			return fmt.Errorf("compare: plot: %w", err)
		}
		goal.Color = color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}
		goal.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		p.Add(goal)
		p.Legend.Add(pn.label, goal)
		p.Legend.Left = true
		if i < 2 {
			// Latencies past overload dwarf the objective: the axis stops
			// at 4 times it, so the region that decides stays readable.
			p.Y.Max = 4 * top
			p.Legend.Top = true
		} else {
			p.Y.Max = 105
		}
		plots[i] = []*plot.Plot{p}
	}
	if err := writeColumnPNG(path, plots); err != nil {
		return fmt.Errorf("compare: %w", err)
	}
	return nil
}
