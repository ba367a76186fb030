package mambacache

import (
	"fmt"
	"math"

	"github.com/handoff-io/handoff/internal/reqid"
)

// ADPDummyID is the request id attention-DP ranks pad with. When attention
// DP is on it maps to the reserved ADP row. TensorRT-LLM calls it
// ATTENTION_DP_DUMMY_REQUEST_ID: generated real request ids never use 0.
const ADPDummyID = reqid.ADPDummy

// PaddingSentinelID is the top of the padding sentinel id range
// (TensorRT-LLM's CUDA_GRAPH_DUMMY_REQUEST_ID, 2^64-1). A batch padded for a
// captured CUDA graph repeats the id PaddingSentinelID - draft_len; every
// such id shares the reserved padding row.
const PaddingSentinelID = reqid.PaddingSentinel

// MaxRows bounds TotalRows; a Row is a uint32 and real pools hold at most
// a few thousand rows.
const MaxRows = 1 << 24

// maxDim bounds each dimension so that products cannot overflow before
// Validate checks them.
const maxDim = 1 << 20

// Row names one state row: 0 .. TotalRows-1.
type Row uint32

// Section of a conv state row. Sections are numbered in arena order: the
// first, second and third chunk of conv_dim. Which tensor each holds depends
// on the ConvLayout.
type Section uint8

// The three conv sections, in arena order.
const (
	SectionX Section = iota // x (Mamba2) / Q (GDN, see ConvLayout)
	SectionB                // B (Mamba2) / K (GDN)
	SectionC                // C (Mamba2) / V (GDN)
)

// String returns the section's Mamba2 name.
func (s Section) String() string {
	switch s {
	case SectionX:
		return "x"
	case SectionB:
		return "B"
	case SectionC:
		return "C"
	}
	return fmt.Sprintf("Section(%d)", uint8(s))
}

// ConvLayout orders the three sections of a conv state row.
type ConvLayout uint8

// The conv layouts of the supported model families.
const (
	ConvXBC ConvLayout = iota // Nemotron-H: [x | B | C] = [d_inner, ng*ds, ng*ds]
	ConvQKV                   // Qwen3-Next: [Q | K | V] = [ng*ds, ng*ds, d_inner]
)

// String returns "xBC" or "QKV".
func (l ConvLayout) String() string {
	switch l {
	case ConvXBC:
		return "xBC"
	case ConvQKV:
		return "QKV"
	}
	return fmt.Sprintf("ConvLayout(%d)", uint8(l))
}

// Extent is a byte range of the pool's arena.
type Extent struct {
	Offset int64
	Length int64
}

// End returns Offset+Length.
func (e Extent) End() int64 { return e.Offset + e.Length }

