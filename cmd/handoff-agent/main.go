// Command handoff-agent runs the agent of one engine worker written in
// another language (package agent): it serves the engine a local API on a
// unix socket, moves the engine's cache blocks and state rows over
// handoff's data path, and answers on NATS when --nats-url is set.
//
// Run "handoff-agent --help" for the flags; each has an environment twin
// (HANDOFF_AGENT_NAME, ...).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/handoff-io/handoff/agent"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/worker/admin"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stderr)
	stop()
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "handoff-agent:", err)
		os.Exit(1)
	}
}

// env returns the environment twin of a flag, or def.
func env(name, def string) string {
	if v, ok := os.LookupEnv("HANDOFF_AGENT_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))); ok {
		return v
	}
	return def
}

func run(ctx context.Context, args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("handoff-agent", flag.ContinueOnError)
	fs.SetOutput(stderr)
	name := fs.String("name", env("name", ""), "agent name, unique per engine worker (required)")
	socket := fs.String("socket", env("socket", ""), "local API socket (default $XDG_RUNTIME_DIR or the temp dir, /handoff-agent-<uid>/<name>.sock)")
	natsURL := fs.String("nats-url", env("nats-url", ""), "NATS server (with JetStream: the agent joins the namespace's registry); empty: no NATS")
	namespace := fs.String("namespace", env("namespace", "default"), "the deployment's namespace, whose registry the agent joins (the workers' --namespace)")
	replicas := fs.Int("registry-replicas", 0, "replicas of the registry bucket, as the workers' --registry-replicas (0: 3 on a cluster, falling back to 1 where it cannot place 3; else 1)")
	transports := fs.String("transports", env("transports", "shm,tcp"), "data-path transports served, comma-separated: shm, tcp, ucx, cuda-ipc")
	tcpAddr := fs.String("tcp-addr", env("tcp-addr", "127.0.0.1:0"), "tcp data-path listen address")
	advertise := fs.String("advertise", env("advertise", ""), "tcp address peers dial (default the listener's)")
	logLevel := fs.String("log-level", env("log-level", "info"), "debug, info, warn or error")
	adminAddr := fs.String("admin-addr", env("admin-addr", ""), "admin HTTP address (/livez, /readyz, /metrics), e.g. 127.0.0.1:9464; empty disables")
	if v, ok := os.LookupEnv("HANDOFF_AGENT_REGISTRY_REPLICAS"); ok {
		if err := fs.Set("registry-replicas", v); err != nil {
			return fmt.Errorf("HANDOFF_AGENT_REGISTRY_REPLICAS: %w", err)
		}
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(*logLevel)); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: lvl}))
	if *name == "" {
		return errors.New("--name is required")
	}
	if *socket == "" {
		dir := os.Getenv("XDG_RUNTIME_DIR")
		if dir == "" {
			dir = os.TempDir()
		}
		*socket = filepath.Join(dir, fmt.Sprintf("handoff-agent-%d", os.Getuid()), *name+".sock")
	}
	var ts []rdma.Transport
	for _, t := range strings.Split(*transports, ",") {
		if t = strings.TrimSpace(t); t != "" {
			ts = append(ts, rdma.Transport(t))
		}
	}
	var nc *nats.Conn
	if *natsURL != "" {
		var err error
		nc, err = nats.Connect(*natsURL, nats.Name("handoff-agent "+*name), nats.MaxReconnects(-1), nats.ReconnectWait(250*time.Millisecond),
			nats.RetryOnFailedConnect(true), nats.Timeout(5*time.Second))
		if err != nil {
			return fmt.Errorf("nats: %w", err)
		}
		defer nc.Close()
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	a, err := agent.New(agent.Config{Name: *name, Namespace: *namespace, Registry: transfer.RegistryConfig{Replicas: *replicas}, Socket: *socket, Transports: ts, TCPAddr: *tcpAddr, Advertise: *advertise, Registerer: reg, Logger: log}, nc)
	if err != nil {
		return err
	}
	if *adminAddr != "" {
		stopAdmin, err := serveAdmin(ctx, *adminAddr, reg, a, log)
		if err != nil {
			a.Close()
			return err
		}
		defer stopAdmin()
	}
	return a.Serve(ctx)
}

// serveAdmin serves the admin endpoints (worker/admin) on addr until the
// returned stop: /readyz passes while the agent serves engines (and NATS is
// up, with --nats-url), and fails from the moment ctx ends.
func serveAdmin(ctx context.Context, addr string, reg *prometheus.Registry, a *agent.Agent, log *slog.Logger) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--admin-addr: %w", err)
	}
	adm := admin.New(reg)
	adm.AddCheck("agent", a.Ready)
	draining := context.AfterFunc(ctx, adm.SetDraining)
	srv := &http.Server{Handler: adm.Handler(), ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			log.Error("admin server", "err", err)
		}
	}()
	log.Info("agent: admin listening", "addr", ln.Addr().String())
	return func() {
		draining()
		srv.Close()
		<-done
	}, nil
}
