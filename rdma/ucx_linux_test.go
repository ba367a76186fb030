//go:build linux && cgo && ucx

package rdma

// ucxTestTransports adds ucx to the conformance suite in builds that have
// it. UCX picks its transports from the environment: run the suite with
// UCX_TLS=tcp, and with UCX_TLS=cma,tcp UCX_CMA_MEMORY_INVALIDATE=y for
// same-host GETs (scripts/test does both).
func ucxTestTransports() []Transport { return []Transport{TransportUCX} }
