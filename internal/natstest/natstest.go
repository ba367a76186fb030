// Package natstest runs the NATS server of a test inside the test binary: the
// real nats-server code, on loopback, JetStream on with its store in a
// temporary directory, no logging and no signal handlers. The tests of this
// module start their NATS servers through it, except where the server is
// itself under test (--standalone's, handoff-nats's).
//
// Run suits most tests: a server on a random port, shut down when the test
// ends. Options and Start are for the rest: a server on a port chosen before
// it starts, or one a test stops and starts again on the same port.
package natstest

import (
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// readyTimeout bounds how long Start waits for a server to accept
// connections; a loaded CI machine under -race can take seconds.
const readyTimeout = 10 * time.Second

// ErrNotReady is returned by Start when the server does not accept
// connections within 10 seconds.
var ErrNotReady = errors.New("natstest: nats server not ready after 10s")

// Options returns the options of a test server: 127.0.0.1, a random port
// (-1), JetStream on with its store in dir, no logging, no signal handlers.
func Options(dir string) *server.Options {
	return &server.Options{
		Host:      "127.0.0.1",
		Port:      -1,
		NoLog:     true,
		NoSigs:    true,
		JetStream: true,
		StoreDir:  dir,
	}
}

// Start starts a server with a copy of opts and waits until it accepts
// connections; the copy leaves opts as given, so the same opts start a
// server again after Stop (a restart on the same port needs a fixed Port).
// The caller stops it (Stop). Errors: the options' own, or ErrNotReady.
func Start(opts *server.Options) (*server.Server, error) {
	o := *opts
	s, err := server.NewServer(&o)
	if err != nil {
		return nil, err
	}
	go s.Start()
	if !s.ReadyForConnections(readyTimeout) {
		Stop(s)
		return nil, ErrNotReady
	}
	return s, nil
}

// Run starts a server with Options(tb.TempDir()), changed by each of mutate
// in turn (credentials, a fixed port), and stops it when the test ends.
func Run(tb testing.TB, mutate ...func(*server.Options)) *server.Server {
	tb.Helper()
	opts := Options(tb.TempDir())
	for _, m := range mutate {
		m(opts)
	}
	s, err := Start(opts)
	if err != nil {
		tb.Fatalf("nats server: %v", err)
	}
	tb.Cleanup(func() { Stop(s) })
	return s
}

// Stop shuts s down and waits until it has. Stopping a stopped server does
// nothing.
func Stop(s *server.Server) {
	s.Shutdown()
	s.WaitForShutdown()
}

// Connect opens a client connection to s, closed when the test ends.
func Connect(tb testing.TB, s *server.Server, opts ...nats.Option) *nats.Conn {
	tb.Helper()
	nc, err := nats.Connect(s.ClientURL(), opts...)
	if err != nil {
		tb.Fatalf("nats connect: %v", err)
	}
	tb.Cleanup(nc.Close)
	return nc
}

// CheckFor polls fn every sleep until it returns nil or total elapses, then
// fails the test with fn's last error. Use it instead of sleeping.
func CheckFor(tb testing.TB, total, sleep time.Duration, fn func() error) {
	tb.Helper()
	deadline := time.Now().Add(total)
	var err error
	for {
		if err = fn(); err == nil {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("condition not met after %v: %v", total, err)
		}
		time.Sleep(sleep)
	}
}
