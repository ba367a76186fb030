package agent

import (
	"fmt"
	"slices"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/reshard"
)

// Layout is how an engine describes its caches when it registers them, in
// the pools' terms (kvcache, mambacache). Dimensions are the whole model's
// (TP 1); the memory passed is one TP shard's: reshard.KVShard and
// reshard.MambaShard of them for TP.Size.
type Layout struct {
	Model    string       `msgpack:"model"`
	Revision string       `msgpack:"revision"`
	Pattern  string       `msgpack:"pattern"` // one byte per layer: 'M' mamba, '*' attention, '-' MLP
	Vocab    int          `msgpack:"vocab"`
	KV       *KVLayout    `msgpack:"kv"`
	Mamba    *MambaLayout `msgpack:"mamba"`
	TP       TP           `msgpack:"tp"`
}

// TP is an engine's tensor-parallel rank and size. The zero value means 1.
type TP struct {
	Rank int `msgpack:"rank"`
	Size int `msgpack:"size"`
}

// KVLayout is the paged KV cache: Blocks blocks stored back to back, each
// every attention layer's K then V, each [KVHeads][TokensPerBlock][HeadDim]
// elements of DType (kvcache's HND layout; Order may say NHD). BlockStride,
// when set, must be the shard's block size. Planes, when set, place each
// layer's K and V apart instead (planes.go): 2*Layers planes, layer l's K
// then its V.
type KVLayout struct {
	Layers         int    `msgpack:"layers"`
	KVHeads        int    `msgpack:"kv_heads"`
	HeadDim        int    `msgpack:"head_dim"`
	TokensPerBlock int    `msgpack:"tokens_per_block"`
	DType          string `msgpack:"dtype"`
	Blocks         int    `msgpack:"blocks"`
	BlockStride    int64  `msgpack:"block_stride"`
	Planes         Planes `msgpack:"planes"`
	// Order is the element order within a block's K or V: "hnd" (or
	// empty; heads, tokens, head_dim: kvcache's and TensorRT-LLM's) or
	// "nhd" (tokens, heads, head_dim: vLLM's default and SGLang's). NHD
	// cannot be cut by heads: it moves between agents of its own order and
	// TP size only.
	Order string `msgpack:"order"`
}

// MambaLayout is the Mamba state pool: Rows rows back to back, each every
// Mamba layer's conv state (three sections in ConvLayout order, each
// channel DConv-1 elements of ConvDType) then its SSM state
// [Heads][HeadDim][DState] of SSMDType (mambacache's layout). Reserved rows
// (the padding and attention-DP dummies) are never granted nor sent.
// Planes, when set, place each layer's conv and SSM states apart instead
// (planes.go): 2*Layers planes, layer l's conv state then its SSM state.
// ConvOrder "sd" says each conv state is kept position by position
// instead ([DConv-1][channels], channels innermost: vLLM's default).
type MambaLayout struct {
	Layers     int    `msgpack:"layers"`
	Heads      int    `msgpack:"heads"`
	HeadDim    int    `msgpack:"head_dim"`
	DState     int    `msgpack:"d_state"`
	NGroups    int    `msgpack:"n_groups"`
	DConv      int    `msgpack:"d_conv"`
	ConvLayout string `msgpack:"conv_layout"` // "xbc" (Mamba2) or "qkv" (GDN)
	ConvDType  string `msgpack:"conv_dtype"`
	SSMDType   string `msgpack:"ssm_dtype"`
	Rows       int    `msgpack:"rows"`
	Reserved   []int  `msgpack:"reserved"`
	RowStride  int64  `msgpack:"row_stride"`
	Planes     Planes `msgpack:"planes"`
	ConvOrder  string `msgpack:"conv_order"` // "ds" (or empty: channels, then positions) or "sd"
}

// maxLayers bounds each cache's layers: the largest models have a few
// hundred. A registration's planes (two per layer) are refused while
// decoding past twice what it allows (maxDecodedPlanes).
const maxLayers = 4096

// maxSDConv bounds d_conv for conv states kept position by position (the
// models' is 4).
const maxSDConv = 64

// dtypeSize returns the element size of a dtype name (torch's spelling,
// without "torch.").
func dtypeSize(d string) (int, bool) {
	switch d {
	case "float64", "int64":
		return 8, true
	case "float32", "int32":
		return 4, true
	case "bfloat16", "float16", "int16":
		return 2, true
	case "float8_e4m3fn", "float8_e5m2", "int8", "uint8":
		return 1, true
	}
	return 0, false
}

