package reshard

import "errors"

// Sentinel errors. Every error New, Layout.Check, KVShard and MambaShard
// return wraps exactly one of them, so callers test with errors.Is; the
// message names the offending dimension and sizes.
var (
	// ErrInvalidShape is returned for a layout that describes no cache: a
	// dimension below 1, a section without items or bytes, or a unit whose
	// size overflows int64.
	ErrInvalidShape = errors.New("reshard: invalid shape")
	// ErrInvalidTP is returned for a tensor-parallel size below 1 or above
	// MaxTP.
	ErrInvalidTP = errors.New("reshard: invalid tensor-parallel size")
	// ErrIndivisible is returned when a sharded dimension does not split
	// over a tensor-parallel size: T must divide its items, or, for a
	// dimension that may be replicated (KV heads, groups), the items must
	// divide T.
	ErrIndivisible = errors.New("reshard: dimension does not divide the tensor-parallel size")
)
