package kvcache

import (
	"testing"
)

// benchPool is a pool shaped like a real rank (Llama-ish 8 kv heads x 128,
// bf16, 32 tokens per block, 4 layers for brevity) with 4096 blocks, a
// quarter of them held by background requests scattered over the pool.
func benchPool(b *testing.B) *Pool {
	b.Helper()
	p, err := New(Config{Layers: 4, KVHeads: 8, HeadDim: 128, ElemSize: 2, TokensPerBlock: 32, Blocks: 4096})
	if err != nil {
		b.Fatal(err)
	}
	// Fragment: 64 requests of 32 blocks, free every other one.
	for i := range uint64(64) {
		if err := p.Allocate(1_000_000+i, 32*32); err != nil {
			b.Fatal(err)
		}
	}
	for i := uint64(0); i < 64; i += 2 {
		if err := p.Free(1_000_000 + i); err != nil {
			b.Fatal(err)
		}
	}
	return p
}

// BenchmarkAllocateFree4k allocates and frees a 4096-token request (128
// blocks) on a partly used pool.
func BenchmarkAllocateFree4k(b *testing.B) {
	p := benchPool(b)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		id := uint64(i)
		if err := p.Allocate(id, 4096); err != nil {
			b.Fatal(err)
		}
		if err := p.Free(id); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkAllocateRunsFree4k adds reading the runs into a reused slice, as
// a transfer building its descriptor does.
func BenchmarkAllocateRunsFree4k(b *testing.B) {
	p := benchPool(b)
	var runs []Run
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		id := uint64(i)
		if err := p.Allocate(id, 4096); err != nil {
			b.Fatal(err)
		}
		var err error
		if runs, err = p.Runs(id, runs[:0]); err != nil || len(runs) != 1 {
			b.Fatal(err, runs)
		}
		if err := p.Free(id); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkGrowTokenByToken decodes a request from 1 to 4096 tokens, one
// Grow per token; ns/op is per token.
func BenchmarkGrowTokenByToken(b *testing.B) {
	p := benchPool(b)
	b.ReportAllocs()
	tok, id := 0, uint64(0)
	for b.Loop() {
		if tok == 0 {
			if err := p.Allocate(id, 1); err != nil {
				b.Fatal(err)
			}
			tok = 1
		}
		tok++
		if err := p.Grow(id, tok); err != nil {
			b.Fatal(err)
		}
		if tok == 4096 {
			if err := p.Free(id); err != nil {
				b.Fatal(err)
			}
			tok, id = 0, id+1
		}
	}
}

// BenchmarkDummyAddFree places and frees a dummy (the ADP pad of one idle
// iteration).
func BenchmarkDummyAddFree(b *testing.B) {
	p := benchPool(b)
	b.ReportAllocs()
	for b.Loop() {
		if err := p.AllocateDummy(0); err != nil {
			b.Fatal(err)
		}
		if err := p.Free(0); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkChurn keeps 48 requests of 1..4096 tokens live, replacing one per
// iteration, so the pool fragments as a busy server's does.
func BenchmarkChurn(b *testing.B) {
	p, err := New(Config{Layers: 4, KVHeads: 8, HeadDim: 128, ElemSize: 2, TokensPerBlock: 32, Blocks: 4096})
	if err != nil {
		b.Fatal(err)
	}
	const live = 48
	x := uint64(1)
	next := func() int { // xorshift: deterministic sizes without math/rand
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		return int(x%4096) + 1
	}
	for i := range uint64(live) {
		if err := p.Allocate(i, next()); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	for i := uint64(live); b.Loop(); i++ {
		if err := p.Free(i - live); err != nil {
			b.Fatal(err)
		}
		if err := p.Allocate(i, next()); err != nil {
			b.Fatal(err)
		}
	}
}
