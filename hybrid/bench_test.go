package hybrid

import (
	"testing"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
)

func benchManager(b *testing.B) *Manager {
	b.Helper()
	m, err := New(Config{
		KV: kvcache.Config{Layers: 4, KVHeads: 8, HeadDim: 128, ElemSize: 2, TokensPerBlock: 32, Blocks: 4096},
		Mamba: mambacache.Config{
			Layers: 27, DState: 128, DConv: 4, Heads: 64, HeadDim: 64, NGroups: 8,
			ConvElemSize: 2, SSMElemSize: 4, MaxBatchSize: 64, AttentionDP: true,
		},
	})
	if err != nil {
		b.Fatal(err)
	}
	for i := range uint64(16) { // background load
		if _, err := m.Prepare(1_000_000+i, 1024); err != nil {
			b.Fatal(err)
		}
	}
	return m
}

// BenchmarkPrepareFree4k prepares a 4096-token request (row + 128 blocks,
// runs appended to a reused slice) and frees it.
func BenchmarkPrepareFree4k(b *testing.B) {
	m := benchManager(b)
	var runs []kvcache.Run
	b.ReportAllocs()
	for i := uint64(1); b.Loop(); i++ {
		res, err := m.PrepareTo(i, 4096, runs[:0])
		if err != nil {
			b.Fatal(err)
		}
		runs = res.Runs
		if err := m.Free(i); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPrepareFree4kNewSlice is Prepare, which returns a fresh Runs
// slice each call.
func BenchmarkPrepareFree4kNewSlice(b *testing.B) {
	m := benchManager(b)
	b.ReportAllocs()
	for i := uint64(1); b.Loop(); i++ {
		if _, err := m.Prepare(i, 4096); err != nil {
			b.Fatal(err)
		}
		if err := m.Free(i); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkADPDummyAddFree is one idle attention-DP iteration: the ADP
// dummy placed (reserved row, one block) and freed.
func BenchmarkADPDummyAddFree(b *testing.B) {
	m := benchManager(b)
	b.ReportAllocs()
	for b.Loop() {
		if err := m.AddDummy(mambacache.ADPDummyID); err != nil {
			b.Fatal(err)
		}
		if err := m.Free(mambacache.ADPDummyID); err != nil {
			b.Fatal(err)
		}
	}
}
