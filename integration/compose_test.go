//go:build compose

package integration

// The compose test runs the docker-compose.yml stack the way a user would:
// images built by scripts/images (no registry), `up -d`, completions against
// the published decode API, metrics from decode's admin port, one prefill
// container killed under load, and the stack torn down with its volumes.
//
//	go test -tags compose -count=1 -timeout 20m ./integration/
//
// It skips, saying why, when no Docker engine or compose tool is reachable.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"
)

const (
	composeUpTimeout      = 5 * time.Minute
	composeHealthyTimeout = 3 * time.Minute
	composeRequestTimeout = 90 * time.Second // longer than the workers' 30 s request timeout
	composePoolsIdleWait  = 90 * time.Second
	composePostKillWindow = 45 * time.Second // longer than the workers' 30 s request timeout
	composeModel          = "tiny-hybrid"    // docker-compose.yml's default HANDOFF_MODEL
)

// composeStack is one running docker-compose project.
type composeStack struct {
	t       *testing.T
	root    string   // repository root
	tool    []string // "docker compose" or "docker-compose"
	project string
	env     []string
	api     string // http://127.0.0.1:<port> of decode's API
	admin   string // http://127.0.0.1:<port> of decode's admin
}

// composeTool finds a compose implementation: the docker CLI plugin, else the
// standalone docker-compose.
func composeTool() ([]string, error) {
	if err := exec.Command("docker", "compose", "version").Run(); err == nil {
		return []string{"docker", "compose"}, nil
	}
	if p, err := exec.LookPath("docker-compose"); err == nil {
		if err := exec.Command(p, "version").Run(); err == nil {
			return []string{p}, nil
		}
	}
	return nil, fmt.Errorf("neither `docker compose` nor `docker-compose` works")
}

func composeRandomSuffix(t *testing.T) string {
	b := make([]byte, 4)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return hex.EncodeToString(b)
}

func composeRepoRoot(t *testing.T) string {
	_, file, _, ok := runtime.Caller(0)
	require.True(t, ok)
	return filepath.Dir(filepath.Dir(file))
}

// runCmd runs a command with the stack's environment in the repository root
// and returns its combined output.
func (s *composeStack) runCmd(ctx context.Context, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = s.root
	cmd.Env = append(os.Environ(), s.env...)
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	if err != nil {
		return out.String(), fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, out.String())
	}
	return out.String(), nil
}

func (s *composeStack) compose(ctx context.Context, args ...string) (string, error) {
	full := append(append([]string{}, s.tool[1:]...), "-p", s.project)
	full = append(full, args...)
	return s.runCmd(ctx, s.tool[0], full...)
}

func (s *composeStack) mustCompose(timeout time.Duration, args ...string) string {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	out, err := s.compose(ctx, args...)
	require.NoError(s.t, err)
	return out
}

// containers returns the container ids of a service (all services when
// service is empty), including stopped ones.
func (s *composeStack) containers(service string) []string {
	s.t.Helper()
	args := []string{"ps", "-a", "-q"}
	if service != "" {
		args = append(args, service)
	}
	out := s.mustCompose(time.Minute, args...)
	return strings.Fields(out)
}

// health returns "healthy", "unhealthy", "starting" or the container state
// when it is not running.
func (s *composeStack) health(id string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := s.runCmd(ctx, "docker", "inspect", "--format",
		"{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}", id)
	if err != nil {
		return "inspect-failed"
	}
	f := strings.Fields(out)
	if len(f) != 2 {
		return strings.TrimSpace(out)
	}
	if f[0] != "running" {
		return f[0]
	}
	return f[1]
}

// waitHealthy waits until want containers of the project exist and are all
// healthy.
func (s *composeStack) waitHealthy(want int) {
	s.t.Helper()
	deadline := time.Now().Add(composeHealthyTimeout)
	var last map[string]string
	for time.Now().Before(deadline) {
		ids := s.containers("")
		last = map[string]string{}
		healthy := 0
		for _, id := range ids {
			h := s.health(id)
			last[id] = h
			if h == "healthy" {
				healthy++
			}
		}
		if len(ids) == want && healthy == want {
			return
		}
		time.Sleep(time.Second)
	}
	s.t.Fatalf("stack not healthy after %v: %v", composeHealthyTimeout, last)
}

// published returns http://127.0.0.1:<host port> for a service's container port.
func (s *composeStack) published(service string, port int) string {
	s.t.Helper()
	out := strings.TrimSpace(s.mustCompose(time.Minute, "port", service, fmt.Sprint(port)))
	i := strings.LastIndex(out, ":")
	require.Positive(s.t, i, "compose port %s %d: %q", service, port, out)
	return "http://127.0.0.1:" + out[i+1:]
}