// pools is a validated Layout: the shard's pool configs, whose offsets the
// agent computes extents from, and the fingerprint peers compare.
type pools struct {
	l           Layout
	kv          kvcache.Config    // the shard's; Layers 0 without a KV cache
	mamba       mambacache.Config // the shard's; Layers 0 without Mamba state
	wholeKV     kvcache.Config    // the whole model's (TP 1), which reshard plans from
	wholeMamba  mambacache.Config
	kvAt, mamAt placement // where the shard's units lie in the registered memory
	pc          planCache
	rows        int
	reserved    []int // sorted
	fingerprint string
}

// compile validates l and computes the shard's pool configs and the
// fingerprint the workers compute (model.Spec.Fingerprint of the whole
// model). buffered says the memory comes as buffers that the planes name
// (Request.Buffers), rather than one per cache (buffer 0 the KV pool's, 1
// the Mamba pool's). Errors wrap ErrInvalidLayout.
func compile(l Layout, buffered bool) (*pools, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidLayout}, args...)...)
	}
	if l.TP.Size == 0 {
		l.TP.Size = 1
	}
	if l.TP.Size < 1 || l.TP.Size > reshard.MaxTP || l.TP.Rank < 0 || l.TP.Rank >= l.TP.Size {
		return nil, bad("TP rank %d of size %d", l.TP.Rank, l.TP.Size)
	}
	if l.KV == nil && l.Mamba == nil {
		return nil, bad("neither a KV cache nor Mamba state")
	}
	p := &pools{l: l}
	spec := model.Spec{Name: l.Model, Revision: l.Revision, LayerPattern: l.Pattern, Vocab: l.Vocab}
	if k := l.KV; k != nil {
		if k.Layers > maxLayers {
			return nil, bad("kv: %d layers, at most %d", k.Layers, maxLayers)
		}
		es, ok := dtypeSize(k.DType)
		if !ok {
			return nil, bad("kv dtype %q", k.DType)
		}
		spec.KV = kvcache.Config{Layers: k.Layers, KVHeads: k.KVHeads, HeadDim: k.HeadDim, ElemSize: es, TokensPerBlock: k.TokensPerBlock, Blocks: k.Blocks}
		if err := spec.KV.Validate(); err != nil {
			return nil, bad("kv: %w", err)
		}
		sh, err := reshard.KVShard(spec.KV, l.TP.Size)
		if err != nil {
			return nil, bad("kv: %w", err)
		}
		if k.BlockStride != 0 && (k.Planes != nil || k.BlockStride != sh.BlockBytes()) {
			return nil, bad("kv block stride %d, the pool layout's is %d (blocks back to back; planes take their own strides)", k.BlockStride, sh.BlockBytes())
		}
		switch k.Order {
		case "", "hnd", "nhd":
		default:
			return nil, bad("kv order %q, want hnd or nhd", k.Order)
		}
		lens := make([]uint64, 2*sh.Layers)
		for i := range lens {
			lens[i] = uint64(sh.BlockBytes()) / uint64(len(lens))
		}
		if p.kvAt, err = newPlacement("kv", sh.Blocks, lens, k.Planes, home(buffered, 0)); err != nil {
			return nil, err
		}
		p.kv = sh
	}
	if m := l.Mamba; m != nil {
		if m.Layers > maxLayers {
			return nil, bad("mamba: %d layers, at most %d", m.Layers, maxLayers)
		}
		ce, ok1 := dtypeSize(m.ConvDType)
		se, ok2 := dtypeSize(m.SSMDType)
		if !ok1 || !ok2 {
			return nil, bad("mamba dtypes %q, %q", m.ConvDType, m.SSMDType)
		}
		var cl mambacache.ConvLayout
		switch m.ConvLayout {
		case "", "xbc":
		case "qkv":
			cl = mambacache.ConvQKV
		default:
			return nil, bad("conv layout %q, want xbc or qkv", m.ConvLayout)
		}
		switch m.ConvOrder {
		case "", "ds":
		case "sd":
			// Its plans copy each conv section once per position.
			if m.DConv > maxSDConv {
				return nil, bad("conv order sd with d_conv %d: at most %d", m.DConv, maxSDConv)
			}
		default:
			return nil, bad("conv order %q, want ds or sd", m.ConvOrder)
		}
		if m.Rows < 2 || m.Rows > 1<<24 {
			return nil, bad("%d mamba rows, want 2..%d", m.Rows, 1<<24)
		}
		if len(m.Reserved) == 0 {
			return nil, bad("no reserved mamba row: the padding row at least must be declared")
		}
		spec.Mamba = mambacache.Config{Layers: m.Layers, DState: m.DState, DConv: m.DConv, Heads: m.Heads, HeadDim: m.HeadDim,
			NGroups: m.NGroups, ConvElemSize: ce, SSMElemSize: se, ConvLayout: cl, MaxBatchSize: m.Rows - 1}
		if err := spec.Mamba.Validate(); err != nil {
			return nil, bad("mamba: %w", err)
		}
		sh, err := reshard.MambaShard(spec.Mamba, l.TP.Size)
		if err != nil {
			return nil, bad("mamba: %w", err)
		}
		if m.RowStride != 0 && (m.Planes != nil || m.RowStride != sh.RowBytes()) {
			return nil, bad("mamba row stride %d, the pool layout's is %d (rows back to back; planes take their own strides)", m.RowStride, sh.RowBytes())
		}
		lens := make([]uint64, 0, 2*sh.Layers)
		for range sh.Layers {
			lens = append(lens, uint64(sh.ConvBytes()), uint64(sh.SSMBytes()))
		}
		if p.mamAt, err = newPlacement("mamba", m.Rows, lens, m.Planes, home(buffered, 1)); err != nil {
			return nil, err
		}
		p.mamba, p.rows = sh, m.Rows
		p.reserved = slices.Clone(m.Reserved)
		slices.Sort(p.reserved)
		p.reserved = slices.Compact(p.reserved)
		for _, r := range p.reserved {
			if r < 0 || r >= m.Rows {
				return nil, bad("reserved row %d outside 0..%d", r, m.Rows-1)
			}
		}
		if len(p.reserved) == m.Rows {
			return nil, bad("every mamba row is reserved")
		}
	}
	p.wholeKV, p.wholeMamba = spec.KV, spec.Mamba
	p.fingerprint = spec.Fingerprint()
	return p, nil
}

