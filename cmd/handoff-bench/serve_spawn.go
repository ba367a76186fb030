package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/config"
	"github.com/handoff-io/handoff/worker/service"
)

// benchWorker is a worker running in this process.
type benchWorker struct {
	api  string // decode: the API's base URL
	done chan error
}

// benchCluster runs real workers (NATS, the data path, the pools) in this
// process, on an embedded NATS server of its own.
type benchCluster struct {
	srv     *server.Server
	dir     string
	ctx     context.Context
	stop    context.CancelFunc
	workers []*benchWorker
}

func newBenchCluster(ctx context.Context) (*benchCluster, error) {
	dir, err := os.MkdirTemp("", "handoff-bench-")
	if err != nil {
		return nil, err
	}
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true, JetStream: true, StoreDir: dir})
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("nats server: %w", err)
	}
	go srv.Start()
	c := &benchCluster{srv: srv, dir: dir}
	c.ctx, c.stop = context.WithCancel(ctx)
	if !srv.ReadyForConnections(10 * time.Second) {
		c.close()
		return nil, errors.New("nats server not ready")
	}
	return c, nil
}

// start runs a worker of role with args after the cluster's own (NATS, no
// admin listener, errors-only logs) and waits until it serves.
func (c *benchCluster) start(role worker.Role, args ...string) (*benchWorker, error) {
	args = append([]string{"--nats-url", c.srv.ClientURL(), "--admin-addr", "", "--data-addr", "127.0.0.1:0",
		"--log-level", "error"}, args...)
	cfg, err := config.Parse(role, args, func(string) string { return "" }, io.Discard)
	if err != nil {
		if strings.Contains(err.Error(), "flag provided but not defined: -prefix-cache") {
			return nil, fmt.Errorf("the %s worker does not take --prefix-cache (issue 30's worker flag has not landed in this build): %w", role, err)
		}
		return nil, fmt.Errorf("%s %v: %w", role, args, err)
	}
	w := &benchWorker{done: make(chan error, 1)}
	ready := make(chan service.Endpoints, 1)
	opts := service.Options{Logger: slog.New(slog.DiscardHandler), Registry: prometheus.NewRegistry(),
		Ready: func(ep service.Endpoints) { ready <- ep }, Stdout: io.Discard, Stderr: io.Discard}
	run := service.RunPrefill
	if role == worker.RoleDecode {
		run = service.RunDecode
	}
	go func() { w.done <- run(c.ctx, cfg, opts) }()
	c.workers = append(c.workers, w)
	select {
	case ep := <-ready:
		w.api = "http://" + ep.HTTP
		return w, nil
	case err := <-w.done:
		w.done <- err
		return nil, fmt.Errorf("%s %v: %w", role, args, err)
	case <-time.After(time.Minute):
		return nil, fmt.Errorf("%s %v not ready within a minute", role, args)
	}
}

// close stops the workers, waits for them, and stops NATS.
func (c *benchCluster) close() {
	c.stop()
	for _, w := range c.workers {
		<-w.done
	}
	c.srv.Shutdown()
	c.srv.WaitForShutdown()
	os.RemoveAll(c.dir)
}
