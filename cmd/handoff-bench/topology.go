package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/handoff-io/handoff/internal/topology"
)

// runTopology prints the GPUs and NICs this host offers the data path.
func runTopology(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("topology", flag.ContinueOnError)
	output := fs.String("output", "table", "table or json")
	sysfs := fs.String("sysfs", "/sys", "sysfs root to read NICs and PCI paths from")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("topology: unexpected argument %q", fs.Arg(0))
	}
	if *output != "table" && *output != "json" {
		return fmt.Errorf("topology: --output %q: want table or json", *output)
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	topo, err := topology.Discover(ctx, topology.WithSysfsRoot(*sysfs), topology.WithLogger(logger))
	if err != nil {
		return err
	}
	return writeTopology(os.Stdout, topo, *output)
}

func writeTopology(w io.Writer, topo topology.Host, format string) error {
	if format == "json" {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(topo)
	}
	fmt.Fprintln(w, topo.Summary())
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	if len(topo.GPUs) > 0 {
		fmt.Fprintln(tw, "\ngpu\tname\tpci\tnuma\tmemory\tnvlinks\tbest nic\tpeers (level/p2p)")
		for _, g := range topo.GPUs {
			best := "-"
			if a, ok := topo.BestNIC(g.Index, false); ok {
				best = a.NIC.Name + "/" + a.Level.String()
			}
			var peers []string
			for _, p := range g.Peers {
				p2p := "p2p"
				if p.P2PRead != topology.P2POK || p.P2PWrite != topology.P2POK {
					p2p = "no-p2p"
				}
				if p.P2PNVLink == topology.P2POK {
					p2p += "+nvlink"
				}
				peers = append(peers, fmt.Sprintf("%d:%s/%s", p.Index, p.Level, p2p))
			}
			fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%s\t%d\t%s\t%s\n", g.Index, g.Name, g.PCIBusID, g.NUMANode,
				formatSize(g.MemoryBytes), g.NVLinks, best, strings.Join(peers, " "))
		}
	}
	if len(topo.NICs) > 0 {
		fmt.Fprintln(tw, "\nnic\tpci\tnuma\tspeed Mb/s\trdma")
		for _, n := range topo.NICs {
			rd := "-"
			if n.RDMA {
				rd = strings.Join(n.RDMADevices, ",")
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\n", n.Name, n.PCIBusID, n.NUMANode, n.SpeedMbps, rd)
		}
	}
	return tw.Flush()
}
