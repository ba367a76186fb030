package service

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/config"
)

// EmbeddedNATS is an in-process NATS server with JetStream on a temporary
// store, as standalone mode runs it.
type EmbeddedNATS struct {
	srv *server.Server
	dir string
}

// StartEmbeddedNATS starts a server on 127.0.0.1:port (-1: a random port),
// JetStream on, and waits until it takes connections.
func StartEmbeddedNATS(port int) (*EmbeddedNATS, error) {
	dir, err := os.MkdirTemp("", "handoff-nats-*")
	if err != nil {
		return nil, fmt.Errorf("nats store: %w", err)
	}
	srv, err := server.NewServer(&server.Options{
		ServerName: "handoff-standalone", Host: "127.0.0.1", Port: port,
		JetStream: true, StoreDir: dir, NoSigs: true, NoLog: true,
	})
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("nats server: %w", err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		_ = os.RemoveAll(dir)
		return nil, errors.New("nats server: not ready after 10s")
	}
	return &EmbeddedNATS{srv: srv, dir: dir}, nil
}

// URL is the client URL.
func (e *EmbeddedNATS) URL() string { return e.srv.ClientURL() }

// Shutdown stops the server and removes its store.
func (e *EmbeddedNATS) Shutdown() {
	e.srv.Shutdown()
	e.srv.WaitForShutdown()
	_ = os.RemoveAll(e.dir)
}

// portFree reports whether 127.0.0.1:port can be listened on now.
func portFree(port int) bool {
	ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		return false
	}
	_ = ln.Close()
	return true
}

// runStandalone runs the whole pipeline in one process: an embedded NATS
// server (the default port when free, else a random one), a prefill worker
// and a decode worker with remote prefill, which talk through that NATS
// server and the TCP data path exactly as separate processes do.
func runStandalone(ctx context.Context, cfg config.Config, o Options) error {
	log := o.Logger
	port := 4222
	if !portFree(port) {
		port = -1
	}
	ns, err := StartEmbeddedNATS(port)
	if err != nil {
		return err
	}
	defer ns.Shutdown()
	log.Info("embedded nats", "url", ns.URL())

	cfg.Standalone = false
	if cfg.Prefill != "auto" {
		cfg.Prefill = "remote"
	}
	cfg.NATS = config.NATS{URL: ns.URL()}
	if cfg.Transport == "auto" {
		cfg.Transport = "tcp" // the data path separate processes use
	}
	pcfg := cfg
	pcfg.Role = worker.RolePrefill
	pcfg.InstanceID = cfg.InstanceID + "-prefill"
	pcfg.DataAddr = "127.0.0.1:0"
	pcfg.DataAdvertise = ""

	// Both workers' gates exist before either starts: the shared /readyz
	// stays 503 until decode's API listens, not just until prefill serves.
	adm, decodeGate, admSrv, err := startAdmin(cfg, &o)
	if err != nil {
		return err
	}
	defer shutdownQuietly(admSrv, log)
	shared := o
	shared.Admin = adm

	po := shared
	po.Logger = pcfg.Logger(o.Stderr)
	po.CheckPrefix = "prefill_"
	po.Gate = adm.AddGate(po.CheckPrefix + "serving")
	prefillReady := make(chan struct{})
	po.Ready = func(Endpoints) { close(prefillReady) }
	pctx, stopPrefill := context.WithCancel(context.WithoutCancel(ctx))
	defer stopPrefill()
	prefillDone := make(chan error, 1)
	go func() { prefillDone <- RunPrefill(pctx, pcfg, po) }()
	select {
	case <-prefillReady:
	case err := <-prefillDone:
		return fmt.Errorf("standalone prefill: %w", err)
	case <-ctx.Done():
		stopPrefill()
		return <-prefillDone
	}

	do := shared
	do.Gate = decodeGate
	adminAddr := ""
	if admSrv != nil {
		adminAddr = admSrv.addr()
	}
	do.Ready = func(ep Endpoints) {
		ep.Admin = adminAddr
		printBanner(o, cfg, ep, ns.URL())
		if o.Ready != nil {
			o.Ready(ep)
		}
	}
	derr := RunDecode(ctx, cfg, do)
	// Decode has drained; the prefill worker has nothing left to serve.
	stopPrefill()
	perr := <-prefillDone
	return errors.Join(derr, perr)
}

func printBanner(o Options, cfg config.Config, ep Endpoints, natsURL string) {
	api := "http://" + dialable(ep.HTTP)
	fmt.Fprintf(o.Stdout, `handoff standalone: prefill and decode workers (model %s, dp-size %d, max-batch-size %d)
  OpenAI API   %s/v1/completions  (GET %s/v1/models)
  admin        http://%s/readyz  /metrics
  NATS         %s   data path %s
try:
  curl -s %s/v1/completions -H 'Content-Type: application/json' \
    -d '{"model":"%s","prompt":"Hello, handoff","max_tokens":16,"temperature":0}'
`, cfg.Model, cfg.DPSize, cfg.MaxBatchSize, api, api, dialable(ep.Admin), natsURL, ep.Data, api, cfg.Model)
}

// dialable turns a listener address such as [::]:8000 into 127.0.0.1:8000.
func dialable(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, port)
}
