//go:build integration

// Package integration runs the real prefill and decode binaries against a real
// NATS server on loopback and checks what their users would check: outputs,
// metrics, and behaviour under faults.
package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/internal/testport"
)

// binDir holds the binaries built once by TestMain.
var binDir string

func TestMain(m *testing.M) {
	if os.Getenv(natsPeerEnv) != "" || os.Getenv(goReceiverEnv) != "" {
		os.Exit(m.Run()) // a helper process (nats_rtt_test.go, goworker_test.go): no binaries needed
	}
	dir, err := os.MkdirTemp("", "handoff-integration-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	cmd := exec.Command("go", "build", "-o", dir+"/", "../cmd/prefill", "../cmd/decode")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building binaries:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// Ports. No port is picked free, closed and handed to a server: another
// test's process, or an outgoing connection's ephemeral port, could take it
// before the server binds it ("address already in use"). The workers and
// the Toxiproxy proxy listen on 127.0.0.1:0: the harness reads the address
// a worker's listener got from the "listening" line it logs
// (proc.listening), the proxy's from its Listen after Start. reservePort is
// for the rest.

// reservePort reserves a loopback port until the test ends
// (testport.Reserve).
func reservePort(t *testing.T) int { return testport.Reserve(t) }

// natsServer is a real nats-server (the same code as the nats-server binary)
// that a test can stop and start again on the same port.
type natsServer struct {
	t    *testing.T
	opts server.Options
	srv  *server.Server
}

func startNATS(t *testing.T, mutate func(*server.Options)) *natsServer {
	t.Helper()
	opts := natstest.Options(t.TempDir())
	opts.Port = reservePort(t) // fixed and reserved, so that a restart gets the same address
	if mutate != nil {
		mutate(opts)
	}
	n := &natsServer{t: t, opts: *opts}
	n.start()
	t.Cleanup(n.stop)
	return n
}

func (n *natsServer) start() {
	n.t.Helper()
	srv, err := natstest.Start(&n.opts)
	require.NoError(n.t, err, "nats-server")
	n.srv = srv
}

func (n *natsServer) stop() {
	if n.srv != nil {
		natstest.Stop(n.srv)
		n.srv = nil
	}
}

func (n *natsServer) url() string {
	return fmt.Sprintf("nats://127.0.0.1:%d", n.opts.Port)
}

// proc is one running binary.
type proc struct {
	t     *testing.T
	name  string
	cmd   *exec.Cmd
	log   procLog
	done  chan struct{}
	admin string // http://host:port of the admin server, once it listens
	api   string // http://host:port of the OpenAI API (decode only), set by waitReady
}

// procLog is a process's stdout and stderr: a file that the process writes
// itself. A line it wrote before it answered a request (a "listening" line
// before /readyz said 200) is in the file when the answer arrives, which a
// pipe copied into a buffer by the harness would not promise.
type procLog struct{ path string }

func (l procLog) String() string {
	b, _ := os.ReadFile(l.path)
	return string(b)
}

// procSeq numbers the processes of a run, for their instance ids.
var procSeq atomic.Int64

// startProc starts binary name with args; it is SIGKILLed at cleanup if
// still running. It returns once the admin server listens (or the process
// exited first: p.admin is then empty); p.api is set by waitReady. The
// process picks its own ports and logs them at info (proc.listening):
// args may not raise --log-level above info.
func startProc(t *testing.T, name string, args ...string) *proc {
	t.Helper()
	for i, a := range args {
		if lvl, ok := strings.CutPrefix(a, "--log-level="); (ok && quietLevel(lvl)) || (a == "--log-level" && i+1 < len(args) && quietLevel(args[i+1])) {
			t.Fatalf("startProc %s %v: the harness reads the listeners' addresses from info lines", name, args)
		}
	}
	f, err := os.CreateTemp(t.TempDir(), name+"-*.log")
	require.NoError(t, err)
	p := &proc{t: t, name: name, log: procLog{f.Name()}, done: make(chan struct{})}
	all := append([]string{
		"--admin-addr", "127.0.0.1:0",
		"--data-addr", "127.0.0.1:0",
		"--log-format", "json",
		"--log-level", "debug",
	}, args...)
	if name == "decode" {
		all = append(all, "--http-addr", "127.0.0.1:0")
	}
	p.cmd = exec.Command(filepath.Join(binDir, name), all...)
	p.cmd.Env = append(os.Environ(), "HANDOFF_INSTANCE_ID="+fmt.Sprintf("%s-%s-%d", name, sanitize(t.Name()), procSeq.Add(1)))
	p.cmd.Stdout, p.cmd.Stderr = f, f
	err = p.cmd.Start()
	f.Close() // the process has its own descriptor
	require.NoError(t, err)
	go func() {
		_ = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		if t.Failed() {
			p.dumpGoroutines()
		}
		p.kill()
		if t.Failed() {
			t.Logf("---- %s log (tail) ----\n%s", p.name, tail(p.log.String(), 6000))
		}
		// HANDOFF_TEST_LOGS=dir keeps every process's whole log, pass or fail.
		if dir := os.Getenv("HANDOFF_TEST_LOGS"); dir != "" {
			_ = os.WriteFile(filepath.Join(dir, sanitize(t.Name())+"-"+p.name+"-"+itoa(p.cmd.Process.Pid)+".log"), []byte(p.log.String()), 0o644)
		}
	})
	// The admin server listens first thing, before the worker builds its
	// pools or connects to NATS.
	for end := time.Now().Add(readyWithin); ; time.Sleep(5 * time.Millisecond) {
		if addr, ok := p.listening("admin"); ok {
			p.admin = "http://" + addr
			break
		}
		select {
		case <-p.done:
			return p // refused to start: the test may expect that
		default:
		}
		if time.Now().After(end) {
			t.Fatalf("%s: admin server not listening within %v\n%s", name, readyWithin, tail(p.log.String(), 4000))
		}
	}
	return p
}

func quietLevel(l string) bool {
	l = strings.ToLower(l)
	return l == "warn" || l == "warning" || l == "error"
}

// listening returns the address p's listener is bound to, from the
// "listening" line the worker logs when it opens it (the listener named
// after its flag: "http", "admin", "data"), and whether that line is
// logged yet. In standalone mode the decode worker's lines count, not the
// in-process prefill worker's.
func (p *proc) listening(listener string) (string, bool) {
	for line := range strings.Lines(p.log.String()) {
		if !strings.Contains(line, `"msg":"listening"`) {
			continue
		}
		var l struct{ Msg, Listener, Addr, Role string }
		if json.Unmarshal([]byte(line), &l) == nil && l.Msg == "listening" && l.Listener == listener && l.Role == p.name {
			return l.Addr, true
		}
	}
	return "", false
}

func sanitize(s string) string {
	return strings.NewReplacer("/", "-", " ", "-").Replace(s)
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// dumpGoroutines asks a live process for its goroutine stacks (SIGQUIT makes
// the Go runtime print them and exit), so a hang explains itself.
func (p *proc) dumpGoroutines() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-p.done:
	case <-time.After(3 * time.Second):
	}
}

