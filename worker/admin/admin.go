package admin

import (
	"encoding/json"
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

// Server holds the readiness state and serves the endpoints.
type Server struct {
	reg      prometheus.Gatherer
	draining atomic.Bool

	mu           sync.Mutex
	checks       []Check
	beforeScrape []func()
}

// New returns a server exposing reg.
func New(reg prometheus.Gatherer) *Server { return &Server{reg: reg} }

// AddCheck adds a readiness check. Checks must be cheap and must not block.
func (s *Server) AddCheck(name string, fn func() error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.checks = append(s.checks, Check{Name: name, Fn: fn})
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

// Ready reports readiness and the state of each check.
func (s *Server) Ready() (bool, map[string]string) {
	s.mu.Lock()
	checks := append([]Check(nil), s.checks...)
	s.mu.Unlock()
	ready := !s.draining.Load()
	detail := make(map[string]string, len(checks))
	for _, c := range checks {
		if err := c.Fn(); err != nil {
			ready = false
			detail[c.Name] = err.Error()
		} else {
			detail[c.Name] = "ok"
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
