package kvcache

import (
	"fmt"
	"math"
)

// MaxBlocks bounds the number of blocks of one pool. The allocator keeps
// 16 bytes of index per block, so the bound caps its own memory at 256 MiB;
// real pools hold tens to hundreds of thousands of blocks.
const MaxBlocks = 1 << 24

// maxDim bounds each dimension of a Config so that products cannot overflow
// before Validate gets to check them.
const maxDim = 1 << 20

// BlockID names one block of the pool: 0 .. Blocks-1.
type BlockID uint32

// Run is Len contiguous blocks starting at Start.
type Run struct {
	Start BlockID
	Len   uint32
}

// End returns the first block after the run.
func (r Run) End() BlockID { return r.Start + BlockID(r.Len) }

// KV selects the key or value half of a (block, layer).
type KV uint8

// The two halves of a (block, layer), in arena order.
const (
	K KV = 0
	V KV = 1
)

// String returns "K" or "V".
func (kv KV) String() string {
	switch kv {
	case K:
		return "K"
	case V:
		return "V"
	}
	return fmt.Sprintf("KV(%d)", uint8(kv))
}

// Extent is a byte range of the pool's arena.
type Extent struct {
	Offset int64
	Length int64
}

// End returns Offset+Length.
func (e Extent) End() int64 { return e.Offset + e.Length }

// Config describes the pool. Exactly one of Blocks or ByteBudget is set.
//
// The dimensions are those of one rank: KVHeads is the number of kv heads
// this rank holds (after any tensor-parallel split), Layers the number of
// attention layers it holds (after any pipeline split).
type Config struct {
	Layers         int   // attention layers
	KVHeads        int   // kv heads per layer
	HeadDim        int   // elements per head
	ElemSize       int   // bytes per element (2 for bf16, 4 for fp32)
	TokensPerBlock int   // power of two > 1
	Blocks         int   // number of blocks
	ByteBudget     int64 // alternative to Blocks: Blocks = ByteBudget / BlockBytes
}

// Validate reports whether c describes a usable pool. The error wraps
// ErrInvalidConfig and names the first offending field.
func (c Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	dims := []struct {
		name string
		v    int
	}{
		{"Layers", c.Layers}, {"KVHeads", c.KVHeads}, {"HeadDim", c.HeadDim},
		{"ElemSize", c.ElemSize}, {"TokensPerBlock", c.TokensPerBlock},
	}
	for _, d := range dims {
		if d.v < 1 || d.v > maxDim {
			return bad("%s = %d, want 1..%d", d.name, d.v, maxDim)
		}
	}
	switch c.ElemSize {
	case 1, 2, 4, 8:
	default:
		return bad("ElemSize = %d, want 1, 2, 4 or 8", c.ElemSize)
	}
	if c.TokensPerBlock < 2 || c.TokensPerBlock&(c.TokensPerBlock-1) != 0 {
		return bad("TokensPerBlock = %d, want a power of two > 1", c.TokensPerBlock)
	}
	bb, ok := c.blockBytes()
	if !ok {
		return bad("block size overflows int64 (Layers %d, KVHeads %d, HeadDim %d, ElemSize %d, TokensPerBlock %d)",
			c.Layers, c.KVHeads, c.HeadDim, c.ElemSize, c.TokensPerBlock)
	}
	switch {
	case c.Blocks < 0:
		return bad("Blocks = %d, want > 0", c.Blocks)
	case c.ByteBudget < 0:
		return bad("ByteBudget = %d, want > 0", c.ByteBudget)
	case c.Blocks > 0 && c.ByteBudget > 0:
		return bad("both Blocks (%d) and ByteBudget (%d) set, want exactly one", c.Blocks, c.ByteBudget)
	case c.Blocks == 0 && c.ByteBudget == 0:
		return bad("neither Blocks nor ByteBudget set, want exactly one")
	}
	n := c.NumBlocks()
	if n < 1 {
		return bad("ByteBudget %d holds no block of %d bytes", c.ByteBudget, bb)
	}
	if n > MaxBlocks {
		return bad("%d blocks, want at most %d", n, MaxBlocks)
	}
	if int64(n) > math.MaxInt64/bb {
		return bad("arena of %d blocks of %d bytes overflows int64", n, bb)
	}
	return nil
}

func (c Config) blockBytes() (int64, bool) {
	v := int64(1)
	for _, f := range []int{2, c.Layers, c.KVHeads, c.HeadDim, c.ElemSize, c.TokensPerBlock} {
		if f <= 0 || v > math.MaxInt64/int64(f) {
			return 0, false
		}
		v *= int64(f)
	}
	return v, true
}

