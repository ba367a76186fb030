package mambacache

import "errors"

// Sentinel errors. Every error a Pool or Config returns wraps exactly one of
// them, so callers test with errors.Is.
var (
	// ErrInvalidConfig is returned by Config.Validate and New for a config
	// that cannot describe a pool.
	ErrInvalidConfig = errors.New("mambacache: invalid config")
	// ErrNoFreeRows is returned by Allocate and AddDummy when no real row is
	// free. TensorRT-LLM raises it as a hard error ("run out of mamba cache
	// blocks"): admission control must prevent it, so it is not a condition
	// to wait on.
	ErrNoFreeRows = errors.New("mambacache: run out of mamba cache blocks") // TensorRT-LLM's wording
	// ErrUnknownRequest is returned by Free for an id that holds no row.
	ErrUnknownRequest = errors.New("mambacache: unknown request")
	// ErrDummyID is returned by Allocate for a dummy id (the attention-DP
	// dummy id when attention DP is on, or a padding sentinel id): those ids
	// live on reserved rows and must go through AddDummy.
	ErrDummyID = errors.New("mambacache: dummy request id used for a real request")
	// ErrNoCheckpointRow is returned by NewCheckpoint when every checkpoint
	// row is being filled or pinned (or there are none): the checkpoint is
	// skipped, nothing waits for one.
	ErrNoCheckpointRow = errors.New("mambacache: no checkpoint row to take")
	// ErrNotCheckpoint is returned for a checkpoint operation on a row that
	// is not a checkpoint row in the state the operation needs.
	ErrNotCheckpoint = errors.New("mambacache: not a checkpoint row in that state")
	// ErrInvalidSchedule is returned by ParseDraftSchedule for a malformed
	// draft-length schedule, and wrapped by Config.Validate for one that
	// reaches a draft length above DraftTokens.
	ErrInvalidSchedule = errors.New("mambacache: invalid draft-length schedule")
	// ErrNoPaddingRow is returned by AddDummy for the padding sentinel of a
	// draft length that has no padding row (not in PaddingDraftLens): a
	// step was padded with a length the config never reaches.
	ErrNoPaddingRow = errors.New("mambacache: no padding row for that draft length")
)
