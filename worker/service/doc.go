// Package service wires the prefill and decode binaries: flags and
// environment (package config), the model and the ranks over registered
// data-plane regions, NATS, the transfer protocol, the engine loop, the
// OpenAI API (decode), the admin endpoints, and the drain on shutdown.
//
// Main is each binary's whole program; RunDecode and RunPrefill are the
// workers themselves, usable in process (standalone mode runs both, with an
// embedded NATS server, in one process).
package service
