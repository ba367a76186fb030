package service

import (
	"io"
	"log/slog"
	"net"
	"net/http"
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
	s, err := listenHTTP("127.0.0.1:0", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
