package agent

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/handoff-io/handoff/rdma"
)

// BenchmarkSmallSend times one block and one row from the send request to
// its send_done event, through two agents, as the sending engine sees it
// (the grant, opened before, is not counted): us/send.
func BenchmarkSmallSend(b *testing.B) {
	for _, tr := range []rdma.Transport{rdma.TransportSHM, rdma.TransportTCP} {
		b.Run(string(tr), func(b *testing.B) {
			a := register(b, startAgent(b, "a", tr), tinyLayout())
			r := register(b, startAgent(b, "b", tr), tinyLayout())
			ctx := context.Background()
			var sending time.Duration
			for i := 0; b.Loop(); i++ {
				g, err := r.c.Call(ctx, Request{Op: OpGrant, RequestID: uint64(i + 1), Blocks: []int{3}, Row: Row(1)}, nil)
				if err != nil {
					b.Fatal(err)
				}
				start := time.Now()
				if _, err := a.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: []int{0}, Row: Row(0)}, nil); err != nil {
					b.Fatal(err)
				}
				if ev, _ := a.c.WaitEvent(ctx, func(Reply) bool { return true }); ev.Ev != EvSendDone {
					b.Fatal(ev)
				}
				sending += time.Since(start)
				if ev, _ := r.c.WaitEvent(ctx, func(Reply) bool { return true }); ev.Ev != EvGrantDone {
					b.Fatal(ev)
				}
			}
			b.ReportMetric(float64(sending.Microseconds())/float64(b.N), "us/send")
		})
	}
}

// BenchmarkSend64MiB sends 512 blocks of 128 KiB and a row through two
// agents (the Go client, in this process), the receiver's blocks in
// reverse order, timed from the send request to send_done; "-per-layer":
// the receiver keeps each layer's K and V apart (vLLM's tensors, planes),
// so its ticket lists an extent per block and plane;
// BenchmarkSend64MiBEngines is the same write between two rdma engines,
// the workers' data path without the agents.
func BenchmarkSend64MiB(b *testing.B) {
	l := tinyLayout()
	l.KV = &KVLayout{Layers: 2, KVHeads: 8, HeadDim: 128, TokensPerBlock: 16, DType: "bfloat16", Blocks: 512}
	for _, name := range []string{"shm", "tcp", "shm-per-layer", "tcp-per-layer"} {
		b.Run(name, func(b *testing.B) {
			tr, planes := rdma.Transport(strings.TrimSuffix(name, "-per-layer")), strings.HasSuffix(name, "-per-layer")
			a := register(b, startAgent(b, "a", tr), l)
			var r *engine
			if planes {
				lp, size := perLayer(b, l)
				r = registerPlanes(b, startAgent(b, "b", tr), lp, size)
			} else {
				r = register(b, startAgent(b, "b", tr), l)
			}
			ctx := context.Background()
			src, dst := make([]int, 512), make([]int, 512)
			for i := range src {
				src[i], dst[i] = i, 511-i
			}
			var sending time.Duration
			b.SetBytes(512 * 128 << 10)
			flt0 := minflt()
			for i := 0; b.Loop(); i++ {
				g, err := r.c.Call(ctx, Request{Op: OpGrant, RequestID: uint64(i + 1), Blocks: dst, Row: Row(1)}, nil)
				if err != nil {
					b.Fatal(err)
				}
				start := time.Now()
				if _, err := a.c.Call(ctx, Request{Op: OpSend, Ticket: g.Ticket, Blocks: src, Row: Row(0)}, nil); err != nil {
					b.Fatal(err)
				}
				if ev, _ := a.c.WaitEvent(ctx, func(Reply) bool { return true }); ev.Ev != EvSendDone {
					b.Fatal(ev)
				}
				sending += time.Since(start)
				if ev, _ := r.c.WaitEvent(ctx, func(Reply) bool { return true }); ev.Ev != EvGrantDone {
					b.Fatal(ev)
				}
			}
			b.ReportMetric(float64(sending.Microseconds())/float64(b.N), "us/send")
			b.ReportMetric(float64(minflt()-flt0)/float64(b.N), "faults/op")
		})
	}
}

// minflt is this process's minor page faults so far.
func minflt() int64 {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Minflt
}

func BenchmarkSend64MiBEngines(b *testing.B) {
	l := tinyLayout()
	l.KV = &KVLayout{Layers: 2, KVHeads: 8, HeadDim: 128, TokensPerBlock: 16, DType: "bfloat16", Blocks: 512}
	p, err := compile(l, false)
	if err != nil {
		b.Fatal(err)
	}
	for _, tr := range []rdma.Transport{rdma.TransportSHM, rdma.TransportTCP} {
		b.Run(string(tr), func(b *testing.B) {
			mk := func(name string) (*rdma.Engine, *rdma.Region, *rdma.Region) {
				e, err := rdma.New(rdma.Config{Agent: rdma.AgentID(name), Transports: []rdma.Transport{tr}, Logger: quiet()})
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { e.Close() })
				kv, err := e.Register("kv", p.kvBytes())
				if err != nil {
					b.Fatal(err)
				}
				m, err := e.Register("mamba", p.mambaBytes())
				if err != nil {
					b.Fatal(err)
				}
				fill(kv.Bytes(), 1)
				fill(m.Bytes(), 2)
				return e, kv, m
			}
			tx, skv, sm := mk("bench-tx")
			rx, dkv, dm := mk("bench-rx")
			bb := uint64(p.kv.BlockBytes())
			var dst []rdma.Extent
			for i := 511; i >= 0; i-- {
				dst = append(dst, rdma.Extent{Region: dkv.ID(), Offset: uint64(i) * bb, Length: bb})
			}
			dst = append(dst, rdma.Extent{Region: dm.ID(), Offset: p.rowOff(1), Length: uint64(p.mamba.RowBytes())})
			src := []rdma.Extent{{Region: skv.ID(), Length: 512 * bb}, {Region: sm.ID(), Offset: p.rowOff(0), Length: uint64(p.mamba.RowBytes())}}
			ctx := context.Background()
			if _, err := tx.Connect(ctx, rx.Descriptor()); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(512 * 128 << 10)
			flt0 := minflt()
			for i := 0; b.Loop(); i++ {
				g, err := rx.OpenGrant(rdma.GrantSpec{RequestID: uint64(i + 1), Extents: dst})
				if err != nil {
					b.Fatal(err)
				}
				if _, err := tx.Write(ctx, rx.Descriptor(), g.Ticket(), src); err != nil {
					b.Fatal(err)
				}
				if _, err := g.Wait(ctx); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(minflt()-flt0)/float64(b.N), "faults/op")
		})
	}
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }
