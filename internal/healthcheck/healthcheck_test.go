package healthcheck

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func TestGet(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/down" {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_, _ = io.WriteString(w, strings.Repeat("x", 2*maxBody))
	}))
	defer srv.Close()
	ctx := context.Background()

	resp, err := Get(ctx, srv.URL+"/up", time.Second)
	if err != nil || !resp.OK() || len(resp.Body) != maxBody {
		t.Fatalf("healthy endpoint: %+v (body %d bytes), %v; want 200 and a body cut at %d", resp.Status, len(resp.Body), err, maxBody)
	}
	resp, err = Get(ctx, srv.URL+"/down", time.Second)
	if err != nil || resp.OK() || resp.StatusCode != http.StatusServiceUnavailable || resp.Status != "503 Service Unavailable" {
		t.Fatalf("unhealthy endpoint: %q, %v; want an answered 503", resp.Status, err)
	}

	// Nothing listening: an error, not a hang, and not a URL error.
	start := time.Now()
	_, err = Get(ctx, "http://127.0.0.1:1/healthz", time.Second)
	var ue *URLError
	if err == nil || errors.As(err, &ue) || time.Since(start) > 5*time.Second {
		t.Fatalf("nothing listening: %v after %v; want a prompt client error", err, time.Since(start))
	}
	_, err = Get(ctx, "http://[::1", time.Second)
	if !errors.As(err, &ue) || err.Error() != ue.Err.Error() {
		t.Fatalf("bad URL: %v; want a *URLError with the parser's text", err)
	}
}
