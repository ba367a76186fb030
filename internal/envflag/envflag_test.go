package envflag

import (
	"errors"
	"flag"
	"io"
	"testing"
	"time"
)

func TestApply(t *testing.T) {
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	tw := New(fs)
	port := fs.Int("port", 1, "port"+tw.Env("port", "X_PORT"))
	host := fs.String("host", "h", "host"+tw.Env("host", "X_HOST"))
	wait := fs.Duration("wait", time.Second, "wait"+tw.Env("wait", "X_WAIT"))
	if got := fs.Lookup("port").Usage; got != "port (env X_PORT)" {
		t.Fatalf("usage %q: want the twin named", got)
	}
	if err := fs.Parse([]string{"--port", "2"}); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"X_PORT": "3", "X_HOST": "env", "X_WAIT": ""}
	if err := tw.Apply(func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	if *port != 2 || *host != "env" || *wait != time.Second {
		t.Fatalf("port %d host %q wait %v: want the flag (2) over its twin, the twin (env) over the default, an empty twin ignored", *port, *host, *wait)
	}

	env = map[string]string{"X_WAIT": "soon"}
	err := tw.Apply(func(k string) string { return env[k] })
	var e *Error
	if !errors.As(err, &e) || e.Flag != "wait" || e.Env != "X_WAIT" || e.Value != "soon" || e.Unwrap() == nil {
		t.Fatalf("bad value: %v; want an *Error naming wait, X_WAIT and soon", err)
	}
	if want := `X_WAIT="soon": ` + e.Err.Error(); err.Error() != want {
		t.Fatalf("text %q, want %q", err, want)
	}
}
