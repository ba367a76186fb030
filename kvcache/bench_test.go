package kvcache

import (
	"math"
	"testing"
)

// benchBackground is the first id of the background requests benchPool
// holds. A benchmark loop numbers its requests from 0 by iteration, and an
// iteration count is an int, so loop ids stay below 1<<63 and never meet
// a background id, however long the run.
const benchBackground = uint64(1) << 63

// benchPool is a pool shaped like a real rank (Llama-ish 8 kv heads x 128,
// bf16, 32 tokens per block, 4 layers for brevity) with 4096 blocks, a
// quarter of them held by background requests scattered over the pool.
func benchPool(tb testing.TB) *Pool {
	tb.Helper()
	p, err := New(Config{Layers: 4, KVHeads: 8, HeadDim: 128, ElemSize: 2, TokensPerBlock: 32, Blocks: 4096})
	if err != nil {
		tb.Fatal(err)
	}
	// Fragment: 64 requests of 32 blocks, free every other one.
	for i := range uint64(64) {
		if err := p.Allocate(benchBackground+i, 32*32); err != nil {
			tb.Fatal(err)
		}
	}
	for i := uint64(0); i < 64; i += 2 {
		if err := p.Free(benchBackground + i); err != nil {
			tb.Fatal(err)
		}
	}
	return p
}

// allocateFree4k allocates and frees a 4096-token request id on p. With
// runs non-nil it also reads the request's runs into (*runs)[:0] and
// checks they are the single run a 128-block request gets on benchPool.
func allocateFree4k(tb testing.TB, p *Pool, id uint64, runs *[]Run) {
	if err := p.Allocate(id, 4096); err != nil {
		tb.Fatal(err)
	}
	if runs != nil {
		var err error
		if *runs, err = p.Runs(id, (*runs)[:0]); err != nil || len(*runs) != 1 {
			tb.Fatal(err, *runs)
		}
	}
	if err := p.Free(id); err != nil {
		tb.Fatal(err)
	}
}

// BenchmarkAllocateFree4k allocates and frees a 4096-token request (128
// blocks) on a partly used pool.
func BenchmarkAllocateFree4k(b *testing.B) {
	p := benchPool(b)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		allocateFree4k(b, p, uint64(i), nil)
	}
}

// BenchmarkAllocateRunsFree4k adds reading the runs into a reused slice, as
// a transfer building its descriptor does.
func BenchmarkAllocateRunsFree4k(b *testing.B) {
	p := benchPool(b)
	var runs []Run
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		allocateFree4k(b, p, uint64(i), &runs)
	}
}

// TestBenchLoopIDsMissBackground runs the 4k loop body at the ids a long
// benchmark run reaches: the first ones, those around a million
// iterations, and the last an int iteration count allows.
func TestBenchLoopIDsMissBackground(t *testing.T) {
	p := benchPool(t)
	var runs []Run
	for _, base := range []uint64{0, 1_000_000 - 64, math.MaxInt - 127} {
		for id := base; id < base+128; id++ {
			allocateFree4k(t, p, id, &runs)
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

// Churn shape: churnLive requests of 1..churnMaxTokens tokens live at
// once. The pool has room for all of them at their largest, so a run of
// unlucky sizes can never leave too few blocks free; the sizes average half
// the largest, so the pool runs about half full.
const (
	churnLive      = 48
	churnMaxTokens = 4096
	churnTPB       = 32
	churnBlocks    = churnLive * (churnMaxTokens + churnTPB - 1) / churnTPB
)

// churn replaces the oldest of churnLive live requests with a new one of a
// pseudo-random size on each step.
type churn struct {
	p    *Pool
	x    uint64 // xorshift state: deterministic sizes without math/rand
	next uint64 // id of the next request
}

func newChurn(tb testing.TB) *churn {
	tb.Helper()
	p, err := New(Config{Layers: 4, KVHeads: 8, HeadDim: 128, ElemSize: 2, TokensPerBlock: churnTPB, Blocks: churnBlocks})
	if err != nil {
		tb.Fatal(err)
	}
	c := &churn{p: p, x: 1}
	for range churnLive {
		c.allocate(tb)
	}
	return c
}

func (c *churn) size() int {
	c.x ^= c.x << 13
	c.x ^= c.x >> 7
	c.x ^= c.x << 17
	return int(c.x%churnMaxTokens) + 1
}

func (c *churn) allocate(tb testing.TB) {
	if err := c.p.Allocate(c.next, c.size()); err != nil {
		tb.Fatal(err)
	}
	c.next++
}

func (c *churn) step(tb testing.TB) {
	if err := c.p.Free(c.next - churnLive); err != nil {
		tb.Fatal(err)
	}
	c.allocate(tb)
}

// BenchmarkChurn keeps 48 requests of 1..4096 tokens live, replacing one per
// iteration, so the pool fragments as a busy server's does.
func BenchmarkChurn(b *testing.B) {
	c := newChurn(b)
	b.ReportAllocs()
	for b.Loop() {
		c.step(b)
	}
}

// TestChurnNeverRunsOut runs the churn steps well past where a pool too
// small for every live request at its largest runs out.
func TestChurnNeverRunsOut(t *testing.T) {
	c := newChurn(t)
	for range 300_000 {
		c.step(t)
	}
}