// home is the buffer of a cache without planes: its own (b) when the
// memory is registered by pool, none when by buffers.
func home(buffered bool, b int) int {
	if buffered {
		return -1
	}
	return b
}

// kvBytes and mambaBytes are the least memory each cache needs, in the
// largest buffer it uses (its pool's, registered by pool; 0: no such
// cache).
func (p *pools) kvBytes() int64    { return p.kvAt.bytes() }
func (p *pools) mambaBytes() int64 { return p.mamAt.bytes() }

func (m placement) bytes() int64 {
	var n uint64
	for _, x := range m.need {
		n = max(n, x)
	}
	return int64(n)
}

// dtypes names the element types, which the fingerprint does not (it has
// element sizes only): peers compare them too.
func (p *pools) dtypes() string {
	var s string
	if p.l.KV != nil {
		s += "kv=" + p.l.KV.DType
		if p.l.KV.Order == "nhd" {
			s += "/nhd"
		}
	}
	if p.l.Mamba != nil {
		s += ",conv=" + p.l.Mamba.ConvDType
		if p.l.Mamba.ConvOrder == "sd" {
			s += "/sd"
		}
		s += ",ssm=" + p.l.Mamba.SSMDType
	}
	return s
}

// isReserved reports whether row r is one the engine declared reserved.
func (p *pools) isReserved(r int) bool {
	_, ok := slices.BinarySearch(p.reserved, r)
	return ok
}

// checkNames validates a request's blocks and row (-1: none). Errors wrap
// ErrBadRequest, or ErrReserved for a reserved row.
func (p *pools) checkNames(blocks []int, row int) error {
	if len(blocks) > 0 && p.kv.Layers == 0 {
		return fmt.Errorf("%w: blocks named, but no KV cache registered", ErrBadRequest)
	}
	// Duplicates: a few names are compared with each other, more marked in
	// a bit per block up to the largest named (a map cost a 512-block send
	// 18 µs).
	top := -1
	for _, b := range blocks {
		if b < 0 || b >= p.kv.Blocks {
			return fmt.Errorf("%w: block %d outside 0..%d", ErrBadRequest, b, p.kv.Blocks-1)
		}
		top = max(top, b)
	}
	var seen []uint64
	if len(blocks) > 32 {
		seen = make([]uint64, top/64+1)
	}
	for i, b := range blocks {
		dup := false
		if seen == nil {
			dup = slices.Contains(blocks[:i], b)
		} else {
			dup = seen[b/64]&(1<<(b%64)) != 0
			seen[b/64] |= 1 << (b % 64)
		}
		if dup {
			return fmt.Errorf("%w: block %d named twice", ErrBadRequest, b)
		}
	}
	switch {
	case row < -1:
		return fmt.Errorf("%w: row %d", ErrBadRequest, row)
	case row >= 0 && p.mamba.Layers == 0:
		return fmt.Errorf("%w: a row named, but no Mamba state registered", ErrBadRequest)
	case row >= p.rows:
		return fmt.Errorf("%w: row %d outside 0..%d", ErrBadRequest, row, p.rows-1)
	case row >= 0 && p.isReserved(row):
		return fmt.Errorf("%w: row %d is reserved and never travels", ErrReserved, row)
	case len(blocks) == 0 && row < 0:
		return fmt.Errorf("%w: neither blocks nor a row", ErrBadRequest)
	}
	return nil
}
