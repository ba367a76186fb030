package kvcache

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

func testConfig(blocks int) Config {
	return Config{Layers: 2, KVHeads: 2, HeadDim: 4, ElemSize: 2, TokensPerBlock: 4, Blocks: blocks}
}

func newPool(t testing.TB, blocks int) *Pool {
	t.Helper()
	p, err := New(testConfig(blocks))
	require.NoError(t, err)
	return p
}

func runsOf(t testing.TB, p *Pool, id uint64) []Run {
	t.Helper()
	rs, err := p.Runs(id, nil)
	require.NoError(t, err)
	return rs
}

func TestConfigValidate(t *testing.T) {
	ok := testConfig(8)
	tests := []struct {
		name string
		mod  func(*Config)
		want string // substring of the error, "" for valid
	}{
		{"valid", func(*Config) {}, ""},
		{"byte budget", func(c *Config) { c.Blocks = 0; c.ByteBudget = 10 * c.BlockBytes() }, ""},
		{"zero layers", func(c *Config) { c.Layers = 0 }, "Layers = 0"},
		{"negative heads", func(c *Config) { c.KVHeads = -1 }, "KVHeads = -1"},
		{"zero head dim", func(c *Config) { c.HeadDim = 0 }, "HeadDim = 0"},
		{"odd elem size", func(c *Config) { c.ElemSize = 3 }, "ElemSize = 3"},
		{"tpb one", func(c *Config) { c.TokensPerBlock = 1 }, "power of two"},
		{"tpb not pow2", func(c *Config) { c.TokensPerBlock = 24 }, "power of two"},
		{"both", func(c *Config) { c.ByteBudget = 1 << 20 }, "both"},
		{"neither", func(c *Config) { c.Blocks = 0 }, "neither"},
		{"negative blocks", func(c *Config) { c.Blocks = -3 }, "Blocks = -3"},
		{"negative budget", func(c *Config) { c.Blocks = 0; c.ByteBudget = -1 }, "ByteBudget = -1"},
		{"budget too small", func(c *Config) { c.Blocks = 0; c.ByteBudget = c.BlockBytes() - 1 }, "holds no block"},
		{"too many blocks", func(c *Config) { c.Blocks = MaxBlocks + 1 }, "at most"},
		{"huge dims", func(c *Config) { c.Layers, c.KVHeads, c.HeadDim = maxDim, maxDim, maxDim }, "overflows"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := ok
			tt.mod(&c)
			err := c.Validate()
			if tt.want == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.ErrorContains(t, err, tt.want)
			_, err = New(c)
			require.ErrorIs(t, err, ErrInvalidConfig)
		})
	}
}

func TestConfigLayout(t *testing.T) {
	c := testConfig(8) // half = 4 tokens * 2 heads * 4 dim * 2 B = 64 B; block = 2 layers * 2 * 64 = 256 B
	require.EqualValues(t, 256, c.BlockBytes())
	require.EqualValues(t, 8*256, c.ArenaBytes())
	require.Equal(t, 8, c.NumBlocks())
	c2 := c
	c2.Blocks, c2.ByteBudget = 0, 1000
	require.Equal(t, 3, c2.NumBlocks())
	require.EqualValues(t, 768, c2.ArenaBytes())

	for _, tt := range []struct{ tokens, blocks int }{{-1, 0}, {0, 0}, {1, 1}, {4, 1}, {5, 2}, {8, 2}, {4096, 1024}} {
		require.Equal(t, tt.blocks, c.BlocksFor(tt.tokens), "tokens %d", tt.tokens)
	}
	require.Equal(t, Extent{Offset: 512, Length: 768}, c.RunExtent(Run{Start: 2, Len: 3}))
	require.Equal(t, Extent{Offset: 256 * 3, Length: 256}, c.BlockExtent(3))
	require.Equal(t, Extent{Offset: 256 + 0, Length: 64}, c.KVExtent(1, 0, K))
	require.Equal(t, Extent{Offset: 256 + 64, Length: 64}, c.KVExtent(1, 0, V))
	require.Equal(t, Extent{Offset: 256 + 128, Length: 64}, c.KVExtent(1, 1, K))
	require.Equal(t, Extent{Offset: 256 + 192, Length: 64}, c.KVExtent(1, 1, V))
	// slot 2, head 1 of block 1 layer 1 V, heads outermost ([H][T][D]):
	// 256+192 + 1*(4*4*2) + 2*(4*2)
	require.EqualValues(t, 256+192+32+16, c.TokenOffset(1, 1, V, 2, 1))
	// the next slot of the same head follows it
	require.EqualValues(t, 256+192+32+24, c.TokenOffset(1, 1, V, 3, 1))

	require.Panics(t, func() { c.KVExtent(8, 0, K) })
	require.Panics(t, func() { c.KVExtent(0, 2, K) })
	require.Panics(t, func() { c.KVExtent(0, 0, 2) })
	require.Panics(t, func() { c.TokenOffset(0, 0, K, 4, 0) })
	require.Panics(t, func() { c.TokenOffset(0, 0, K, 0, 2) })
	require.Panics(t, func() { c.RunExtent(Run{Start: 6, Len: 3}) })
	require.Panics(t, func() { c.RunExtent(Run{Start: 0, Len: 0}) })
}

