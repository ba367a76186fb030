// Command handoff-nats runs the NATS server that handoff's control plane needs:
// the nats-server Go module embedded in a static binary, with JetStream on.
// It exists so that images and air-gapped sites need nothing but this
// repository: the same binary serves docker-compose, Kubernetes and local runs.
//
// Usage:
//
//	handoff-nats [serve] [flags]         run the server until SIGTERM or SIGINT
//	handoff-nats healthcheck [--url URL] probe the monitoring /healthz (exit 0 when 200)
//	handoff-nats version                 print build information
//
// Every flag has an environment twin named in --help; a flag given on the
// command line wins over its environment variable, which wins over the default.
// On SIGTERM the server shuts down cleanly (JetStream state flushed to the store
// directory); with --lame-duck-duration it first stops accepting clients and
// spreads the disconnects of existing clients over that duration, so that a
// clustered deployment rolls without a reconnect storm.
package main
