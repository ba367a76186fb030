package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/handoff-io/handoff/worker/config"
)

// natsOptions turns the config's NATS settings into nats.go options. The
// connection reconnects forever: a restarted server is picked up again.
func natsOptions(c config.NATS, name string, log *slog.Logger) ([]nats.Option, error) {
	opts := []nats.Option{
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.RetryOnFailedConnect(true),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil { // nil: our own Close
				log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log.Info("nats reconnected", "url", nc.ConnectedUrlRedacted())
		}),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			subj := ""
			if sub != nil {
				subj = sub.Subject
			}
			log.Warn("nats async error", "subject", subj, "err", err)
		}),
	}
	if c.Creds != "" {
		opts = append(opts, nats.UserCredentials(c.Creds))
	}
	if c.NKey != "" {
		o, err := nats.NkeyOptionFromSeed(c.NKey)
		if err != nil {
			return nil, fmt.Errorf("nats nkey: %w", err)
		}
		opts = append(opts, o)
	}
	if c.User != "" {
		opts = append(opts, nats.UserInfo(c.User, c.Password))
	}
	if c.CA != "" {
		opts = append(opts, nats.RootCAs(c.CA))
	}
	if c.Cert != "" {
		opts = append(opts, nats.ClientCert(c.Cert, c.Key))
	}
	return opts, nil
}

// connectNATS connects and waits until the connection is up or ctx ends.
// An authentication failure is final; an unreachable server is retried.
func connectNATS(ctx context.Context, c config.NATS, name string, log *slog.Logger) (*nats.Conn, error) {
	opts, err := natsOptions(c, name, log)
	if err != nil {
		return nil, err
	}
	var lastErr error
	opts = append(opts, nats.ConnectHandler(func(nc *nats.Conn) {
		log.Info("nats connected", "url", nc.ConnectedUrlRedacted())
	}))
	shown := redactURLs(c.URL)
	nc, err := nats.Connect(c.URL, opts...)
	if err != nil {
		return nil, fmt.Errorf("nats connect %s: %w", shown, err)
	}
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	logged := time.Now()
	for !nc.IsConnected() {
		if err := nc.LastError(); err != nil {
			lastErr = err
			if errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) {
				nc.Close()
				return nil, fmt.Errorf("nats connect %s: %w", shown, err)
			}
		}
		if time.Since(logged) > 5*time.Second {
			if lastErr != nil {
				log.Warn("waiting for nats", "url", shown, "status", nc.Status().String(), "err", lastErr)
			} else {
				log.Warn("waiting for nats", "url", shown, "status", nc.Status().String())
			}
			logged = time.Now()
		}
		select {
		case <-ctx.Done():
			nc.Close()
			return nil, fmt.Errorf("nats connect %s: %w (last error: %v)", shown, ctx.Err(), lastErr)
		case <-tick.C:
		}
	}
	return nc, nil
}

// redactURLs is a --nats-url list as it may be shown (logs, errors): the
// user information of each URL, a password or a token, masked.
func redactURLs(list string) string {
	urls := strings.Split(list, ",")
	for i, raw := range urls {
		raw = strings.TrimSpace(raw)
		if !strings.Contains(raw, "@") {
			continue
		}
		if !strings.Contains(raw, "://") {
			raw = "nats://" + raw // as nats.go reads it
		}
		u, err := url.Parse(raw)
		if err != nil || u.User == nil {
			urls[i] = "xxxxx" // user information it cannot tell apart: all of it
			continue
		}
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
		} else {
			u.User = url.User("xxxxx") // a token
		}
		urls[i] = u.String()
	}
	return strings.Join(urls, ",")
}

// natsCheck is the readiness check of a connection.
func natsCheck(nc *nats.Conn) func() error {
	return func() error {
		if nc.IsConnected() {
			return nil
		}
		return fmt.Errorf("nats %s", nc.Status())
	}
}

// startContext returns a context for starting what outlives ctx (a
// registry, a decoder): it ends with ctx until stop is called, and never
// after, so a SIGTERM while the worker waits for JetStream ends the start,
// while what started is closed by the drain as usual.
func startContext(ctx context.Context) (context.Context, func()) {
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	unlink := context.AfterFunc(ctx, cancel)
	return sctx, func() { unlink() }
}