// Config describes the row pool. Dimensions are those of one rank: Heads
// and NGroups are the local counts (under attention DP the state is not
// tensor-parallel split), Layers the Mamba layers this rank holds.
type Config struct {
	Layers         int
	DState         int
	DConv          int
	Heads          int
	HeadDim        int
	NGroups        int
	ConvElemSize   int
	SSMElemSize    int
	ConvLayout     ConvLayout
	MaxBatchSize   int
	PPSize         int // 0 means 1
	AttentionDP    bool
	MaxDraftTokens int // width of the padding sentinel id range [2^64-1-MaxDraftTokens, 2^64-1]
	// CheckpointRows is the number of checkpoint rows of the prefix cache
	// (checkpoint.go): rows TotalRows .. ArenaRows-1, outside the real
	// capacity and the reserved rows. 0 turns state checkpoints off.
	CheckpointRows int
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
		{"Layers", c.Layers}, {"DState", c.DState}, {"DConv", c.DConv}, {"Heads", c.Heads},
		{"HeadDim", c.HeadDim}, {"NGroups", c.NGroups}, {"ConvElemSize", c.ConvElemSize},
		{"SSMElemSize", c.SSMElemSize}, {"MaxBatchSize", c.MaxBatchSize},
	}
	for _, d := range dims {
		if d.v < 1 || d.v > maxDim {
			return bad("%s = %d, want 1..%d", d.name, d.v, maxDim)
		}
	}
	if c.DConv < 2 {
		return bad("DConv = %d, want >= 2 (the conv state keeps DConv-1 columns)", c.DConv)
	}
	for _, e := range []struct {
		name string
		v    int
	}{{"ConvElemSize", c.ConvElemSize}, {"SSMElemSize", c.SSMElemSize}} {
		switch e.v {
		case 1, 2, 4, 8:
		default:
			return bad("%s = %d, want 1, 2, 4 or 8", e.name, e.v)
		}
	}
	if c.ConvLayout > ConvQKV {
		return bad("ConvLayout = %d, want ConvXBC or ConvQKV", c.ConvLayout)
	}
	if c.PPSize < 0 || c.PPSize > maxDim {
		return bad("PPSize = %d, want 0 (meaning 1) or 1..%d", c.PPSize, maxDim)
	}
	if c.CheckpointRows < 0 || c.CheckpointRows > maxDim {
		return bad("CheckpointRows = %d, want 0..%d", c.CheckpointRows, maxDim)
	}
	if c.MaxDraftTokens < 0 || c.MaxDraftTokens > maxDim {
		return bad("MaxDraftTokens = %d, want 0..%d", c.MaxDraftTokens, maxDim)
	}
	if rows := int64(c.MaxBatchSize)*int64(c.pp()) + 2 + int64(c.CheckpointRows); rows > MaxRows {
		return bad("%d rows (MaxBatchSize %d x PPSize %d + reserved + %d checkpoint), want at most %d",
			rows, c.MaxBatchSize, c.pp(), c.CheckpointRows, MaxRows)
	}
	lb, ok := c.layerBytesChecked()
	if !ok || lb > math.MaxInt64/int64(c.Layers) || lb*int64(c.Layers) > math.MaxInt64/int64(c.ArenaRows()) {
		return bad("arena size overflows int64")
	}
	return nil
}

func (c Config) pp() int {
	if c.PPSize == 0 {
		return 1
	}
	return c.PPSize
}

func mul(fs ...int) (int64, bool) {
	v := int64(1)
	for _, f := range fs {
		if f <= 0 || v > math.MaxInt64/int64(f) {
			return 0, false
		}
		v *= int64(f)
	}
	return v, true
}

func (c Config) layerBytesChecked() (int64, bool) {
	conv, ok1 := mul(c.ConvDim(), c.DConv-1, c.ConvElemSize)
	ssm, ok2 := mul(c.Heads, c.HeadDim, c.DState, c.SSMElemSize)
	if !ok1 || !ok2 || conv > math.MaxInt64-ssm {
		return 0, false
	}
	return conv + ssm, true
}

// ReservedRows is the number of rows never handed to a real request: one
// padding sentinel row, plus one attention-DP dummy row when AttentionDP.
func (c Config) ReservedRows() int {
	if c.AttentionDP {
		return 2
	}
	return 1
}

// TotalRows is the pool size: MaxBatchSize*PPSize + 1 (padding sentinel) +
// 1 if AttentionDP.
func (c Config) TotalRows() int { return c.RealRows() + c.ReservedRows() }

// RealRows is the scheduler-visible capacity: MaxBatchSize*PPSize.
func (c Config) RealRows() int { return c.MaxBatchSize * c.pp() }

// PaddingRow is the reserved row of the padding sentinels: TotalRows-1.
func (c Config) PaddingRow() Row { return Row(c.TotalRows() - 1) }

// ADPRow is the reserved row of the attention-DP dummy: TotalRows-2. ok
// is false when AttentionDP is off.
func (c Config) ADPRow() (r Row, ok bool) {
	if !c.AttentionDP {
		return 0, false
	}
	return Row(c.TotalRows() - 2), true
}

// DInner is Heads*HeadDim.
func (c Config) DInner() int { return c.Heads * c.HeadDim }

// ConvDim is the conv channel count: DInner + 2*NGroups*DState.
func (c Config) ConvDim() int { return c.DInner() + 2*c.NGroups*c.DState }

// SectionDim returns the channel count of conv section s.
func (c Config) SectionDim(s Section) int {
	gs := c.NGroups * c.DState
	switch {
	case s > SectionC:
		panic(fmt.Sprintf("mambacache: %v is not a conv section", s))
	case c.ConvLayout == ConvQKV && s == SectionC, c.ConvLayout != ConvQKV && s == SectionX:
		return c.DInner()
	}
	return gs
}

