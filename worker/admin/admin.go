package admin

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Check is one readiness condition; Fn returns nil when it holds.
type Check struct {
	Name string
	Fn   func() error
}

// ErrNoChecks is the readiness detail of a server with no check registered
// yet: a worker still starting is not ready.
var ErrNoChecks = errors.New("admin: no readiness check registered yet")

// Warning is an error a check returns to pass while saying something is off
// (shown in the detail as "warn: ..."): readiness stays 200.
type Warning struct{ Msg string }

func (w *Warning) Error() string { return w.Msg }

// Warn returns a passing check result carrying a message.
func Warn(format string, a ...any) error { return &Warning{Msg: fmt.Sprintf(format, a...)} }

// Server holds the readiness state and serves the endpoints.
type Server struct {
	reg      prometheus.Gatherer
	draining atomic.Bool

	mu           sync.Mutex
	checks       []Check
	beforeScrape []func()
}

// New returns a server exposing reg. It is not ready until at least one
// check is registered and every check passes.
func New(reg prometheus.Gatherer) *Server { return &Server{reg: reg} }

// AddCheck adds a readiness check. Checks must be cheap and must not block.
func (s *Server) AddCheck(name string, fn func() error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.checks = append(s.checks, Check{Name: name, Fn: fn})
}

// Gate is a readiness check that fails ("starting") until Open is called.
// A worker adds its gate before anything else and opens it once it serves,
// so readiness cannot pass between two AddCheck calls of a start sequence.
type Gate struct{ open atomic.Bool }

// Open makes the gate pass. Idempotent.
func (g *Gate) Open() { g.open.Store(true) }

// AddGate adds a closed gate named name.
func (s *Server) AddGate(name string) *Gate {
	g := &Gate{}
	s.AddCheck(name, func() error {
		if g.open.Load() {
			return nil
		}
		return errors.New("starting")
	})
	return g
}

// BeforeScrape registers fn to run before each /metrics scrape (to sync
// counters kept elsewhere).
func (s *Server) BeforeScrape(fn func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.beforeScrape = append(s.beforeScrape, fn)
}

// SetDraining makes /readyz answer 503 from now on.
func (s *Server) SetDraining() { s.draining.Store(true) }

// Ready reports readiness and the state of each check: "ok", "warn: ..."
// for a check that passes with a Warning, else the failure.
func (s *Server) Ready() (bool, map[string]string) {
	s.mu.Lock()
	checks := append([]Check(nil), s.checks...)
	s.mu.Unlock()
	ready := !s.draining.Load()
	detail := make(map[string]string, len(checks))
	if len(checks) == 0 {
		ready = false
		detail["checks"] = ErrNoChecks.Error()
	}
	for _, c := range checks {
		err := c.Fn()
		var w *Warning
		switch {
		case err == nil:
			detail[c.Name] = "ok"
		case errors.As(err, &w):
			detail[c.Name] = "warn: " + w.Msg
		default:
			ready = false
			detail[c.Name] = err.Error()
		}
	}
	return ready, detail
}

// Handler returns the endpoints' handler.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /livez", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"status": "ok"})
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		ready, detail := s.Ready()
		status := http.StatusOK
		if !ready {
			status = http.StatusServiceUnavailable
		}
		writeJSON(w, status, map[string]any{"ready": ready, "draining": s.draining.Load(), "checks": detail})
	})
	metrics := promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		hooks := append([]func(){}, s.beforeScrape...)
		s.mu.Unlock()
		for _, fn := range hooks {
			fn()
		}
		metrics.ServeHTTP(w, r)
	})
	return mux
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