// TestLayoutTiles checks that every (block, layer, kv, slot, head) maps to a
// distinct HeadDim*ElemSize range and that together they tile the arena.
func TestLayoutTiles(t *testing.T) {
	c := Config{Layers: 3, KVHeads: 2, HeadDim: 3, ElemSize: 4, TokensPerBlock: 2, Blocks: 5}
	require.NoError(t, c.Validate())
	seen := make([]bool, c.ArenaBytes())
	head := int64(c.HeadDim * c.ElemSize)
	for b := BlockID(0); b < 5; b++ {
		for l := 0; l < c.Layers; l++ {
			for _, kv := range []KV{K, V} {
				e := c.KVExtent(b, l, kv)
				for s := 0; s < c.TokensPerBlock; s++ {
					for h := 0; h < c.KVHeads; h++ {
						off := c.TokenOffset(b, l, kv, s, h)
						require.GreaterOrEqual(t, off, e.Offset)
						require.LessOrEqual(t, off+head, e.End())
						for i := off; i < off+head; i++ {
							require.False(t, seen[i], "byte %d mapped twice", i)
							seen[i] = true
						}
					}
				}
			}
		}
	}
	for i, s := range seen {
		require.True(t, s, "byte %d unmapped", i)
	}
}

func TestAllocateFree(t *testing.T) {
	p := newPool(t, 16)
	require.NoError(t, p.Allocate(1, 9)) // 3 blocks
	require.Equal(t, []Run{{0, 3}}, runsOf(t, p, 1))
	require.Equal(t, 13, p.FreeBlocks())
	require.Equal(t, 3, p.UsedBlocks())
	require.Equal(t, 16, p.TotalBlocks())
	n, err := p.Tokens(1)
	require.NoError(t, err)
	require.Equal(t, 9, n)

	require.ErrorIs(t, p.Allocate(1, 1), ErrAlreadyExists)
	require.ErrorIs(t, p.Allocate(2, 0), ErrInvalidTokens)
	require.ErrorIs(t, p.Allocate(2, 14*4), ErrNoFreeBlocks)
	require.Equal(t, 13, p.FreeBlocks(), "failed calls change nothing")

	bs, err := p.Blocks(1, []BlockID{99})
	require.NoError(t, err)
	require.Equal(t, []BlockID{99, 0, 1, 2}, bs)

	require.NoError(t, p.Free(1))
	require.ErrorIs(t, p.Free(1), ErrUnknownRequest)
	_, err = p.Runs(1, nil)
	require.ErrorIs(t, err, ErrUnknownRequest)
	_, err = p.Blocks(1, nil)
	require.ErrorIs(t, err, ErrUnknownRequest)
	_, err = p.Tokens(1)
	require.ErrorIs(t, err, ErrUnknownRequest)
	require.ErrorIs(t, p.Grow(1, 5), ErrUnknownRequest)
	require.Equal(t, 16, p.FreeBlocks())
	require.Equal(t, 1, p.FreeExtents())
}

func TestGrow(t *testing.T) {
	p := newPool(t, 16)
	require.NoError(t, p.Allocate(1, 1))
	for tok := 2; tok <= 12; tok++ {
		require.NoError(t, p.Grow(1, tok))
	}
	require.Equal(t, []Run{{0, 3}}, runsOf(t, p, 1), "growing on a quiet pool stays one run")
	require.NoError(t, p.Grow(1, 5), "shrinking is a no-op")
	n, _ := p.Tokens(1)
	require.Equal(t, 12, n)
	require.Equal(t, 3, p.UsedBlocks())

	// Another request right behind forces the next growth elsewhere.
	require.NoError(t, p.Allocate(2, 4))
	require.Equal(t, []Run{{3, 1}}, runsOf(t, p, 2))
	require.NoError(t, p.Grow(1, 13))
	require.Equal(t, []Run{{0, 3}, {4, 1}}, runsOf(t, p, 1))
	require.ErrorIs(t, p.Grow(1, 0), ErrInvalidTokens)
	require.ErrorIs(t, p.Grow(1, 100*4), ErrNoFreeBlocks)
	require.Equal(t, []Run{{0, 3}, {4, 1}}, runsOf(t, p, 1))
}

