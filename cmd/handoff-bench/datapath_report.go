package main

// How the datapath command renders its report.

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
)

// write renders the report.
func (r report) write(w io.Writer, format string) error {
	if format == "json" {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		if len(r.Runs) == 1 {
			return enc.Encode(struct {
				datapathResult
				Baselines []baseline `json:"baselines,omitempty"`
				Ratios    []ratio    `json:"ratios,omitempty"`
			}{r.Runs[0], r.Baselines, r.Ratios})
		}
		return enc.Encode(r)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "transport\textent\tstreams\tlanes\tcrc\tprocs\tgrants\tbytes\tseconds\tGB/s\tgrant p50 ms\tgrant p99 ms\trepeats GB/s")
	for _, x := range r.Runs {
		reps := "-"
		if len(x.Repeats) > 0 {
			var b strings.Builder
			for i, v := range x.Repeats {
				if i > 0 {
					b.WriteByte(' ')
				}
				fmt.Fprintf(&b, "%.2f", v)
			}
			reps = b.String()
		}
		lanes, crc := "-", "no"
		if x.TCPLanes > 0 {
			lanes = strconv.Itoa(x.TCPLanes)
		}
		if x.CRC {
			crc = "yes"
		}
		transport := string(x.Transport)
		if x.TLS {
			transport += "+tls"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%d\t%d\t%s\t%.2f\t%.2f\t%.3f\t%.3f\t%s\n", transport, formatSize(x.ExtentBytes), x.Streams,
			lanes, crc, x.Processes, x.Grants, formatSize(x.Bytes), x.Seconds, x.GBPerS, x.GrantP50Ms, x.GrantP99Ms, reps)
	}
	for _, x := range r.Runs {
		if x.CRCKernel != "" {
			fmt.Fprintf(tw, "(crc32c: %s)\n", x.CRCKernel)
			break
		}
	}
	if len(r.Baselines) > 0 {
		fmt.Fprintln(tw, "\nbaseline\tsize\tGB/s\tstatus")
		for _, b := range r.Baselines {
			size, rate := "-", "-"
			if b.ExtentBytes > 0 {
				size = formatSize(b.ExtentBytes)
			}
			if b.Status == statusOK {
				rate = fmt.Sprintf("%.2f", b.GBPerS)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", b.Name, size, rate, b.Status)
		}
	}
	if len(r.Ratios) > 0 {
		fmt.Fprintln(tw, "\nratio\tsize\tvalue\ttarget")
		for _, x := range r.Ratios {
			target := "-"
			if x.Target > 0 {
				verdict := "met"
				if x.Value < x.Target {
					verdict = "MISSED"
				}
				target = fmt.Sprintf(">= %.2f %s", x.Target, verdict)
			}
			fmt.Fprintf(tw, "%s\t%s\t%.2f\t%s\n", x.Name, formatSize(x.ExtentBytes), x.Value, target)
		}
	}
	return tw.Flush()
}

// formatSize writes sizes the way parseSize reads them, exact where it can.
func formatSize(n uint64) string {
	for _, u := range []struct {
		shift uint
		name  string
	}{{40, "TiB"}, {30, "GiB"}, {20, "MiB"}, {10, "KiB"}} {
		if n >= 1<<u.shift {
			if n%(1<<u.shift) == 0 {
				return fmt.Sprintf("%d%s", n>>u.shift, u.name)
			}
			if u.shift >= 20 {
				return fmt.Sprintf("%.1f%s", float64(n)/float64(uint64(1)<<u.shift), u.name)
			}
		}
	}
	return fmt.Sprintf("%dB", n)
}
