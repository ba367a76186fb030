// Package transfertest runs the NATS server the transfer protocol needs inside
// a test: embedded, on a random loopback port, JetStream on with a temporary
// store, no logging and no signal handlers. Other packages' tests use it too.
package transfertest

import (
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// Options returns the server options RunServer uses; dir is the JetStream
// store directory.
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

// RunServer starts an embedded server and shuts it down at the end of the test.
func RunServer(tb testing.TB) *server.Server {
	tb.Helper()
	s, err := Start(Options(tb.TempDir()))
	if err != nil {
		tb.Fatalf("nats server: %v", err)
	}
	tb.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	return s
}

// Start starts an embedded server with opts and waits until it accepts
// connections. The caller shuts it down.
func Start(opts *server.Options) (*server.Server, error) {
	s, err := server.NewServer(opts)
	if err != nil {
		return nil, err
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		return nil, errNotReady
	}
	return s, nil
}

type notReady struct{}

func (notReady) Error() string { return "transfertest: nats server not ready after 10s" }

var errNotReady error = notReady{}

// Connect opens a client connection to s, closed at the end of the test.
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