// halfBytes is the size of one (block, layer, K|V) extent.
func (c Config) halfBytes() int64 {
	return int64(c.KVHeads) * c.headBytes()
}

// headBytes is the size of one head's TokensPerBlock tokens in one
// (block, layer, K|V).
func (c Config) headBytes() int64 {
	return int64(c.TokensPerBlock) * int64(c.HeadDim) * int64(c.ElemSize)
}

// BlockBytes is the size of one block: every layer's K and V for
// TokensPerBlock tokens. Meaningful only for a valid config.
func (c Config) BlockBytes() int64 {
	return 2 * int64(c.Layers) * c.halfBytes()
}

// NumBlocks is the number of blocks of the pool: Blocks, or ByteBudget /
// BlockBytes when Blocks is zero. Meaningful only for a valid config.
func (c Config) NumBlocks() int {
	if c.Blocks > 0 {
		return c.Blocks
	}
	bb := c.BlockBytes()
	if bb <= 0 || c.ByteBudget <= 0 {
		return 0
	}
	n := c.ByteBudget / bb
	if n > MaxBlocks {
		return MaxBlocks + 1 // rejected by Validate
	}
	return int(n)
}

// ArenaBytes is the size of the arena the caller must hold:
// NumBlocks * BlockBytes.
func (c Config) ArenaBytes() int64 {
	return int64(c.NumBlocks()) * c.BlockBytes()
}

// BlocksFor returns the number of blocks that hold tokens tokens:
// ceil(tokens / TokensPerBlock), and 0 for tokens <= 0.
func (c Config) BlocksFor(tokens int) int {
	if tokens <= 0 {
		return 0
	}
	return (tokens-1)/c.TokensPerBlock + 1
}

// BlockExtent returns the bytes of block b.
func (c Config) BlockExtent(b BlockID) Extent {
	c.checkBlock(b)
	bb := c.BlockBytes()
	return Extent{Offset: int64(b) * bb, Length: bb}
}

// RunExtent returns the bytes of run r: one contiguous extent of
// r.Len*BlockBytes bytes. It panics if r does not lie inside the pool.
func (c Config) RunExtent(r Run) Extent {
	if r.Len == 0 || uint64(r.Start)+uint64(r.Len) > uint64(c.NumBlocks()) {
		panic(fmt.Sprintf("kvcache: run {%d %d} outside a pool of %d blocks", r.Start, r.Len, c.NumBlocks()))
	}
	bb := c.BlockBytes()
	return Extent{Offset: int64(r.Start) * bb, Length: int64(r.Len) * bb}
}

// KVExtent returns the bytes of the K or V half of one layer of block b:
// [KVHeads][TokensPerBlock][HeadDim] elements. It panics on an out-of-range
// block, layer or kv.
func (c Config) KVExtent(b BlockID, layer int, kv KV) Extent {
	c.checkBlock(b)
	if layer < 0 || layer >= c.Layers {
		panic(fmt.Sprintf("kvcache: layer %d outside 0..%d", layer, c.Layers-1))
	}
	if kv > V {
		panic(fmt.Sprintf("kvcache: %v is neither K nor V", kv))
	}
	h := c.halfBytes()
	return Extent{
		Offset: int64(b)*c.BlockBytes() + (int64(layer)*2+int64(kv))*h,
		Length: h,
	}
}

// TokenOffset returns the arena offset of head head of the token in slot
// slot (0 .. TokensPerBlock-1) of block b, layer layer, half kv. The head's
// HeadDim*ElemSize bytes start there, and the next slot's of the same head
// follow them. It panics on out-of-range arguments.
func (c Config) TokenOffset(b BlockID, layer int, kv KV, slot, head int) int64 {
	e := c.KVExtent(b, layer, kv)
	if slot < 0 || slot >= c.TokensPerBlock {
		panic(fmt.Sprintf("kvcache: token slot %d outside 0..%d", slot, c.TokensPerBlock-1))
	}
	if head < 0 || head >= c.KVHeads {
		panic(fmt.Sprintf("kvcache: head %d outside 0..%d", head, c.KVHeads-1))
	}
	return e.Offset + int64(head)*c.headBytes() + int64(slot)*int64(c.HeadDim)*int64(c.ElemSize)
}

func (c Config) checkBlock(b BlockID) {
	if int64(b) >= int64(c.NumBlocks()) {
		panic(fmt.Sprintf("kvcache: block %d outside a pool of %d blocks", b, c.NumBlocks()))
	}
}
