package mambacache

import "testing"

func benchPool(b *testing.B, adp bool) *Pool {
	b.Helper()
	// Nemotron-H-like rank: 64 heads x 64, d_state 128, 8 groups, bf16 conv,
	// fp32 SSM, max batch 256.
	p, err := New(Config{
		Layers: 27, DState: 128, DConv: 4, Heads: 64, HeadDim: 64, NGroups: 8,
		ConvElemSize: 2, SSMElemSize: 4, MaxBatchSize: 256, AttentionDP: adp,
	})
	if err != nil {
		b.Fatal(err)
	}
	for i := range uint64(128) { // half the rows held
		if _, err := p.Allocate(1_000_000 + i); err != nil {
			b.Fatal(err)
		}
	}
	return p
}

// BenchmarkAllocateFree takes and returns one real row.
func BenchmarkAllocateFree(b *testing.B) {
	p := benchPool(b, true)
	b.ReportAllocs()
	for i := uint64(1); b.Loop(); i++ {
		if _, err := p.Allocate(i); err != nil {
			b.Fatal(err)
		}
		if err := p.Free(i); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkADPDummyAddFree places and frees the ADP dummy on its reserved
// row, as an idle attention-DP rank does every iteration.
func BenchmarkADPDummyAddFree(b *testing.B) {
	p := benchPool(b, true)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := p.AddDummy(ADPDummyID); err != nil {
			b.Fatal(err)
		}
		if err := p.Free(ADPDummyID); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkExtents computes the three conv sections and the SSM extent
// of one row and layer, as a transfer building a descriptor does.
func BenchmarkExtents(b *testing.B) {
	c := benchPool(b, true).Config()
	var sink int64
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		r, l := Row(i%256), i%c.Layers
		sink += c.ConvExtent(r, l, SectionX).Offset + c.ConvExtent(r, l, SectionB).Length +
			c.ConvExtent(r, l, SectionC).Length + c.SSMExtent(r, l).Length
	}
	if sink == 0 {
		b.Fatal("no extents")
	}
}
