package service

import (
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A client that sends its headers and then stalls inside the body is cut
// off after readTimeout instead of holding a handler forever.
func TestHTTPStalledBodyTimesOut(t *testing.T) {
	defer func(d time.Duration) { readTimeout = d }(readTimeout)
	readTimeout = 200 * time.Millisecond
	read := make(chan error, 1)
	s, err := listenHTTP("http", "127.0.0.1:0", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, err := io.ReadAll(r.Body)
		read <- err
	}), slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	defer func() { require.NoError(t, s.shutdown(t.Context())) }()

	c, err := net.Dial("tcp", s.addr())
	require.NoError(t, err)
	defer c.Close()
	_, err = io.WriteString(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
	require.NoError(t, err)
	select {
	case err := <-read:
		require.Error(t, err, "the body read must fail, not wait for the rest")
	case <-time.After(10 * time.Second):
		t.Fatal("handler still reading a stalled body")
	}
}

// The read bound does not cut a response that lasts longer (an SSE stream):
// once the body is read the request's context stays alive.
func TestHTTPLongResponseOutlivesReadTimeout(t *testing.T) {
	defer func(d time.Duration) { readTimeout = d }(readTimeout)
	readTimeout = 200 * time.Millisecond
	s, err := listenHTTP("http", "127.0.0.1:0", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.ReadAll(r.Body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		rc := http.NewResponseController(w)
		for range 6 {
			select {
			case <-r.Context().Done():
				return
			case <-time.After(100 * time.Millisecond):
			}
			_, _ = io.WriteString(w, "data: x\n\n")
			_ = rc.Flush()
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}), slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	defer func() { require.NoError(t, s.shutdown(t.Context())) }()
	resp, err := http.Post("http://"+s.addr()+"/", "application/json", strings.NewReader("{}"))
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Contains(t, string(body), "[DONE]")
}
