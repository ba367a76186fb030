package mambacache

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

func testConfig(mbs int, adp bool) Config {
	return Config{
		Layers: 2, DState: 4, DConv: 4, Heads: 2, HeadDim: 3, NGroups: 1,
		ConvElemSize: 2, SSMElemSize: 4, MaxBatchSize: mbs, AttentionDP: adp, MaxDraftTokens: 2,
	}
}

func newPool(t testing.TB, c Config) *Pool {
	t.Helper()
	p, err := New(c)
	require.NoError(t, err)
	return p
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name string
		mod  func(*Config)
		want string
	}{
		{"valid", func(*Config) {}, ""},
		{"valid pp", func(c *Config) { c.PPSize = 4 }, ""},
		{"zero layers", func(c *Config) { c.Layers = 0 }, "Layers = 0"},
		{"zero dstate", func(c *Config) { c.DState = 0 }, "DState = 0"},
		{"dconv one", func(c *Config) { c.DConv = 1 }, "DConv = 1"},
		{"zero heads", func(c *Config) { c.Heads = 0 }, "Heads = 0"},
		{"zero head dim", func(c *Config) { c.HeadDim = 0 }, "HeadDim = 0"},
		{"zero groups", func(c *Config) { c.NGroups = 0 }, "NGroups = 0"},
		{"conv elem", func(c *Config) { c.ConvElemSize = 3 }, "ConvElemSize = 3"},
		{"ssm elem", func(c *Config) { c.SSMElemSize = 0 }, "SSMElemSize = 0"},
		{"layout", func(c *Config) { c.ConvLayout = 7 }, "ConvLayout"},
		{"zero batch", func(c *Config) { c.MaxBatchSize = 0 }, "MaxBatchSize = 0"},
		{"negative pp", func(c *Config) { c.PPSize = -1 }, "PPSize = -1"},
		{"negative draft", func(c *Config) { c.MaxDraftTokens = -1 }, "MaxDraftTokens = -1"},
		{"too many rows", func(c *Config) { c.MaxBatchSize, c.PPSize = maxDim, maxDim }, "rows"},
		{"overflow", func(c *Config) { c.Heads, c.HeadDim, c.DState = maxDim, maxDim, maxDim }, "overflows"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := testConfig(4, true)
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

func TestConfigSizes(t *testing.T) {
	for _, tt := range []struct {
		mbs, pp          int
		adp              bool
		total, real, res int
	}{
		{1, 0, false, 2, 1, 1},
		{1, 0, true, 3, 1, 2},
		{8, 1, false, 9, 8, 1},
		{8, 1, true, 10, 8, 2},
		{4, 2, true, 10, 8, 2},
	} {
		c := testConfig(tt.mbs, tt.adp)
		c.PPSize = tt.pp
		require.Equal(t, tt.total, c.TotalRows())
		require.Equal(t, tt.real, c.RealRows())
		require.Equal(t, tt.res, c.ReservedRows())
		require.Equal(t, Row(tt.total-1), c.PaddingRow())
		r, ok := c.ADPRow()
		require.Equal(t, tt.adp, ok)
		if ok {
			require.Equal(t, Row(tt.total-2), r)
		}
	}
}

func TestLayout(t *testing.T) {
	c := testConfig(1, true)
	// d_inner 6, conv_dim 6+2*1*4 = 14; conv bytes 14*3*2 = 84; ssm 2*3*4*4 = 96.
	require.Equal(t, 14, c.ConvDim())
	require.EqualValues(t, 84, c.ConvBytes())
	require.EqualValues(t, 96, c.SSMBytes())
	require.EqualValues(t, 180, c.LayerBytes())
	require.EqualValues(t, 360, c.RowBytes())
	require.EqualValues(t, 3*360, c.ArenaBytes())
	require.Equal(t, Extent{Offset: 720, Length: 360}, c.RowExtent(2))
	// Row 1, layer 1 starts at 360+180 = 540.
	require.Equal(t, Extent{Offset: 540, Length: 36}, c.ConvExtent(1, 1, SectionX)) // 6 ch * 3 * 2
	require.Equal(t, Extent{Offset: 576, Length: 24}, c.ConvExtent(1, 1, SectionB)) // 4 ch
	require.Equal(t, Extent{Offset: 600, Length: 24}, c.ConvExtent(1, 1, SectionC))
	require.Equal(t, Extent{Offset: 624, Length: 96}, c.SSMExtent(1, 1))

	q := c
	q.ConvLayout = ConvQKV
	require.Equal(t, Extent{Offset: 540, Length: 24}, q.ConvExtent(1, 1, SectionX))
	require.Equal(t, Extent{Offset: 564, Length: 24}, q.ConvExtent(1, 1, SectionB))
	require.Equal(t, Extent{Offset: 588, Length: 36}, q.ConvExtent(1, 1, SectionC))

	require.Panics(t, func() { c.RowExtent(3) })
	require.Panics(t, func() { c.SSMExtent(0, 2) })
	require.Panics(t, func() { c.ConvExtent(0, -1, SectionX) })
	require.Panics(t, func() { c.ConvExtent(0, 0, 3) })
}

// TestLayoutTiles checks that the per-layer sections and SSM extents of
// every row tile the arena exactly, for both conv layouts.
func TestLayoutTiles(t *testing.T) {
	for _, layout := range []ConvLayout{ConvXBC, ConvQKV} {
		c := testConfig(2, true)
		c.ConvLayout = layout
		c.Layers = 3
		next := int64(0)
		for r := Row(0); int(r) < c.TotalRows(); r++ {
			require.Equal(t, next, c.RowExtent(r).Offset)
			for l := 0; l < c.Layers; l++ {
				for _, s := range []Section{SectionX, SectionB, SectionC} {
					e := c.ConvExtent(r, l, s)
					require.Equal(t, next, e.Offset, "%v row %d layer %d %v", layout, r, l, s)
					next = e.End()
				}
				e := c.SSMExtent(r, l)
				require.Equal(t, next, e.Offset)
				next = e.End()
			}
			require.Equal(t, next, c.RowExtent(r).End())
		}
		require.Equal(t, c.ArenaBytes(), next)
	}
}

func TestIDs(t *testing.T) {
	c := testConfig(1, true) // MaxDraftTokens 2
	require.True(t, c.IsPaddingID(math.MaxUint64))
	require.True(t, c.IsPaddingID(math.MaxUint64-2))
	require.False(t, c.IsPaddingID(math.MaxUint64-3))
	require.False(t, c.IsPaddingID(0))
	require.True(t, c.IsDummyID(0))
	require.True(t, c.IsDummyID(math.MaxUint64-1))
	require.False(t, c.IsDummyID(1))
	c.AttentionDP = false
	require.False(t, c.IsDummyID(0), "without attention DP, id 0 is an ordinary id")
	c.MaxDraftTokens = 0
	require.True(t, c.IsPaddingID(math.MaxUint64))
	require.False(t, c.IsPaddingID(math.MaxUint64-1))
}

func TestAllocateFree(t *testing.T) {
	p := newPool(t, testConfig(3, false)) // rows 0..3, padding = 3
	require.Equal(t, 3, p.Capacity())
	require.Equal(t, 3, p.FreeRows())
	require.Equal(t, []Row{0, 1, 2}, p.FreeList(nil))

	r, err := p.Allocate(10)
	require.NoError(t, err)
	require.Equal(t, Row(2), r, "LIFO: the top of the stack first")
	r2, err := p.Allocate(10)
	require.NoError(t, err)
	require.Equal(t, r, r2, "idempotent")
	r, err = p.Allocate(11)
	require.NoError(t, err)
	require.Equal(t, Row(1), r)
	require.Equal(t, 2, p.UsedRows())
	require.Equal(t, 1, p.FreeRows())

	require.NoError(t, p.Free(10))
	require.ErrorIs(t, p.Free(10), ErrUnknownRequest)
	r, err = p.Allocate(12)
	require.NoError(t, err)
	require.Equal(t, Row(2), r, "a freed row is reused first")
	_, err = p.Allocate(13)
	require.NoError(t, err)
	_, err = p.Allocate(14)
	require.ErrorIs(t, err, ErrNoFreeRows)
	require.ErrorContains(t, err, "run out of mamba cache blocks")
	_, ok := p.Row(14)
	require.False(t, ok)
	_, err = p.Allocate(math.MaxUint64)
	require.ErrorIs(t, err, ErrDummyID)
	_, err = p.Allocate(0)
	require.ErrorIs(t, err, ErrNoFreeRows, "without attention DP, id 0 is a real id")
}
