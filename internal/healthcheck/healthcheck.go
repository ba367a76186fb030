// Package healthcheck is the probe behind every binary's "healthcheck"
// subcommand: the images have no shell and no HTTP client, so docker's
// HEALTHCHECK and compose's healthcheck run the binary itself. Each binary
// keeps its own flags, default URL and messages; the request is made here.
package healthcheck

import (
	"context"
	"io"
	"net/http"
	"time"
)

// DefaultTimeout is how long a probe waits unless told otherwise.
const DefaultTimeout = 3 * time.Second

// maxBody is how much of the answer's body a probe keeps.
const maxBody = 4096

// Response is what the probed endpoint answered.
type Response struct {
	StatusCode int
	Status     string // e.g. "503 Service Unavailable"
	Body       []byte // the first 4 KiB
}

// OK reports whether the endpoint answered 200: healthy.
func (r Response) OK() bool { return r.StatusCode == http.StatusOK }

// A URLError reports a URL no request can be made for: a configuration
// error, not an unhealthy endpoint. Its text is the underlying error's.
type URLError struct{ Err error }

func (e *URLError) Error() string { return e.Err.Error() }
func (e *URLError) Unwrap() error { return e.Err }

// Get GETs url, waiting at most timeout for the answer and its body. An
// error means there was no answer: a *URLError when url makes no request,
// else the HTTP client's error (nothing listening, a timeout). Any answer,
// 200 or not, is returned as a Response.
func Get(ctx context.Context, url string, timeout time.Duration) (Response, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return Response{}, &URLError{err}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return Response{}, err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	return Response{StatusCode: resp.StatusCode, Status: resp.Status, Body: body}, nil
}
