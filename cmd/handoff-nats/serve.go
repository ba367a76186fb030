package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/handoff-io/handoff/internal/buildinfo"
)

// errNotReady is returned when the server did not accept connections in time.
var errNotReady = errors.New("handoff-nats: server not ready")

// readyTimeout bounds start-up: JetStream recovers its store before the
// client listener opens, which takes seconds on a large store.
const readyTimeout = 60 * time.Second

func runServe(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) error {
	cfg, err := parseServe(args, getenv, stderr)
	if err != nil {
		return err
	}
	return serve(ctx, cfg, newLogger(stderr, cfg), nil)
}

// serve runs the server until ctx is done, then shuts it down (through lame
// duck mode when configured) and waits for the shutdown to complete. ready, if
// not nil, receives the running server once it accepts connections.
func serve(ctx context.Context, cfg config, log *slog.Logger, ready func(*server.Server)) error {
	s, err := server.NewServer(cfg.serverOptions())
	if err != nil {
		return fmt.Errorf("%w: %v", errConfig, err)
	}
	fatal := make(chan string, 1)
	s.SetLoggerV2(natsLogger{l: log, fatal: fatal}, cfg.debug(), cfg.LogLevel == "trace", false)
	s.Start()
	if err := waitReady(ctx, s, fatal); err != nil {
		s.Shutdown()
		s.WaitForShutdown()
		if ctx.Err() != nil {
			// Told to stop while starting (a store to recover takes a
			// while): a stop asked for, not a failure, as for the workers.
			log.Info("handoff-nats stopped during start-up")
			return nil
		}
		return err
	}
	if cfg.JetStream && !s.JetStreamEnabled() {
		s.Shutdown()
		s.WaitForShutdown()
		return fmt.Errorf("%w: JetStream did not start (is --store-dir writable?)", errNotReady)
	}
	log.Info("handoff-nats ready", "client_url", s.ClientURL(), "monitor", monitorURL(s),
		"server_name", cfg.ServerName, "jetstream", cfg.JetStream, "store_dir", s.StoreDir(),
		"max_payload", cfg.MaxPayload, "cluster", cfg.ClusterName, "version", buildinfo.Version())
	if ready != nil {
		ready(s)
	}

	done := make(chan struct{})
	go func() {
		defer close(done)
		s.WaitForShutdown()
	}()
	select {
	case <-done:
		return errors.New("handoff-nats: server stopped on its own (see log)")
	case <-ctx.Done():
	}
	if cfg.LameDuck > 0 {
		log.Info("entering lame duck mode", "duration", cfg.LameDuck)
		s.LameDuckShutdown()
	} else {
		log.Info("shutting down")
		s.Shutdown()
	}
	<-done
	log.Info("stopped")
	return nil
}

// waitReady polls until the server accepts connections, gives up at the first
// fatal log line (a port in use, say), when ctx is done (a signal during
// start-up) or after readyTimeout.
func waitReady(ctx context.Context, s *server.Server, fatal <-chan string) error {
	deadline := time.Now().Add(readyTimeout)
	for time.Now().Before(deadline) {
		select {
		case msg := <-fatal:
			return fmt.Errorf("%w: %s", errNotReady, msg)
		case <-ctx.Done():
			return fmt.Errorf("%w: stopped during start-up: %w", errNotReady, ctx.Err())
		default:
		}
		if s.ReadyForConnections(100 * time.Millisecond) {
			return nil
		}
	}
	return fmt.Errorf("%w: no client listener after %v (check the log above, the ports and the store directory)", errNotReady, readyTimeout)
}

func monitorURL(s *server.Server) string {
	if a := s.MonitorAddr(); a != nil {
		return "http://" + a.String()
	}
	return ""
}

// newLogger builds the process logger: JSON or text on stderr.
func newLogger(w io.Writer, cfg config) *slog.Logger {
	lvl := slog.LevelInfo
	switch cfg.LogLevel {
	case "debug", "trace":
		lvl = slog.LevelDebug
	case "warn":
		lvl = slog.LevelWarn
	case "error":
		lvl = slog.LevelError
	}
	opts := &slog.HandlerOptions{Level: lvl}
	var h slog.Handler = slog.NewJSONHandler(w, opts)
	if cfg.LogFormat == "text" {
		h = slog.NewTextHandler(w, opts)
	}
	return slog.New(h).With("component", "nats")
}

// natsLogger adapts slog to nats-server's Logger, so the server's own lines
// share the process's format. Fatal lines are also offered on fatal (never
// blocking), because with this logger nats-server does not exit on them.
type natsLogger struct {
	l     *slog.Logger
	fatal chan<- string
}

func (n natsLogger) Noticef(format string, v ...any) { n.l.Info(fmt.Sprintf(format, v...)) }
func (n natsLogger) Warnf(format string, v ...any)   { n.l.Warn(fmt.Sprintf(format, v...)) }
func (n natsLogger) Fatalf(format string, v ...any) {
	msg := fmt.Sprintf(format, v...)
	n.l.Error(msg, "fatal", true)
	select {
	case n.fatal <- msg:
	default:
	}
}
func (n natsLogger) Errorf(format string, v ...any) { n.l.Error(fmt.Sprintf(format, v...)) }
func (n natsLogger) Debugf(format string, v ...any) { n.l.Debug(fmt.Sprintf(format, v...)) }
func (n natsLogger) Tracef(format string, v ...any) {
	n.l.Debug(fmt.Sprintf(format, v...), "trace", true)
}
