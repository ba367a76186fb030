package reshard_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/reshard"
	"github.com/stretchr/testify/require"
)

// benchBlocks is the KV of a 1024-token prompt at nemotron-h-8b's 32
// tokens per block: one run of 32 blocks (16 MiB at TP 1).
const benchBlocks = 32

// request is one request's cache on every shard of a TP group: its Mamba
// row and a run of benchBlocks KV blocks per shard.
type request struct{ row, kv [][]byte }

func newRequest(tp int, rowBytes, blockBytes int64) request {
	r := request{row: make([][]byte, tp), kv: make([][]byte, tp)}
	for i := range tp {
		r.row[i] = make([]byte, rowBytes)
		r.kv[i] = make([]byte, benchBlocks*blockBytes)
		for j := range r.row[i] {
			r.row[i][j] = byte(j * 7)
		}
		for j := range r.kv[i] {
			r.kv[i][j] = byte(j * 13)
		}
	}
	return r
}

// BenchmarkReshard applies the plans of one nemotron-h-8b request (its
// 49 MiB Mamba row and a 1024-token KV run) from a TP-P group's shards to a
// TP-D group's, in host memory, and, in the same run, a plain copy of the
// same number of bytes between two flat buffers (memcpy), both in every
// iteration, in alternating order, so that both see the same load. It
// reports both rates in bytes written per second, their ratio (x-memcpy)
// and the plans' copies. 16↔2 and 2↔16 replicate the 8 groups and the 8
// KV heads on the TP-16 side.
//
//	go test -run '^$' -bench Reshard -benchtime 2s ./reshard/
func BenchmarkReshard(b *testing.B) {
	e, err := model.Lookup(model.NemotronH8B)
	require.NoError(b, err)
	spec := e.Spec()
	kvLayout, mambaLayout := reshard.KV(spec.KV), reshard.Mamba(spec.Mamba)
	for _, c := range [][2]int{{1, 1}, {2, 1}, {1, 2}, {4, 2}, {2, 4}, {16, 2}, {2, 16}} {
		from, to := c[0], c[1]
		kvPlan, err := reshard.New(kvLayout, from, to)
		require.NoError(b, err)
		mambaPlan, err := reshard.New(mambaLayout, from, to)
		require.NoError(b, err)
		src := newRequest(from, mambaPlan.SrcBytes, kvPlan.SrcBytes)
		dst := newRequest(to, mambaPlan.DstBytes, kvPlan.DstBytes)
		// The KV copies of a run: each pair's copies repeated over the run.
		kvRun := make([][]reshard.Copy, from*to)
		for rs := range from {
			for rd := range to {
				for _, cp := range kvPlan.Copies(rs, rd) {
					kvRun[rs*to+rd] = append(kvRun[rs*to+rd], cp.Repeat(benchBlocks))
				}
			}
		}
		apply := func() {
			for rs := range from {
				for rd := range to {
					reshard.Apply(dst.row[rd], src.row[rs], mambaPlan.Copies(rs, rd))
					reshard.Apply(dst.kv[rd], src.kv[rs], kvRun[rs*to+rd])
				}
			}
		}
		bytes := int64(to) * (mambaPlan.DstBytes + benchBlocks*kvPlan.DstBytes) // each written once
		flatSrc, flatDst := make([]byte, bytes), make([]byte, bytes)
		for j := range flatSrc { // written, so not the kernel's shared zero page
			flatSrc[j] = byte(j * 7)
		}
		memcpy := func() { copy(flatDst, flatSrc) }
		b.Run(fmt.Sprintf("%d→%d", from, to), func(b *testing.B) {
			apply() // fault the pages in
			memcpy()
			var tr, tm time.Duration
			timed := func(f func()) time.Duration { t0 := time.Now(); f(); return time.Since(t0) }
			for i := 0; b.Loop(); i++ {
				if i%2 == 0 { // alternate which goes first: no order bias
					tr += timed(apply)
					tm += timed(memcpy)
				} else {
					tm += timed(memcpy)
					tr += timed(apply)
				}
			}
			mbps := func(d time.Duration) float64 { return float64(bytes) * float64(b.N) / d.Seconds() / 1e6 }
			b.ReportMetric(mbps(tr), "reshard-MB/s")
			b.ReportMetric(mbps(tm), "memcpy-MB/s")
			b.ReportMetric(tm.Seconds()/tr.Seconds(), "x-memcpy")
			b.ReportMetric(float64(mambaPlan.Len()+kvPlan.Len()), "copies")
			b.ReportMetric(0, "ns/op")
		})
	}
}
