package kvcache

// API CONTRACT (to be implemented; signatures are fixed, bodies are not).

import "errors"

// Sentinel errors.
var (
	ErrInvalidConfig  = errors.New("kvcache: invalid config")
	ErrNoFreeBlocks   = errors.New("kvcache: no free blocks")
	ErrUnknownRequest = errors.New("kvcache: unknown request")
	ErrAlreadyExists  = errors.New("kvcache: request already allocated")
)

// BlockID names one block of the pool: 0 .. Blocks-1.
type BlockID uint32

// Run is Len contiguous blocks starting at Start.
type Run struct {
	Start BlockID
	Len   uint32
}

// KV selects the key or value half of a (block, layer).
type KV uint8

const (
	K KV = 0
	V KV = 1
)

// Extent is a byte range of the pool's arena.
type Extent struct {
	Offset int64
	Length int64
}

// Config describes the pool. Exactly one of Blocks or ByteBudget is set.
type Config struct {
	Layers         int   // attention layers
	KVHeads        int   // kv heads per layer
	HeadDim        int   // elements per head
	ElemSize       int   // bytes per element (2 for bf16, 4 for fp32)
	TokensPerBlock int   // power of two > 1
	Blocks         int   // number of blocks
	ByteBudget     int64 // alternative to Blocks: Blocks = ByteBudget / BlockBytes
}

// Layout (block-major, documented in doc.go):
//   block b occupies [b*BlockBytes, (b+1)*BlockBytes)
//   within a block: for layer l, for kv in {K,V}: [TokensPerBlock][KVHeads][HeadDim] elements.
// So a Run of n blocks is one contiguous extent of n*BlockBytes bytes.

func (c Config) Validate() error                             { panic("unimplemented") }
func (c Config) BlockBytes() int64                           { panic("unimplemented") }
func (c Config) ArenaBytes() int64                           { panic("unimplemented") }
func (c Config) BlocksFor(tokens int) int                    { panic("unimplemented") }
func (c Config) RunExtent(r Run) Extent                      { panic("unimplemented") }
func (c Config) KVExtent(b BlockID, layer int, kv KV) Extent { panic("unimplemented") }
func (c Config) TokenOffset(b BlockID, layer int, kv KV, slot, head int) int64 {
	panic("unimplemented")
}

// Pool is a paged block allocator. It owns no memory: it maps blocks to offsets
// of an arena of Config.ArenaBytes() bytes held by the caller. Safe for concurrent use.
type Pool struct{}

func New(cfg Config) (*Pool, error)                                { panic("unimplemented") }
func (p *Pool) Config() Config                                     { panic("unimplemented") }
func (p *Pool) Allocate(id uint64, tokens int) error               { panic("unimplemented") }
func (p *Pool) Grow(id uint64, tokens int) error                   { panic("unimplemented") } // ensure room for `tokens` total tokens
func (p *Pool) AllocateDummy(id uint64) error                      { panic("unimplemented") } // one block
func (p *Pool) Free(id uint64) error                               { panic("unimplemented") }
func (p *Pool) Runs(id uint64, dst []Run) ([]Run, error)           { panic("unimplemented") } // appends to dst
func (p *Pool) Blocks(id uint64, dst []BlockID) ([]BlockID, error) { panic("unimplemented") } // appends to dst
func (p *Pool) Tokens(id uint64) (int, error)                      { panic("unimplemented") }
func (p *Pool) FreeBlocks() int                                    { panic("unimplemented") }
func (p *Pool) UsedBlocks() int                                    { panic("unimplemented") }
func (p *Pool) TotalBlocks() int                                   { panic("unimplemented") }