func (p *proc) kill() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Kill()
	<-p.done
}

// waitReady polls /readyz until it answers 200, and then sets p.api.
func (p *proc) waitReady(d time.Duration) {
	p.t.Helper()
	require.Eventuallyf(p.t, func() bool { return p.ready() }, d, 50*time.Millisecond,
		"%s not ready within %v", p.name, d)
	if p.name == "decode" && p.api == "" {
		// Logged before readiness could pass.
		addr, ok := p.listening("http")
		require.Truef(p.t, ok, "decode ready before its API listened\n%s", tail(p.log.String(), 4000))
		p.api = "http://" + addr
	}
}

func (p *proc) ready() bool {
	select {
	case <-p.done:
		p.t.Fatalf("%s exited: %v\n%s", p.name, p.cmd.ProcessState, tail(p.log.String(), 4000))
	default:
	}
	resp, err := http.Get(p.admin + "/readyz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// metrics scrapes /metrics.
func (p *proc) metrics() map[string]*dto.MetricFamily {
	p.t.Helper()
	resp, err := http.Get(p.admin + "/metrics")
	require.NoError(p.t, err)
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	mf, err := parser.TextToMetricFamilies(resp.Body)
	require.NoError(p.t, err)
	return mf
}

// completion is one OpenAI-style completion result.
type completion struct {
	Status int
	Text   string
	Err    string
}

type completionRequest struct {
	Model       string   `json:"model,omitempty"`
	Prompt      string   `json:"prompt"`
	MaxTokens   int      `json:"max_tokens"`
	Temperature *float64 `json:"temperature,omitempty"`
	Seed        *uint64  `json:"seed,omitempty"`
}

func complete(ctx context.Context, api string, req completionRequest) (completion, error) {
	body, _ := json.Marshal(req)
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, api+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return completion{}, err
	}
	hreq.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(hreq)
	if err != nil {
		return completion{}, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return completion{}, err
	}
	var out struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
		Error *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if err := json.Unmarshal(raw, &out); err != nil {
		return completion{Status: resp.StatusCode}, fmt.Errorf("status %d, body %q: %w", resp.StatusCode, raw, err)
	}
	c := completion{Status: resp.StatusCode}
	if len(out.Choices) > 0 {
		c.Text = out.Choices[0].Text
	}
	if out.Error != nil {
		c.Err = out.Error.Message
	}
	return c, nil
}

func ptr[T any](v T) *T { return &v }

func itoa(i int) string { return strconv.Itoa(i) }
