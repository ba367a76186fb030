package mambacache

// API CONTRACT (to be implemented; signatures are fixed, bodies are not).

import "errors"

var (
	ErrInvalidConfig  = errors.New("mambacache: invalid config")
	ErrNoFreeRows     = errors.New("mambacache: run out of mamba cache blocks") // TensorRT-LLM's wording
	ErrUnknownRequest = errors.New("mambacache: unknown request")
	ErrDummyID        = errors.New("mambacache: dummy request id used for a real request")
)

// ADPDummyID is the request id attention-DP ranks pad with. It maps to the reserved ADP row.
const ADPDummyID uint64 = 0

// Row names one state row: 0 .. TotalRows-1.
type Row uint32

// Section of a conv state row.
type Section uint8

const (
	SectionX Section = iota // x (Mamba2) / Q (GDN, see ConvLayout)
	SectionB
	SectionC
)

type ConvLayout uint8

const (
	ConvXBC ConvLayout = iota // Nemotron-H: [x | B | C] = [d_inner, ng*ds, ng*ds]
	ConvQKV                   // Qwen3-Next: [Q | K | V] = [ng*ds, ng*ds, d_inner]
)

type Extent struct {
	Offset int64
	Length int64
}

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
}

// Layout (row-major, documented in doc.go): row r occupies [r*RowBytes, (r+1)*RowBytes);
// within a row, per layer l: conv state [conv_dim][d_conv-1] (sections in ConvLayout order),
// then SSM state [heads][head_dim][d_state].

func (c Config) Validate() error                               { panic("unimplemented") }
func (c Config) TotalRows() int                                { panic("unimplemented") }
func (c Config) RealRows() int                                 { panic("unimplemented") }
func (c Config) ConvDim() int                                  { panic("unimplemented") }
func (c Config) RowBytes() int64                               { panic("unimplemented") }
func (c Config) ArenaBytes() int64                             { panic("unimplemented") }
func (c Config) RowExtent(r Row) Extent                        { panic("unimplemented") }
func (c Config) ConvExtent(r Row, layer int, s Section) Extent { panic("unimplemented") }
func (c Config) SSMExtent(r Row, layer int) Extent             { panic("unimplemented") }
func (c Config) IsPaddingID(id uint64) bool                    { panic("unimplemented") }
func (c Config) IsDummyID(id uint64) bool                      { panic("unimplemented") } // ADP id (when ADP on) or padding range

// Pool is the state row pool. It owns no memory. Safe for concurrent use.
type Pool struct{}

func New(cfg Config) (*Pool, error)             { panic("unimplemented") }
func (p *Pool) Config() Config                  { panic("unimplemented") }
func (p *Pool) Allocate(id uint64) (Row, error) { panic("unimplemented") } // real request; idempotent; ErrDummyID for dummy ids
func (p *Pool) AddDummy(id uint64) (Row, error) { panic("unimplemented") } // routes 0/padding ids to reserved rows, others take a real row
func (p *Pool) Free(id uint64) error            { panic("unimplemented") }
func (p *Pool) Row(id uint64) (Row, bool)       { panic("unimplemented") }
func (p *Pool) IsReserved(r Row) bool           { panic("unimplemented") }
func (p *Pool) Capacity() int                   { panic("unimplemented") } // real rows only
func (p *Pool) FreeRows() int                   { panic("unimplemented") } // real rows on the free stack
func (p *Pool) UsedRows() int                   { panic("unimplemented") } // real rows held
func (p *Pool) ReservedRows() int               { panic("unimplemented") }