// ConvBytes is the size of one layer's conv state:
// ConvDim*(DConv-1)*ConvElemSize.
func (c Config) ConvBytes() int64 {
	return int64(c.ConvDim()) * int64(c.DConv-1) * int64(c.ConvElemSize)
}

// SSMBytes is the size of one layer's SSM state:
// Heads*HeadDim*DState*SSMElemSize.
func (c Config) SSMBytes() int64 {
	return int64(c.Heads) * int64(c.HeadDim) * int64(c.DState) * int64(c.SSMElemSize)
}

// LayerBytes is ConvBytes + SSMBytes: one layer of one row.
func (c Config) LayerBytes() int64 { return c.ConvBytes() + c.SSMBytes() }

// RowBytes is the size of one row: Layers * LayerBytes.
func (c Config) RowBytes() int64 { return int64(c.Layers) * c.LayerBytes() }

// ArenaBytes is the size of the arena the caller must hold:
// ArenaRows * RowBytes (reserved and checkpoint rows included).
func (c Config) ArenaBytes() int64 { return int64(c.ArenaRows()) * c.RowBytes() }

// ArenaRows is TotalRows + CheckpointRows: every row of the arena.
func (c Config) ArenaRows() int { return c.TotalRows() + c.CheckpointRows }

// IsCheckpointRow reports whether r is one of the checkpoint rows. Like a
// reserved row it is never a request's: no transfer may name it.
func (c Config) IsCheckpointRow(r Row) bool {
	return int64(r) >= int64(c.TotalRows()) && int64(r) < int64(c.ArenaRows())
}

// RowExtent returns the bytes of row r, one contiguous extent. It panics on
// an out-of-range row.
func (c Config) RowExtent(r Row) Extent {
	c.checkRow(r)
	rb := c.RowBytes()
	return Extent{Offset: int64(r) * rb, Length: rb}
}

// LayerExtent returns the bytes of one layer of row r: conv state then SSM
// state.
func (c Config) LayerExtent(r Row, layer int) Extent {
	c.checkRow(r)
	c.checkLayer(layer)
	return Extent{Offset: int64(r)*c.RowBytes() + int64(layer)*c.LayerBytes(), Length: c.LayerBytes()}
}

// ConvExtent returns the bytes of conv section s of layer layer of row r:
// SectionDim(s) channels of DConv-1 elements each.
func (c Config) ConvExtent(r Row, layer int, s Section) Extent {
	base := c.LayerExtent(r, layer).Offset
	col := int64(c.DConv-1) * int64(c.ConvElemSize)
	var before int
	for x := SectionX; x < s; x++ {
		before += c.SectionDim(x)
	}
	return Extent{Offset: base + int64(before)*col, Length: int64(c.SectionDim(s)) * col}
}

// SSMExtent returns the bytes of the SSM state of layer layer of row r:
// [Heads][HeadDim][DState] elements.
func (c Config) SSMExtent(r Row, layer int) Extent {
	base := c.LayerExtent(r, layer).Offset
	return Extent{Offset: base + c.ConvBytes(), Length: c.SSMBytes()}
}

// IsPaddingID reports whether id is a padding sentinel:
// 2^64-1-MaxDraftTokens <= id <= 2^64-1 (reqid.IsPadding).
func (c Config) IsPaddingID(id uint64) bool { return reqid.IsPadding(id, c.MaxDraftTokens) }

// IsDummyID reports whether id lives on a reserved row: the ADP dummy id
// (only when AttentionDP) or a padding sentinel. Other dummies (warm-up)
// take real rows and are not dummy ids in this sense.
//
// It says which row an id takes, not whether the id may be transferred:
// ADPDummyID without attention DP takes a real row here, yet is never a
// real request's id, so no transfer names it (reqid.IsDummy, which
// transfer/session applies).
func (c Config) IsDummyID(id uint64) bool {
	return c.IsPaddingID(id) || (c.AttentionDP && id == ADPDummyID)
}

func (c Config) checkRow(r Row) {
	if int64(r) >= int64(c.ArenaRows()) {
		panic(fmt.Sprintf("mambacache: row %d outside a pool of %d rows", r, c.ArenaRows()))
	}
}

func (c Config) checkLayer(layer int) {
	if layer < 0 || layer >= c.Layers {
		panic(fmt.Sprintf("mambacache: layer %d outside 0..%d", layer, c.Layers-1))
	}
}
