package kvcache

import "errors"

// Sentinel errors. Every error a Pool or Config returns wraps exactly one of
// them, so callers test with errors.Is.
var (
	// ErrInvalidConfig is returned by Config.Validate and New for a config
	// that cannot describe a pool (a zero or negative dimension, a block
	// size that is not a power of two, both or neither of Blocks and
	// ByteBudget, sizes that overflow).
	ErrInvalidConfig = errors.New("kvcache: invalid config")
	// ErrNoFreeBlocks is returned by Allocate, Grow and AllocateDummy (and
	// their WithHeadroom forms) when the pool has fewer free blocks than the
	// call needs. The pool is left unchanged. Admission control is the
	// caller's job; this is not a condition to retry in a loop.
	ErrNoFreeBlocks = errors.New("kvcache: no free blocks")
	// ErrUnknownRequest is returned by Grow, Free, Runs, Blocks and Tokens
	// for an id that holds no blocks.
	ErrUnknownRequest = errors.New("kvcache: unknown request")
	// ErrAlreadyExists is returned by Allocate for an id that already holds
	// blocks, and by AllocateDummy for an id held by a real request.
	ErrAlreadyExists = errors.New("kvcache: request already allocated")
	// ErrInvalidTokens is returned by Allocate and Grow for a token count
	// below 1, and by the WithHeadroom forms for a negative headroom.
	ErrInvalidTokens = errors.New("kvcache: invalid token count")
)
