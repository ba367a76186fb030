package admin

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

func get(t *testing.T, h http.Handler, path string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	b, err := io.ReadAll(rec.Body)
	require.NoError(t, err)
	return rec.Code, string(b)
}

func TestReadiness(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := New(reg)
	var natsUp atomic.Bool
	s.AddCheck("nats", func() error {
		if !natsUp.Load() {
			return errors.New("not connected")
		}
		return nil
	})
	s.AddCheck("data_path", func() error { return nil })
	h := s.Handler()

	code, body := get(t, h, "/livez")
	require.Equal(t, 200, code)
	require.Contains(t, body, "ok")

	code, body = get(t, h, "/readyz")
	require.Equal(t, 503, code)
	var r struct {
		Ready    bool              `json:"ready"`
		Draining bool              `json:"draining"`
		Checks   map[string]string `json:"checks"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &r))
	require.False(t, r.Ready)
	require.Equal(t, "not connected", r.Checks["nats"])
	require.Equal(t, "ok", r.Checks["data_path"])

	natsUp.Store(true)
	code, _ = get(t, h, "/readyz")
	require.Equal(t, 200, code)

	s.SetDraining()
	code, body = get(t, h, "/readyz")
	require.Equal(t, 503, code)
	require.NoError(t, json.Unmarshal([]byte(body), &r))
	require.True(t, r.Draining)
	code, _ = get(t, h, "/livez")
	require.Equal(t, 200, code, "a draining worker is alive")
}

func TestMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "handoff_test_total", Help: "t"})
	reg.MustRegister(c)
	s := New(reg)
	s.BeforeScrape(func() { c.Inc() })
	code, body := get(t, s.Handler(), "/metrics")
	require.Equal(t, 200, code)
	require.True(t, strings.Contains(body, "handoff_test_total 1"), body)
}

// A server with no check registered is not ready: a worker that has just
// started (its admin port open, nothing else yet) must not read as ready.
func TestNotReadyWithoutChecks(t *testing.T) {
	s := New(prometheus.NewRegistry())
	code, body := get(t, s.Handler(), "/readyz")
	require.Equal(t, 503, code, body)
	require.Contains(t, body, "no readiness check")
}

func TestGateAndWarning(t *testing.T) {
	s := New(prometheus.NewRegistry())
	g := s.AddGate("serving")
	s.AddCheck("prefill_instances", func() error { return Warn("none for %s", "2s") })
	h := s.Handler()
	code, body := get(t, h, "/readyz")
	require.Equal(t, 503, code, body)
	require.Contains(t, body, `"serving":"starting"`)
	g.Open()
	code, body = get(t, h, "/readyz")
	require.Equal(t, 200, code, body)
	require.Contains(t, body, `"prefill_instances":"warn: none for 2s"`)
}
