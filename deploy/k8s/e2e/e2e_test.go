//go:build k8s

package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/handoff-io/handoff/transfer/wire"
)

// ns is the test's namespace; nothing else of the cluster is touched.
const ns = "handoff-e2e"

// TestKubernetes applies deploy/k8s to a real control plane, runs NATS,
// prefill and decode as pods on a real kubelet, and serves completions
// through the decode Service while a prefill pod is deleted, prefill is scaled
// out and decode is rolled.
func TestKubernetes(t *testing.T) {
	tag := os.Getenv(envTag)
	if tag == "" {
		t.Skipf("%s is not set: run scripts/k8s-e2e, which builds the images", envTag)
	}
	ctx := context.Background()
	if dl, ok := t.Deadline(); ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, dl.Add(-30*time.Second))
		defer cancel()
	}
	// An image whose binary cannot start fails here, by name, rather than as
	// a crash-looping pod behind a rollout timeout.
	for _, img := range []string{"handoff-nats", "handoff-prefill", "handoff-decode"} {
		out, err := exec.CommandContext(ctx, "docker", "run", "--rm", "--network=none", img+":"+tag, "version").CombinedOutput()
		if err != nil {
			t.Fatalf("image %s:%s does not run (a FROM scratch image needs a static binary): %v: %s", img, tag, err, bytes.TrimSpace(out))
		}
	}
	// A failed load's verdict is logged again as the test's last lines,
	// after the cluster's logs that a failure dumps: a CI log's tail then
	// holds it. Cleanups run last first, so this runs after the teardown.
	var verdicts []string
	t.Cleanup(func() {
		for _, v := range verdicts {
			t.Log("failed: " + v)
		}
	})
	c := startCluster(ctx, t)
	loadFailed := func(t *testing.T, what string, r loadResult) {
		t.Helper()
		v := fmt.Sprintf("%s: %s\n%s", what, r, c.warnings(ctx, "decode"))
		verdicts = append(verdicts, v)
		t.Fatal(v)
	}

	timed(t, "images imported into containerd", func() error {
		return c.importImages("handoff-nats:"+tag, "handoff-prefill:"+tag, "handoff-decode:"+tag)
	})
	manifests := c.path("manifests")
	timed(t, "CRDs LeaderWorkerSet, PodMonitor", func() error {
		if err := copyManifests(manifests); err != nil {
			return err
		}
		if _, err := c.kubectl(ctx, "apply", "--server-side", "--field-manager=handoff-e2e", "-f", "../cluster/crds"); err != nil {
			return err
		}
		_, err := c.kubectl(ctx, "wait", "--for=condition=Established", "--timeout=2m",
			"crd/leaderworkersets.leaderworkerset.x-k8s.io", "crd/podmonitors.monitoring.coreos.com")
		return err
	})
	timed(t, "namespace, NATS volumes", func() error { return c.prepareNamespace(ctx) })

	// Every kustomization is accepted by the API server (schemas, CRDs,
	// admission) before anything runs.
	for _, dir := range []string{"base", "overlays/gpu", "overlays/lws", "overlays/podmonitor"} {
		timed(t, "server-side dry run "+dir, func() error {
			out, err := c.kubectl(ctx, "apply", "--server-side", "--dry-run=server", "--field-manager=handoff-e2e",
				"-n", ns, "-k", filepath.Join(manifests, dir))
			if err == nil {
				t.Logf("%s: %d objects accepted", dir, strings.Count(out, "serverside-applied"))
			}
			return err
		})
	}

	// The run: base + PodMonitor, sized for one small node, images tagged.
	if err := writeE2EOverlay(filepath.Join(manifests, "e2e"), tag); err != nil {
		t.Fatal(err)
	}
	timed(t, "server-side apply e2e (podmonitor overlay)", func() error {
		out, err := c.kubectl(ctx, "apply", "--server-side", "--field-manager=handoff-e2e", "-k", filepath.Join(manifests, "e2e"))
		t.Logf("applied:\n%s", strings.TrimSpace(out))
		return err
	})
	for _, w := range []string{"statefulset/nats", "deployment/prefill", "deployment/decode"} {
		timed(t, "rollout "+w, func() error { return c.rollout(ctx, w) })
	}
	t.Logf("pods:\n%s", c.mustKubectl(ctx, t, "-n", ns, "get", "pods", "-o", "wide"))
	if _, err := c.kubectl(ctx, "-n", ns, "get", "podmonitor", "handoff"); err != nil {
		t.Fatalf("the PodMonitor was not created: %v", err)
	}

	api := "http://" + net.JoinHostPort(c.clusterIP(ctx, t, "decode"), "8000")
	natsURL := "nats://" + net.JoinHostPort(c.clusterIP(ctx, t, "nats"), "4222")
	reg := openRegistry(ctx, t, natsURL)

	t.Run("completions through the decode Service", func(t *testing.T) {
		var first string
		for i := range 3 {
			start := time.Now()
			text, err := complete(ctx, api, "Hello, handoff", 16)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("completion %d via %s in %v: %q", i, api, time.Since(start).Round(time.Millisecond), text)
			if i == 0 {
				first = text
			} else if text != first {
				t.Fatalf("temperature 0 gave %q, then %q", first, text)
			}
		}
	})

	t.Run("registry holds the pods", func(t *testing.T) {
		waitRegistry(ctx, t, reg, c, "prefill", 2)
		waitRegistry(ctx, t, reg, c, "decode", 1)
	})

	t.Run("prefill pod deleted mid-load", func(t *testing.T) {
		pods := c.pods(ctx, t, "prefill")
		victim := pods[0]
		l := startLoad(ctx, api, 4)
		time.Sleep(3 * time.Second)
		start := time.Now()
		c.mustKubectl(ctx, t, "-n", ns, "delete", "pod", victim, "--wait=false")
		t.Logf("deleted %s with %d requests done", victim, l.ok.Load())
		now := waitRegistryExcept(ctx, t, reg, c, "prefill", 2, victim)
		t.Logf("replacement registered after %v: prefill pods %v", time.Since(start).Round(time.Second), now)
		time.Sleep(3 * time.Second)
		r := l.stop()
		t.Logf("load during the deletion: %s", r)
		if r.failed > 0 || r.ok == 0 {
			loadFailed(t, "requests failed while a prefill pod was deleted", r)
		}
	})

	t.Run("prefill scaled from 2 to 4", func(t *testing.T) {
		start := time.Now()
		c.mustKubectl(ctx, t, "-n", ns, "scale", "deployment/prefill", "--replicas=4")
		if err := c.rollout(ctx, "deployment/prefill"); err != nil {
			t.Fatal(err)
		}
		t.Logf("4 prefill pods ready after %v", time.Since(start).Round(time.Second))
		got := waitRegistry(ctx, t, reg, c, "prefill", 4)
		t.Logf("4 prefill instances registered after %v: %v", time.Since(start).Round(time.Second), got)
		if _, err := complete(ctx, api, "after the scale-up", 8); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("decode rolling update drains", func(t *testing.T) {
		before := c.pods(ctx, t, "decode")
		l := startLoad(ctx, api, 4)
		time.Sleep(3 * time.Second)
		start := time.Now()
		c.mustKubectl(ctx, t, "-n", ns, "rollout", "restart", "deployment/decode")
		if err := c.rollout(ctx, "deployment/decode"); err != nil {
			t.Fatal(err)
		}
		// The old pod drains (terminationGracePeriodSeconds 45) after the
		// rollout reports the new one available.
		if err := waitFor(ctx, "old decode pod gone", 2*time.Minute, nil, func() error {
			now := c.pods(ctx, t, "decode")
			for _, p := range before {
				if slices.Contains(now, p) {
					return fmt.Errorf("%s still present", p)
				}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		after := c.pods(ctx, t, "decode")
		t.Logf("decode %v replaced by %v in %v", before, after, time.Since(start).Round(time.Second))
		time.Sleep(3 * time.Second)
		r := l.stop()
		t.Logf("load during the rolling update: %s", r)
		if r.failed > 0 || r.ok == 0 {
			loadFailed(t, "requests failed during the rolling update", r)
		}
		waitRegistry(ctx, t, reg, c, "decode", 1)
	})
}

// timed runs one step and logs how long it took.
func timed(t *testing.T, what string, f func() error) {
	t.Helper()
	start := time.Now()
	if err := f(); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	t.Logf("%-48s %6.1fs", what, time.Since(start).Seconds())
}

// copyManifests copies deploy/k8s's base and overlays beside the test's own
// overlay: kustomize loads bases by relative path only.
func copyManifests(dst string) error {
	for _, dir := range []string{"base", "overlays"} {
		src := filepath.Join("..", dir)
		err := filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			rel, err := filepath.Rel("..", path)
			if err != nil {
				return err
			}
			if d.IsDir() {
				return os.MkdirAll(filepath.Join(dst, rel), 0o755)
			}
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(dst, rel), b, 0o644)
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// writeE2EOverlay writes the run's kustomization: the podmonitor overlay (the
// base and a PodMonitor) in the test's namespace with the images built for
// this run and CPU requests that fit one small node (the base asks one core
// per worker).
func writeE2EOverlay(dir, tag string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	k := fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: %[1]s
resources:
  - ../overlays/podmonitor
images:
  - {name: handoff-nats, newTag: %[2]q}
  - {name: handoff-prefill, newTag: %[2]q}
  - {name: handoff-decode, newTag: %[2]q}
patches:
  - target: {kind: Deployment}
    patch: |-
      - op: replace
        path: /spec/template/spec/containers/0/resources/requests/cpu
        value: 100m
  - target: {kind: StatefulSet, name: nats}
    patch: |-
      - op: replace
        path: /spec/template/spec/containers/0/resources/requests/cpu
        value: 50m
`, ns, tag)
	return os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k), 0o644)
}

// prepareNamespace creates the namespace and a hostPath PersistentVolume for
// each NATS server's claim (the cluster has no dynamic provisioner).
func (c *cluster) prepareNamespace(ctx context.Context) error {
	if _, err := c.kubectl(ctx, "create", "namespace", ns); err != nil {
		return err
	}
	var pvs bytes.Buffer
	for i := range 3 {
		dir := c.path("volumes", fmt.Sprintf("nats-%d", i))
		if err := os.MkdirAll(dir, 0o777); err != nil {
			return err
		}
		if err := os.Chmod(dir, 0o777); err != nil { // the servers run as 65532
			return err
		}
		fmt.Fprintf(&pvs, `---
apiVersion: v1
kind: PersistentVolume
metadata: {name: %[1]s-data-nats-%[2]d}
spec:
  capacity: {storage: 10Gi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Delete
  hostPath: {path: %[3]s, type: Directory}
  claimRef: {namespace: %[1]s, name: data-nats-%[2]d}
`, ns, i, dir)
	}
	_, err := c.kubectlIn(ctx, &pvs, "apply", "--server-side", "--field-manager=handoff-e2e", "-f", "-")
	return err
}

func (c *cluster) rollout(ctx context.Context, what string) error {
	_, err := c.kubectl(ctx, "-n", ns, "rollout", "status", what, "--timeout=8m")
	if err != nil {
		out, _ := c.kubectl(ctx, "-n", ns, "get", "pods,events", "-o", "wide")
		return fmt.Errorf("%w\n%s", err, out)
	}
	return nil
}

func (c *cluster) mustKubectl(ctx context.Context, t *testing.T, args ...string) string {
	t.Helper()
	out, err := c.kubectl(ctx, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// warnings returns the last warnings and errors the pods of a component
// logged (JSON lines, HANDOFF_LOG_FORMAT=json), prefixed by pod: why a
// request failed, in the server's words.
func (c *cluster) warnings(ctx context.Context, component string) string {
	out, err := c.kubectl(ctx, "-n", ns, "logs", "-l", "app.kubernetes.io/component="+component, "--prefix", "--tail=5000", "--max-log-requests=8")
	if err != nil {
		return err.Error()
	}
	var lines []string
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, `"level":"WARN"`) || strings.Contains(line, `"level":"ERROR"`) {
			lines = append(lines, line)
		}
	}
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return fmt.Sprintf("%s pods' last warnings and errors (%d):\n%s", component, len(lines), strings.Join(lines, "\n"))
}

func (c *cluster) clusterIP(ctx context.Context, t *testing.T, svc string) string {
	t.Helper()
	ip := strings.TrimSpace(c.mustKubectl(ctx, t, "-n", ns, "get", "service", svc, "-o", "jsonpath={.spec.clusterIP}"))
	if net.ParseIP(ip) == nil {
		t.Fatalf("service %s has no cluster IP: %q", svc, ip)
	}
	return ip
}

// pods lists the names of a component's pods that are not being deleted.
func (c *cluster) pods(ctx context.Context, t *testing.T, component string) []string {
	t.Helper()
	out := c.mustKubectl(ctx, t, "-n", ns, "get", "pods", "-l", "app.kubernetes.io/component="+component,
		"-o", `jsonpath={range .items[*]}{.metadata.name} {.metadata.deletionTimestamp}{"\n"}{end}`)
	var names []string
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 1 {
			names = append(names, f[0])
		}
	}
	slices.Sort(names)
	return names
}

// openRegistry opens the workers' instance registry (a JetStream KV bucket)
// through the nats Service.
func openRegistry(ctx context.Context, t *testing.T, url string) jetstream.KeyValue {
	t.Helper()
	nc, err := nats.Connect(url, nats.Timeout(10*time.Second))
	if err != nil {
		t.Fatalf("NATS through its Service at %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	bucket := wire.BucketName(wire.DefaultPrefix, "default")
	var kv jetstream.KeyValue
	if err := waitFor(ctx, "registry bucket "+bucket, 2*time.Minute, nil, func() error {
		kv, err = js.KeyValue(ctx, bucket)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return kv
}

// registered lists the instance ids of a role in the registry.
func registered(ctx context.Context, kv jetstream.KeyValue, role string) ([]string, error) {
	keys, err := kv.ListKeys(ctx)
	if err != nil {
		return nil, err
	}
	var ids []string
	for k := range keys.Keys() {
		if !strings.HasPrefix(k, role+".") {
			continue
		}
		e, err := kv.Get(ctx, k)
		if err != nil {
			continue // deleted meanwhile
		}
		inst, err := wire.DecodeInstance(e.Value())
		if err != nil {
			return nil, fmt.Errorf("registry entry %s: %w", k, err)
		}
		ids = append(ids, inst.ID)
	}
	slices.Sort(ids)
	return ids, nil
}

// waitRegistry waits until the registry holds exactly the role's running
// pods, n of them.
func waitRegistry(ctx context.Context, t *testing.T, kv jetstream.KeyValue, c *cluster, role string, n int) []string {
	t.Helper()
	return waitRegistryExcept(ctx, t, kv, c, role, n, "")
}

func waitRegistryExcept(ctx context.Context, t *testing.T, kv jetstream.KeyValue, c *cluster, role string, n int, gone string) []string {
	t.Helper()
	var ids []string
	err := waitFor(ctx, fmt.Sprintf("%d %s instances registered", n, role), 4*time.Minute, nil, func() error {
		var err error
		if ids, err = registered(ctx, kv, role); err != nil {
			return err
		}
		pods := c.pods(ctx, t, role)
		if len(ids) != n || !slices.Equal(ids, pods) || slices.Contains(ids, gone) {
			return fmt.Errorf("registry %v, running pods %v", ids, pods)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

type completionResponse struct {
	Choices []struct {
		Text string `json:"text"`
	} `json:"choices"`
	Usage struct {
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
}

var plainClient = &http.Client{
	Timeout: 2 * time.Minute,
	// A new connection per request: each one goes where kube-proxy's rules
	// send it now, as a fleet of clients would.
	Transport: &http.Transport{DisableKeepAlives: true},
}

// errRetryable marks a request no server took: its connection failed
// (refused or reset while connecting: not a byte of it was sent), or it was
// answered 429/503 with Retry-After (queue full, draining, no prefill yet).
var errRetryable = errors.New("retryable")

func completeOnce(ctx context.Context, api, prompt string, maxTokens int) (string, time.Duration, error) {
	body, _ := json.Marshal(map[string]any{"model": "tiny-hybrid", "prompt": prompt, "max_tokens": maxTokens, "temperature": 0})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, api+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return "", 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := plainClient.Do(req)
	if err != nil {
		if op := (*net.OpError)(nil); errors.As(err, &op) && op.Op == "dial" {
			return "", 100 * time.Millisecond, fmt.Errorf("%w: %v", errRetryable, err)
		}
		return "", 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", 0, err
	}
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusTooManyRequests, http.StatusServiceUnavailable:
		wait, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
		return "", time.Duration(max(wait, 1)) * time.Second, fmt.Errorf("%w: %s: %s", errRetryable, resp.Status, bytes.TrimSpace(b))
	default:
		return "", 0, fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(b))
	}
	var cr completionResponse
	if err := json.Unmarshal(b, &cr); err != nil {
		return "", 0, fmt.Errorf("completion response %q: %w", b, err)
	}
	if len(cr.Choices) != 1 || cr.Usage.CompletionTokens == 0 {
		return "", 0, fmt.Errorf("completion response without text: %s", b)
	}
	return cr.Choices[0].Text, 0, nil
}

// complete sends one completion, retrying only what no server took.
func complete(ctx context.Context, api, prompt string, maxTokens int) (string, error) {
	text, _, err := completeRetrying(ctx, api, prompt, maxTokens)
	return text, err
}

func completeRetrying(ctx context.Context, api, prompt string, maxTokens int) (string, int, error) {
	retries := 0
	deadline := time.Now().Add(time.Minute)
	for {
		text, wait, err := completeOnce(ctx, api, prompt, maxTokens)
		if err == nil || !errors.Is(err, errRetryable) || time.Now().Add(wait).After(deadline) {
			return text, retries, err
		}
		retries++
		select {
		case <-ctx.Done():
			return "", retries, ctx.Err()
		case <-time.After(wait):
		}
	}
}

// load is a closed-loop load of concurrent clients.
type load struct {
	ok, failed, retries atomic.Int64
	mu                  sync.Mutex
	errs                []string
	cancel              context.CancelFunc
	wg                  sync.WaitGroup
}

type loadResult struct {
	ok, failed, retries int64
	errs                []string
}

func (r loadResult) String() string {
	s := fmt.Sprintf("%d requests: %d completed, %d failed, %d retries of requests no server took (429/503 with Retry-After, connection failed)",
		r.ok+r.failed, r.ok, r.failed, r.retries)
	if len(r.errs) > 0 {
		s += "; errors: " + strings.Join(r.errs, " | ")
	}
	return s
}

func startLoad(ctx context.Context, api string, clients int) *load {
	ctx, cancel := context.WithCancel(ctx)
	l := &load{cancel: cancel}
	for w := range clients {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			for i := 0; ctx.Err() == nil; i++ {
				// A request started is finished: the stop waits for it.
				_, retries, err := completeRetrying(context.WithoutCancel(ctx), api, fmt.Sprintf("client %d request %d", w, i), 24)
				l.retries.Add(int64(retries))
				if err != nil {
					l.failed.Add(1)
					l.mu.Lock()
					if len(l.errs) < 5 {
						l.errs = append(l.errs, err.Error())
					}
					l.mu.Unlock()
					continue
				}
				l.ok.Add(1)
			}
		}()
	}
	return l
}

// stop ends the load after the requests in flight finish.
func (l *load) stop() loadResult {
	l.cancel()
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	return loadResult{ok: l.ok.Load(), failed: l.failed.Load(), retries: l.retries.Load(), errs: slices.Clone(l.errs)}
}