func (s *composeStack) metrics() map[string]*dto.MetricFamily {
	s.t.Helper()
	resp, err := http.Get(s.admin + "/metrics")
	require.NoError(s.t, err)
	defer resp.Body.Close()
	require.Equal(s.t, http.StatusOK, resp.StatusCode)
	parser := expfmt.NewTextParser(model.UTF8Validation)
	mf, err := parser.TextToMetricFamilies(resp.Body)
	require.NoError(s.t, err)
	return mf
}

// composeOutcome is how one completion request ended.
type composeOutcome struct {
	start  time.Time
	status int    // 0 when the request itself failed
	finish string // finish_reason of the first choice on success
	errMsg string // error message from the body, or the transport error
	raw    string // the start of the body, for failure messages
}

// ok reports a successful completion: 200 with a finished choice. A choice
// may hold no tokens when the model stops at once, so tokens are not counted.
func (o composeOutcome) ok() bool {
	return o.status == http.StatusOK && o.finish != "" && o.errMsg == ""
}

// clearError reports an error answer that says what went wrong: an HTTP error
// status with an OpenAI-style error body carrying a message.
func (o composeOutcome) clearError() bool {
	return o.status >= 400 && strings.TrimSpace(o.errMsg) != ""
}

func composeComplete(api, prompt string, maxTokens int) composeOutcome {
	o := composeOutcome{start: time.Now()}
	body, _ := json.Marshal(map[string]any{"model": composeModel, "prompt": prompt, "max_tokens": maxTokens})
	ctx, cancel := context.WithTimeout(context.Background(), composeRequestTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, api+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		o.errMsg = err.Error()
		return o
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		o.errMsg = err.Error()
		return o
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	o.status = resp.StatusCode
	o.raw = string(raw[:min(len(raw), 300)])
	var out struct {
		Choices []struct {
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Error *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if err := json.Unmarshal(raw, &out); err != nil {
		return o // not JSON: neither a success nor a clear error
	}
	if len(out.Choices) > 0 {
		o.finish = out.Choices[0].FinishReason
	}
	if out.Error != nil {
		o.errMsg = out.Error.Message
	}
	return o
}

// startCompose builds the images, brings the stack up and registers its
// teardown.
func startCompose(t *testing.T) *composeStack {
	t.Helper()
	if out, err := exec.Command("docker", "info").CombinedOutput(); err != nil {
		line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
		t.Skipf("no Docker engine reachable (docker info: %v: %s)", err, line)
	}
	tool, err := composeTool()
	if err != nil {
		t.Skipf("Docker engine reachable but no compose tool: %v", err)
	}
	suffix := composeRandomSuffix(t)
	s := &composeStack{
		t:       t,
		root:    composeRepoRoot(t),
		tool:    tool,
		project: "handoffct" + suffix,
	}
	tag := "ct-" + suffix
	s.env = []string{
		"HANDOFF_TAG=" + tag,
		"HANDOFF_API_PORT=0",
		"HANDOFF_DECODE_ADMIN_PORT=0",
		"HANDOFF_LOG_LEVEL=info",
		"HANDOFF_MODEL=" + composeModel,
	}

	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	out, err := s.runCmd(ctx, "./scripts/images", "--tag", tag)
	require.NoError(t, err, "scripts/images")
	t.Logf("images built:\n%s", lastLines(out, 3))

	t.Cleanup(func() {
		if t.Failed() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			logs, _ := s.compose(ctx, "logs", "--no-color", "--tail", "60")
			cancel()
			t.Logf("compose logs (tail):\n%s", logs)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if out, err := s.compose(ctx, "down", "-v", "--remove-orphans", "--timeout", "10"); err != nil {
			t.Errorf("compose down: %v\n%s", err, out)
		}
		// The :latest tags stay (they are what a user gets); the test tag goes.
		for _, n := range []string{"nats", "prefill", "decode"} {
			_, _ = s.runCmd(ctx, "docker", "image", "rm", "handoff-"+n+":"+tag)
		}
	})

	s.mustCompose(composeUpTimeout, "up", "-d")
	s.waitHealthy(4) // nats, two prefill, decode
	s.api = s.published("decode", 8000)
	s.admin = s.published("decode", 9091)
	return s
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// waitPoolsIdle waits until decode holds no KV blocks, no real Mamba rows and
// no sessions.
func (s *composeStack) waitPoolsIdle() {
	s.t.Helper()
	var kv, rows, inflight float64
	deadline := time.Now().Add(composePoolsIdleWait)
	for time.Now().Before(deadline) {
		mf := s.metrics()
		kv = sum(mf, "handoff_kv_blocks", map[string]string{"role": "decode", "state": "used"})
		rows = sum(mf, "handoff_mamba_rows", map[string]string{"role": "decode", "state": "used"})
		inflight = sum(mf, "handoff_sessions_inflight", map[string]string{"role": "decode"})
		if kv == 0 && rows == 0 && inflight == 0 {
			_, hasKV := mf["handoff_kv_blocks"]
			_, hasRows := mf["handoff_mamba_rows"]
			require.True(s.t, hasKV && hasRows, "decode exports no pool gauges")
			return
		}
		time.Sleep(500 * time.Millisecond)
	}
	s.t.Fatalf("decode pools not idle after %v: kv used %v, mamba rows used %v, sessions in flight %v",
		composePoolsIdleWait, kv, rows, inflight)
}

func TestComposeStack(t *testing.T) {
	s := startCompose(t)

	// Completions through the published API, prefill running remotely.
	for i := range 6 {
		o := composeComplete(s.api, fmt.Sprintf("compose request %d: the quick brown fox", i), 8)
		require.True(t, o.ok(), "request %d: status %d, error %q", i, o.status, o.errMsg)
	}
	mf := s.metrics()
	require.GreaterOrEqual(t, sum(mf, "handoff_requests_total", map[string]string{"role": "decode", "result": "ok"}), 6.0)
	require.GreaterOrEqual(t, sum(mf, "handoff_transfers_total", map[string]string{"role": "decode", "result": "ok"}), 6.0)
	require.Positive(t, sum(mf, "handoff_transfer_bytes_total", map[string]string{"role": "decode", "kind": "kv"}))
	require.Positive(t, sum(mf, "handoff_transfer_bytes_total", map[string]string{"role": "decode", "kind": "mamba"}))
	require.GreaterOrEqual(t, sum(mf, "handoff_transfer_duration_seconds", map[string]string{"role": "decode"}), 6.0)
	require.Equal(t, 1.0, sum(mf, "handoff_transport_info", map[string]string{"transport": "tcp"}),
		"compose runs on TCP; handoff_transport_info should say so")
	s.waitPoolsIdle()

	// Load, then one prefill container killed in the middle of it.
	prefills := s.containers("prefill")
	require.Len(t, prefills, 2)
	victim := prefills[0]

	var (
		mu       sync.Mutex
		outcomes []composeOutcome
		wg       sync.WaitGroup
	)
	stop := make(chan struct{})
	const clients = 6
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				o := composeComplete(s.api, fmt.Sprintf("client %d request %d: %s", c, i, strings.Repeat("lorem ipsum ", 20+i%40)), 16)
				mu.Lock()
				outcomes = append(outcomes, o)
				mu.Unlock()
			}
		}()
	}
	time.Sleep(3 * time.Second)
	killedAt := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	_, err := s.runCmd(ctx, "docker", "kill", victim)
	cancel()
	require.NoError(t, err)
	// Keep the load on until requests started after the kill have succeeded
	// (the surviving prefill takes the work), or past the workers' request
	// timeout, by which every request caught by the kill has ended.
	postKill := time.Now().Add(composePostKillWindow)
	for time.Now().Before(postKill) {
		mu.Lock()
		n := 0
		for _, o := range outcomes {
			if o.ok() && o.start.After(killedAt) {
				n++
			}
		}
		mu.Unlock()
		if n >= 3 && time.Since(killedAt) > 5*time.Second {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	close(stop)
	wg.Wait() // every client's last request has returned: nothing hangs

	var okBefore, okAfter, clearErrs int
	for i, o := range outcomes {
		switch {
		case o.ok():
			if o.start.After(killedAt) {
				okAfter++
			} else {
				okBefore++
			}
		case o.clearError():
			clearErrs++
		default:
			t.Errorf("request %d started %v after the load began ended with neither success nor a clear error: status %d, error %q, body %q",
				i, o.start.Sub(outcomes[0].start).Round(time.Millisecond), o.status, o.errMsg, o.raw)
		}
	}
	t.Logf("under load with one prefill killed: %d requests, %d ok before the kill, %d ok after, %d clear errors",
		len(outcomes), okBefore, okAfter, clearErrs)
	require.Positive(t, okBefore, "no request succeeded before the kill")
	require.Positive(t, okAfter, "no request succeeded after the kill: the surviving prefill should take the work")
	s.waitPoolsIdle()

	// Decode's counters account for every request it answered.
	mf = s.metrics()
	var answered float64
	for _, f := range mf["handoff_requests_total"].GetMetric() {
		answered += f.GetCounter().GetValue()
	}
	require.GreaterOrEqual(t, answered, float64(6+okBefore+okAfter+clearErrs),
		"decode counted fewer requests than it answered")

	// Bring the killed prefill back; the stack is whole and serves again.
	ctx, cancel = context.WithTimeout(context.Background(), time.Minute)
	_, err = s.runCmd(ctx, "docker", "start", victim)
	cancel()
	require.NoError(t, err)
	s.waitHealthy(4)
	for i := range 6 {
		o := composeComplete(s.api, fmt.Sprintf("after restart %d", i), 8)
		require.True(t, o.ok(), "request %d after restart: status %d, error %q", i, o.status, o.errMsg)
	}
	s.waitPoolsIdle()
}
