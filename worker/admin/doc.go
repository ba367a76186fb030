// Package admin serves a worker's operational endpoints:
//
//	/livez    200 while the process serves HTTP
//	/readyz   200 when every readiness check passes and the worker is not
//	          draining, else 503; the body details each check in JSON
//	/metrics  Prometheus exposition of the worker's own registry
package admin
