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

	// DraftTokens is the most draft tokens a verification step checks
	// (speculative decoding, K); 0 turns speculation off. It sizes the
	// padding rows (one per reachable draft length, PaddingDraftLens) and
	// adds one scratch row per real row (ScratchRow). It must not exceed
	// MaxDraftTokens, so every reachable length has a padding sentinel id.
	DraftTokens int
	// DraftLenSchedule, with DraftTokens > 0, picks a step's draft length
	// by its batch size; its lengths must not exceed DraftTokens.
	DraftLenSchedule DraftSchedule
	// AcceptanceGating, with DraftTokens > 0, says an acceptance-rate gate
	// may switch drafting off (draft length 0) at run time.
	AcceptanceGating bool
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
	if c.DraftTokens < 0 || c.DraftTokens > c.MaxDraftTokens {
		return bad("DraftTokens = %d, want 0..MaxDraftTokens (%d): a reachable draft length needs a padding sentinel id",
			c.DraftTokens, c.MaxDraftTokens)
	}
	if err := c.DraftLenSchedule.check(); err != nil {
		return fmt.Errorf("%w: DraftLenSchedule: %w", ErrInvalidConfig, err)
	}
	if c.DraftTokens == 0 && (c.DraftLenSchedule.Len() > 0 || c.AcceptanceGating) {
		return bad("DraftLenSchedule %q or AcceptanceGating without speculation (DraftTokens = 0)", c.DraftLenSchedule)
	}
	for i, e := range c.DraftLenSchedule.list() {
		if e.DraftLen > c.DraftTokens {
			return fmt.Errorf("%w: DraftLenSchedule entry %d %s: %w: draft length above DraftTokens (%d), no padding row for it",
				ErrInvalidConfig, i+1, e, ErrInvalidSchedule, c.DraftTokens)
		}
	}
	rows := int64(c.MaxBatchSize)*int64(c.pp()) + int64(c.ReservedRows()) + int64(c.CheckpointRows)
	if c.DraftTokens > 0 {
		rows += int64(c.MaxBatchSize) * int64(c.pp())
	}
	if rows > MaxRows {
		return bad("%d rows (MaxBatchSize %d x PPSize %d + %d reserved + %d checkpoint + scratch), want at most %d",
			rows, c.MaxBatchSize, c.pp(), c.ReservedRows(), c.CheckpointRows, MaxRows)
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
// padding row per reachable draft length (PaddingRows), plus one
// attention-DP dummy row when AttentionDP.
func (c Config) ReservedRows() int {
	if c.AttentionDP {
		return c.PaddingRows() + 1
	}
	return c.PaddingRows()
}

// PaddingRows is the number of padding rows, TensorRT-LLM's
// _get_num_cuda_graph_padding_dummy_slots: len(PaddingDraftLens()).
func (c Config) PaddingRows() int {
	n := 0
	c.paddingDraftLens(func(int) { n++ })
	return n
}

// PaddingDraftLens appends to dst, in increasing order, the draft lengths
// that have a padding row, TensorRT-LLM's rule
// (MambaHybridCacheManagerV2._get_num_cuda_graph_padding_dummy_slots):
//
//  1. speculation off (DraftTokens 0): {0}, one row every padding sentinel
//     shares;
//  2. with a DraftLenSchedule: the distinct lengths the schedule reaches at
//     batch sizes 1..MaxBatchSize, plus 0 when MaxBatchSize is above its
//     last entry;
//  3. otherwise {DraftTokens};
//
// plus 0 when AcceptanceGating can switch drafting off.
func (c Config) PaddingDraftLens(dst []int) []int {
	c.paddingDraftLens(func(dl int) { dst = append(dst, dl) })
	return dst
}

func (c Config) paddingDraftLens(f func(dl int)) {
	if c.DraftTokens <= 0 {
		f(0)
		return
	}
	sched := c.DraftLenSchedule
	zero := c.AcceptanceGating || sched.uncovered(c.MaxBatchSize)
	if zero {
		f(0) // the smallest length comes first
	}
	each := func(dl int) {
		if dl != 0 || !zero {
			f(dl)
		}
	}
	if sched.Len() > 0 {
		sched.reachable(c.MaxBatchSize, each)
	} else {
		each(c.DraftTokens)
	}
}

// PaddingDraftLen reports the draft length a padding sentinel id stands
// for: PaddingSentinelID - id. ok is false for an id that is not a padding
// sentinel (IsPaddingID).
func (c Config) PaddingDraftLen(id uint64) (dl int, ok bool) {
	if !c.IsPaddingID(id) {
		return 0, false
	}
	return int(PaddingSentinelID - id), true
}

// PaddingIDFor returns the padding sentinel id of draft length dl,
// PaddingSentinelID - dl (TensorRT-LLM's CUDA_GRAPH_DUMMY_REQUEST_ID -
// draft_len).
func PaddingIDFor(dl int) uint64 { return PaddingSentinelID - uint64(max(dl, 0)) }

// TotalRows is the pool size: MaxBatchSize*PPSize + PaddingRows + 1 if
// AttentionDP (checkpoint and scratch rows come after it, see ArenaRows).
func (c Config) TotalRows() int { return c.RealRows() + c.ReservedRows() }

// RealRows is the scheduler-visible capacity: MaxBatchSize*PPSize.
func (c Config) RealRows() int { return c.MaxBatchSize * c.pp() }

// PaddingRow is the padding row of the smallest padding draft length,
// TotalRows-1: with speculation off, the one row every padding sentinel
// shares.
func (c Config) PaddingRow() Row { return Row(c.TotalRows() - 1) }

// PaddingRowFor returns the padding row of draft length dl: the rows are
// popped from the top in increasing draft-length order, so the i-th
// length of PaddingDraftLens has row TotalRows-1-i. With speculation off
// every length shares PaddingRow. ok is false for a length with no row.
func (c Config) PaddingRowFor(dl int) (r Row, ok bool) {
	if c.DraftTokens <= 0 {
		return c.PaddingRow(), dl >= 0 && dl <= c.MaxDraftTokens
	}
	i, found := 0, false
	c.paddingDraftLens(func(l int) {
		if found {
			return
		}
		if l == dl {
			found = true
			return
		}
		i++
	})
	if !found {
		return 0, false
	}
	return Row(c.TotalRows() - 1 - i), true
}

// ADPRow is the reserved row of the attention-DP dummy:
// TotalRows-1-PaddingRows (TotalRows-2 with speculation off). ok is false
// when AttentionDP is off.
func (c Config) ADPRow() (r Row, ok bool) {
	if !c.AttentionDP {
		return 0, false
	}
	return Row(c.TotalRows() - 1 - c.PaddingRows()), true
}

// ScratchRows is the number of scratch rows: one per real row with
// speculation on (DraftTokens > 0), else none.
func (c Config) ScratchRows() int {
	if c.DraftTokens > 0 {
		return c.RealRows()
	}
	return 0
}

// ScratchRow returns the scratch row of real row r: where the verifying
// worker keeps the request's state from before a verification step, to
// roll back to when not every draft is accepted. It is the request's
// only while it holds r, lives only on that worker and is never
// transferred. ok is false with speculation off or for a row that is not
// real.
func (c Config) ScratchRow(r Row) (Row, bool) {
	if c.DraftTokens <= 0 || int64(r) >= int64(c.RealRows()) {
		return 0, false
	}
	return Row(c.TotalRows() + c.CheckpointRows + int(r)), true
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
// ArenaRows * RowBytes (reserved, checkpoint and scratch rows included).
func (c Config) ArenaBytes() int64 { return int64(c.ArenaRows()) * c.RowBytes() }

// ArenaRows is TotalRows + CheckpointRows + ScratchRows: every row of the
// arena.
func (c Config) ArenaRows() int { return c.TotalRows() + c.CheckpointRows + c.ScratchRows() }

// IsCheckpointRow reports whether r is one of the checkpoint rows. Like a
// reserved row it is never a request's: no transfer may name it.
func (c Config) IsCheckpointRow(r Row) bool {
	return int64(r) >= int64(c.TotalRows()) && int64(r) < int64(c.TotalRows()+c.CheckpointRows)
}

// RowKind is what a state row is for. Only RowReal rows ever hold a
// request's state that may leave the worker.
type RowKind uint8

// The row kinds, in arena order after RowReal.
const (
	RowReal       RowKind = iota // 0 .. RealRows-1: a request's committed state
	RowADP                       // the attention-DP dummy's reserved row
	RowPadding                   // a CUDA-graph padding dummy's reserved row, one per draft length
	RowCheckpoint                // a prefix-cache checkpoint (checkpoint.go)
	RowScratch                   // a verifying request's pre-verification state (ScratchRow)
)

// String returns the kind's name.
func (k RowKind) String() string {
	switch k {
	case RowReal:
		return "real"
	case RowADP:
		return "adp"
	case RowPadding:
		return "padding"
	case RowCheckpoint:
		return "checkpoint"
	case RowScratch:
		return "scratch"
	}
	return fmt.Sprintf("RowKind(%d)", uint8(k))
}

// RowRole is a row's role: its kind and, for a padding row, the draft
// length it pads.
type RowRole struct {
	Kind     RowKind
	DraftLen int // RowPadding only
}

// String returns "real", "padding(4)", "adp", "checkpoint" or "scratch".
func (r RowRole) String() string {
	if r.Kind == RowPadding {
		return fmt.Sprintf("padding(%d)", r.DraftLen)
	}
	return r.Kind.String()
}

// Transferable reports whether a row of this role may be named by a
// transfer: only a real row.
func (r RowRole) Transferable() bool { return r.Kind == RowReal }

// RoleOf returns row r's role. ok is false for a row outside the arena.
// With speculation off the one padding row reports draft length 0.
func (c Config) RoleOf(r Row) (role RowRole, ok bool) {
	i := int64(r)
	switch real, total := int64(c.RealRows()), int64(c.TotalRows()); {
	case i < real:
		return RowRole{Kind: RowReal}, true
	case i < total:
		if adp, ok := c.ADPRow(); ok && r == adp {
			return RowRole{Kind: RowADP}, true
		}
		k := int(total - 1 - i) // the k-th padding length, increasing
		role = RowRole{Kind: RowPadding}
		c.paddingDraftLens(func(dl int) {
			if k == 0 {
				role.DraftLen = dl
			}
			k--
		})
		return role, true
	case i < total+int64(c.CheckpointRows):
		return RowRole{Kind: RowCheckpoint}, true
	case i < int64(c.ArenaRows()):
		return RowRole{Kind: RowScratch}, true
	}
	return RowRole{}, false
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
