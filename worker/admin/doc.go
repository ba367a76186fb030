// Package admin serves a worker's operational endpoints:
//
//	/livez    200 while the process serves HTTP
//	/readyz   200 when at least one readiness check is registered, every
//	          check passes and the worker is not draining, else 503; the
//	          body details each check in JSON ("ok", "warn: ..." for a
//	          check that passes with a Warning, or the failure)
//	/metrics  Prometheus exposition of the worker's own registry
//
// A server with no check is not ready: a worker registers a Gate first thing
// at start and opens it once it serves (its API accepts connections), so no
// moment of a start sequence reads as ready.
package admin
