package transfer

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/rdma"
)

// tpPair is a writer and a receiver rank holding one request, ready to
// move it: the receiver's extents (every shard's) and the writer's
// resharded source.
type tpPair struct {
	src, dst *tpSide
	dest     CacheExtents
	source   CacheExtents
	bytes    int64
}

func newTPPair(b *testing.B, spec model.Spec, from, to int, tr rdma.Transport, tokens int) *tpPair {
	blocks := spec.KV.BlocksFor(tokens) + 1
	p := &tpPair{
		src: newTPSide(b, fmt.Sprintf("src%d-%d", from, to), spec.KV, spec.Mamba, from, tr, blocks),
		dst: newTPSide(b, fmt.Sprintf("dst%d-%d", from, to), spec.KV, spec.Mamba, to, tr, blocks),
	}
	res, err := p.src.m.Prepare(7, tokens)
	require.NoError(b, err)
	dres, err := p.dst.m.Prepare(9, tokens)
	require.NoError(b, err)
	for _, s := range p.src.shards { // written, so not the kernel's shared zero page
		for _, r := range []*rdma.Region{s.KV, s.Mamba} {
			m := r.Bytes()
			for i := range m {
				m[i] = byte(i * 7)
			}
		}
	}
	p.dest, err = p.dst.rank.Resolve(dres)
	require.NoError(b, err)
	p.source, err = p.src.rank.Source(res, to)
	require.NoError(b, err)
	kb, mb := p.dest.bytes()
	p.bytes = int64(kb + mb)
	_, err = p.src.eng.Connect(context.Background(), p.dst.eng.Descriptor())
	require.NoError(b, err)
	return p
}

// move grants, writes and waits for the commit of one request.
func (p *tpPair) move(b *testing.B) time.Duration {
	t0 := time.Now()
	g, err := p.dst.eng.OpenGrant(rdma.GrantSpec{RequestID: 9, Extents: p.dest.extents()})
	require.NoError(b, err)
	_, err = p.src.eng.Write(context.Background(), p.dst.eng.Descriptor(), g.Ticket(), p.source.extents())
	require.NoError(b, err)
	_, err = g.Wait(context.Background())
	require.NoError(b, err)
	return time.Since(t0)
}

// BenchmarkTPHandoff moves one nemotron-h-8b request (its 49 MiB Mamba
// row and a 1024-token KV run) from a TP-P rank to a TP-D rank through
// the data plane (grant, one resharded write, commit with the manifest
// checked), over tcp and shm, and in the same iterations, in alternating
// order, the same request 1→1. It reports both rates in bytes landed per
// second and their ratio (x-1to1; the goal is ≥ 0.8). 16→2 and
// 2→16 replicate nemotron's 8 groups and 8 KV heads on the TP-16 side
// (2→16 lands each replicated byte in every replica, so more bytes).
//
//	go test -run '^$' -bench TPHandoff -benchtime 20x ./transfer/
func BenchmarkTPHandoff(b *testing.B) {
	e, err := model.Lookup(model.NemotronH8B)
	require.NoError(b, err)
	spec := e.Spec()
	const tokens = 1024
	for _, tr := range []rdma.Transport{rdma.TransportTCP, rdma.TransportSHM} {
		for _, c := range [][2]int{{1, 1}, {2, 1}, {1, 2}, {4, 2}, {2, 4}, {16, 2}, {2, 16}} {
			b.Run(fmt.Sprintf("%s/%d→%d", tr, c[0], c[1]), func(b *testing.B) {
				// Both pairs are as old (fresh engines, pages faulted in by
				// the warm-up), and released when the case ends.
				base := newTPPair(b, spec, 1, 1, tr, tokens)
				p := newTPPair(b, spec, c[0], c[1], tr, tokens)
				p.move(b) // warm: connections, page faults
				base.move(b)
				var tp, tb time.Duration
				for i := 0; b.Loop(); i++ {
					if i%2 == 0 {
						tp += p.move(b)
						tb += base.move(b)
					} else {
						tb += base.move(b)
						tp += p.move(b)
					}
				}
				rate := func(n int64, d time.Duration) float64 { return float64(n) * float64(b.N) / d.Seconds() / 1e6 }
				b.ReportMetric(rate(p.bytes, tp), "resharded-MB/s")
				b.ReportMetric(rate(base.bytes, tb), "1to1-MB/s")
				b.ReportMetric(rate(p.bytes, tp)/rate(base.bytes, tb), "x-1to1")
				b.ReportMetric(float64(len(p.source.extents())), "src-extents")
				b.ReportMetric(float64(len(p.dest.extents())), "ticket-extents")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}
