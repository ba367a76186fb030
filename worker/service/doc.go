// Package service wires the prefill and decode binaries: flags and
// environment (package config), the model and the ranks over registered
// data-plane regions, NATS, the transfer protocol, the scheduler loop, the
// OpenAI API (decode), the admin endpoints, and the drain on shutdown.
//
// Main is each binary's whole program; RunDecode and RunPrefill are the
// workers themselves, usable in process (standalone mode runs both, with an
// embedded NATS server, in one process, over the same NATS and TCP data-path
// code as separate processes).
//
// # Start
//
//  1. The admin endpoint comes up first, with the worker's closed readiness
//     gate: /livez answers, /readyz is 503 (standalone adds both workers'
//     gates before starting either).
//  2. The model is looked up and one hybrid cache manager per ADP rank is
//     built; in remote mode its arenas are registered data-plane regions
//     (reserved Mamba rows are forbidden at the data plane).
//  3. NATS is dialled (forever, until ctx ends; a refused authentication is
//     final), then the transfer Decoder or Prefiller announces the instance.
//  4. The scheduler loop starts; decode opens its API listener, then opens
//     its gate. /readyz turns 200 once every check passes: the gate, NATS
//     connected, the instance registered, the data path listening, for
//     decode the scheduler (failing once it drains) and, for remote
//     decode, prefill_instances (prefillPresence: 503 until a usable
//     prefill instance is seen, a passing warning for --prefill-grace after
//     the last one left, then 503).
//
// # Stop (ctx cancelled by SIGTERM or SIGINT)
//
//  1. /readyz turns 503; new requests are refused (503 at the API, a
//     capacity refusal on the prefill service).
//  2. In-flight requests finish, for up to --drain-timeout.
//  3. The loop stops, failing what is left and freeing every row and block
//     (decode: 503 unavailable, counted failed, in every phase; prefill: each
//     request aborted with closed, which its decoder retries on another
//     worker, counted cancelled); then the API server,
//     the transfer driver, NATS and the data plane close. The worker returns
//     nil: the process exits 0.
//
// A second SIGTERM or SIGINT (NotifyStop, Options.Abort) ends step 2 at
// once; the worker then returns ErrAborted and the process exits 1.
package service
