// Package reqid is the one rule for the request ids that never belong to a
// real request: the attention-DP dummy and the CUDA-graph padding
// sentinels, with TensorRT-LLM's values (ATTENTION_DP_DUMMY_REQUEST_ID and
// CUDA_GRAPH_DUMMY_REQUEST_ID, see mambacache's doc).
//
// It is a pure leaf, so that the packages that ask about these ids share it
// without importing each other: mambacache routes them to its reserved rows
// (Config.IsPaddingID, Config.IsDummyID) and transfer/session refuses to
// transfer them (session.IsDummyID).
package reqid

import "math"

// ADPDummy is the id attention-DP ranks pad an idle iteration with.
// Generated real request ids never use it, whether or not attention DP is
// on: TensorRT-LLM's ATTENTION_DP_DUMMY_REQUEST_ID ("generated real request
// ids do not use 0").
const ADPDummy uint64 = 0

// PaddingSentinel is the top of the padding sentinel range, TensorRT-LLM's
// CUDA_GRAPH_DUMMY_REQUEST_ID (2^64-1). A batch padded for a captured CUDA
// graph repeats the id PaddingSentinel-draftLen, one per draft length up to
// the model's MaxDraftTokens.
const PaddingSentinel uint64 = math.MaxUint64

// IsPadding reports whether id is a padding sentinel:
// PaddingSentinel-maxDraftTokens <= id <= PaddingSentinel. A negative
// maxDraftTokens counts as 0 (the range is then PaddingSentinel alone).
func IsPadding(id uint64, maxDraftTokens int) bool {
	return id >= PaddingSentinel-uint64(max(maxDraftTokens, 0))
}

// IsDummy reports whether id is never a real request's: ADPDummy, or a
// padding sentinel for maxDraftTokens. Such an id is never transferred:
// TensorRT-LLM's dummies never enter the transfer paths, so a peer that
// names one is refused. It does not say which row an id takes: that
// depends on whether attention DP is on (mambacache.Config.IsDummyID).
func IsDummy(id uint64, maxDraftTokens int) bool {
	return id == ADPDummy || IsPadding(id, maxDraftTokens)
}
