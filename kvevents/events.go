package kvevents

import (
	"errors"
)

// Hash is a prefix name (package prefix).
type Hash = [32]byte

// Medium is where the worker holds what an event names.
const (
	MediumGPU = "GPU"
	MediumCPU = "CPU"
)

// Spec kinds and group indexes: attention KV blocks are group 0, the
// recurrent state group 1.
const (
	KindAttention = "full_attention"
	KindMamba     = "mamba"
	GroupKV       = 0
	GroupState    = 1
)

// ErrBadBatch is returned for a batch that cannot be decoded or breaks the
// format's bounds.
var ErrBadBatch = errors.New("kvevents: malformed batch")

// Limits of one batch, enforced by Decode: a router's memory is bounded by
// what it accepts.
const (
	MaxEvents       = 1 << 16
	MaxHashes       = 1 << 16
	MaxTokens       = 1 << 16
	maxStringLength = 256
)

// EventKind says what an Event is.
type EventKind uint8

const (
	BlockStored EventKind = iota + 1
	BlockRemoved
	AllBlocksCleared
	StateStored
	StateRemoved
)

var kindNames = [...]string{BlockStored: "BlockStored", BlockRemoved: "BlockRemoved",
	AllBlocksCleared: "AllBlocksCleared", StateStored: "StateStored", StateRemoved: "StateRemoved"}

func (k EventKind) String() string {
	if int(k) < len(kindNames) && kindNames[k] != "" {
		return kindNames[k]
	}
	return "unknown"
}

// Event is one event of a batch. Which fields mean something depends on
// Kind:
//   - BlockStored: Hashes (one per block, each continuing the one before),
//     Parent (HasParent: false for a chain's first block), Tokens (the
//     blocks' tokens, BlockSize each), BlockSize, Medium.
//   - BlockRemoved: Hashes, Medium.
//   - AllBlocksCleared: nothing.
//   - StateStored, StateRemoved: PrefixHash, Parent (always set: the root
//     for a state inside the first block), Tokens (those after the parent's
//     full blocks), NumTokens, Medium.
type Event struct {
	Kind       EventKind
	Hashes     []Hash
	Parent     Hash
	HasParent  bool
	Tokens     []int32
	BlockSize  int
	PrefixHash Hash
	NumTokens  int
	Medium     string
}

// Batch is what an instance publishes at once.
type Batch struct {
	// TS is the time of the batch in seconds since the Unix epoch.
	TS float64
	// Events are applied in order.
	Events []Event
	// Rank is the data-parallel rank whose cache the events describe:
	// each rank has a cache of its own.
	Rank int
	// Seq numbers the batches of the instance's rank, one more each batch
	// (never 0): each rank is a stream of its own.
	Seq uint64
	// Instance is the publishing instance (the registry's id).
	Instance string
	// Root is the root of the rank's chain (prefix.Salt of its layout).
	Root Hash
	// Snapshot: the batch is everything the rank holds as of Seq, in place
	// of all that came before (it is no batch of the stream: the next one
	// is Seq+1).
	Snapshot bool
}
