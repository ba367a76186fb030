// Package mambacache is the Mamba state row pool, with TensorRT-LLM's
// semantics (PythonMambaCacheManager after PR #14853).
//
// It is a pure data structure: it owns no memory, does no IO and starts no
// goroutines. Rows index an arena of Config.ArenaBytes() bytes held by the
// caller.
//
// # Rows
//
// The pool has TotalRows = MaxBatchSize*PPSize + PaddingRows + (1 if
// AttentionDP) rows. PaddingRows is 1 with speculation off; with
// speculative decoding (DraftTokens > 0) it is one row per draft length a
// step can use, TensorRT-LLM's rule (PaddingDraftLens): the distinct
// lengths a DraftLenSchedule reaches at batch sizes up to MaxBatchSize,
// plus 0 when the schedule leaves larger batches uncovered or
// AcceptanceGating can switch drafting off; DraftTokens alone without a
// schedule. At construction rows 0..TotalRows-1 go on a LIFO free stack
// and the reserved rows are popped from its top: first the padding rows in
// increasing draft-length order (TotalRows-1 first), then, with attention
// DP, the ADP dummy row. What is left, MaxBatchSize*PPSize rows, is the
// real capacity and the only capacity the scheduler sees (Capacity).
//
// After them the arena holds the prefix cache's checkpoint rows and, with
// speculation on, one scratch row per real row (ScratchRow): the
// pre-verification state a verifying worker rolls back to. Every row has
// a role (RoleOf: real, adp, padding(draft length), checkpoint, scratch),
// and only a real row is Transferable.
//
// Reserved rows are never handed to a real request and never return to the
// free stack. Ids route as follows:
//
//   - an id that already holds a row keeps it (allocation is idempotent);
//   - a padding sentinel id, 2^64-1-MaxDraftTokens .. 2^64-1, maps to the
//     padding row of its draft length 2^64-1-id (with speculation off every
//     sentinel shares the one padding row); a length without a row is
//     refused with ErrNoPaddingRow;
//   - ADPDummyID (0), with attention DP, maps to the ADP row, so an idle
//     attention-DP rank can always pad even when every real row is held by
//     requests whose cache is in transfer;
//   - any other dummy (warm-up, or id 0 without attention DP) pops a real
//     row, and fails with ErrNoFreeRows when none is left.
//
// Allocate (real requests) refuses dummy ids with ErrDummyID. Free unmaps
// the id; a real row goes back on top of the stack (LIFO reuse).
//
// # Layout
//
// The arena is row-major: row r is [r*RowBytes, (r+1)*RowBytes), one
// contiguous extent, so a transfer moves one row as one write. Within a row,
// for each layer l in order (LayerBytes each):
//
//	conv state  [ConvDim][DConv-1] of ConvElemSize bytes, ConvDim split in
//	            three sections in ConvLayout order:
//	              ConvXBC (Mamba2, Nemotron-H): x [DInner] | B [NGroups*DState] | C [NGroups*DState]
//	              ConvQKV (GDN, Qwen3-Next):    Q [NGroups*DState] | K [NGroups*DState] | V [DInner]
//	SSM state   [Heads][HeadDim][DState] of SSMElemSize bytes
//
// with DInner = Heads*HeadDim and ConvDim = DInner + 2*NGroups*DState.
// RowExtent, LayerExtent, ConvExtent (per section) and SSMExtent give the
// byte ranges. Dimensions are per rank (under attention DP the state is not
// tensor-parallel split, so they are the model's).
//
// # Use
//
//  1. Build a Config, Validate it, and New a Pool.
//  2. Allocate(id) for a real request before its state is written or
//     received; AddDummy(id) for dummies.
//  3. Free(id) when the request ends. Check Capacity/FreeRows before
//     admitting: ErrNoFreeRows is a hard error, as in TensorRT-LLM.
//  4. Never name a row that is not Transferable in a transfer.
//
// A Pool is safe for concurrent use through one mutex. Steady-state
// Allocate/AddDummy/Free do not allocate memory.
package mambacache