func TestContiguityPreference(t *testing.T) {
	p := newPool(t, 32)
	// Fragment: a(0..3) b(4..5) c(6..13) d(14..15), rest free (16..31).
	require.NoError(t, p.Allocate('a', 16))
	require.NoError(t, p.Allocate('b', 8))
	require.NoError(t, p.Allocate('c', 32))
	require.NoError(t, p.Allocate('d', 8))
	require.NoError(t, p.Free('a')) // free: [0,4) [16,32)
	require.NoError(t, p.Free('c')) // free: [0,4) [6,14) [16,32)
	require.Equal(t, 3, p.FreeExtents())

	require.NoError(t, p.Allocate('e', 12)) // 3 blocks: best class holds [0,4)
	require.Equal(t, []Run{{0, 3}}, runsOf(t, p, 'e'))
	require.NoError(t, p.Allocate('f', 28)) // 7 blocks: fits [6,14)
	require.Equal(t, []Run{{6, 7}}, runsOf(t, p, 'f'))
	require.NoError(t, p.Allocate('g', 64)) // 16 blocks: [16,32)
	require.Equal(t, []Run{{16, 16}}, runsOf(t, p, 'g'))
	// Free now: [3,4) [13,14). Two blocks in two runs.
	require.NoError(t, p.Allocate('h', 8))
	require.Len(t, runsOf(t, p, 'h'), 2)
	require.Equal(t, 0, p.FreeBlocks())
	for _, id := range []uint64{'b', 'd', 'e', 'f', 'g', 'h'} {
		require.NoError(t, p.Free(id))
	}
	require.Equal(t, 1, p.FreeExtents())
	require.NoError(t, p.Allocate('i', 32*4))
	require.Equal(t, []Run{{0, 32}}, runsOf(t, p, 'i'), "a fresh request on an idle pool is one run")
}

func TestDummy(t *testing.T) {
	p := newPool(t, 2)
	require.NoError(t, p.AllocateDummy(0))
	require.Equal(t, 1, p.UsedBlocks())
	require.NoError(t, p.AllocateDummy(0), "idempotent for a dummy")
	require.Equal(t, 1, p.UsedBlocks())
	n, _ := p.Tokens(0)
	require.Equal(t, 1, n)
	held, dummy := p.Has(0)
	require.True(t, held)
	require.True(t, dummy)

	require.NoError(t, p.Allocate(7, 3))
	require.ErrorIs(t, p.AllocateDummy(7), ErrAlreadyExists)
	require.ErrorIs(t, p.AllocateDummy(8), ErrNoFreeBlocks)
	require.ErrorIs(t, p.Allocate(0, 1), ErrAlreadyExists)
	require.NoError(t, p.Free(0))
	require.NoError(t, p.Free(7))
	require.Equal(t, 2, p.FreeBlocks())
}

func TestHeadroom(t *testing.T) {
	p := newPool(t, 4)
	require.ErrorIs(t, p.AllocateWithHeadroom(1, 16, 1), ErrNoFreeBlocks)
	require.NoError(t, p.AllocateWithHeadroom(1, 12, 1))
	require.ErrorIs(t, p.GrowWithHeadroom(1, 13, 1), ErrNoFreeBlocks)
	require.ErrorIs(t, p.AllocateDummyWithHeadroom(2, 1), ErrNoFreeBlocks)
	require.NoError(t, p.AllocateDummyWithHeadroom(2, 0))
	require.ErrorIs(t, p.AllocateWithHeadroom(3, 1, -1), ErrInvalidTokens)
	require.ErrorIs(t, p.GrowWithHeadroom(1, 1, -1), ErrInvalidTokens)
	require.ErrorIs(t, p.AllocateDummyWithHeadroom(3, -1), ErrInvalidTokens)
	require.Equal(t, 0, p.FreeBlocks())
}

// TestFitScansWholeClass builds more small extents of one size class than
// fit examines up front, with the only fitting extent last in the class
// list and nothing larger: allocation must still find it.
func TestFitScansWholeClass(t *testing.T) {
	const small = 2 * fitScan
	p := newPool(t, small*5+8)
	// Layout: the 7-block extent [0,7) + a held separator, then small
	// 4-block extents each followed by a held separator.
	require.NoError(t, p.Allocate(1000, 7*4))
	require.NoError(t, p.Allocate(1001, 4))
	for i := range uint64(small) {
		require.NoError(t, p.Allocate(i, 4*4))
		require.NoError(t, p.Allocate(100+i, 4))
	}
	require.Equal(t, 0, p.FreeBlocks())
	require.NoError(t, p.Free(1000)) // first freed: last in its class list
	for i := range uint64(small) {
		require.NoError(t, p.Free(i))
	}
	require.Equal(t, small+1, p.FreeExtents())
	require.NoError(t, p.Allocate(2000, 7*4))
	require.Equal(t, []Run{{0, 7}}, runsOf(t, p, 2000))
	require.NoError(t, p.checkInvariants())
}

// A headroom too large to add to the blocks needed is refused, not wrapped
// into a check that passes.
func TestHeadroomDoesNotOverflow(t *testing.T) {
	p := newPool(t, 4)
	require.ErrorIs(t, p.AllocateWithHeadroom(1, 1, math.MaxInt), ErrNoFreeBlocks)
	require.ErrorIs(t, p.AllocateDummyWithHeadroom(2, math.MaxInt), ErrNoFreeBlocks)
	require.NoError(t, p.Allocate(3, 1))
	require.ErrorIs(t, p.GrowWithHeadroom(3, 8, math.MaxInt), ErrNoFreeBlocks)
	require.Equal(t, 3, p.FreeBlocks(), "nothing was handed out")
}
