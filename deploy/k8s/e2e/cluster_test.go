//go:build k8s

package e2e

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/handoff-io/handoff/internal/testport"
)

// The cluster's fixed addresses. 198.18.0.0/15 is reserved for benchmarking
// (RFC 2544): no real network uses it, so the bridge and the Service range
// cannot shadow a route of the host's.
const (
	bridgeName   = "hk0"
	nodeIP       = "198.18.0.1" // the bridge's address: the node, its DNS server
	podCIDR      = "198.18.0.0/24"
	serviceCIDR  = "198.19.0.0/24"
	nodeName     = "handoff-e2e"
	pauseImage   = "handoff.local/pause:e2e"
	clusterDNSIP = nodeIP
)

// env names the inputs scripts/k8s-e2e passes.
const (
	envBin  = "HANDOFF_K8S_BIN"  // directory with kube, dns and pause (deploy/k8s/cluster)
	envTag  = "HANDOFF_K8S_TAG"  // tag of the handoff-* images in Docker
	envWork = "HANDOFF_K8S_WORK" // working directory (default: a temporary one)
)

// cluster is one single-node Kubernetes cluster made of host processes.
type cluster struct {
	t    *testing.T
	bin  string // directory of the kube, dns and pause binaries
	work string

	etcdPort, apiPort, kubeletPort int
	kubeconfig                     string // admin
	containerd                     string // containerd's socket

	netnsBefore []string // network namespaces of the host before the cluster

	mu    sync.Mutex
	procs []*proc
}

// proc is one component, its output in work/logs/<name>.log.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// requireHost skips the test, naming what is missing, when this host cannot
// run a kubelet.
func requireHost(t *testing.T) string {
	t.Helper()
	bin := os.Getenv(envBin)
	if bin == "" {
		t.Skipf("%s is not set: run scripts/k8s-e2e, which builds the cluster binaries", envBin)
	}
	var missing []string
	for _, f := range []string{"kube", "dns", "pause"} {
		if _, err := os.Stat(filepath.Join(bin, f)); err != nil {
			missing = append(missing, filepath.Join(bin, f))
		}
	}
	if os.Geteuid() != 0 {
		missing = append(missing, "root (the kubelet mounts, creates cgroups and network namespaces)")
	}
	for _, tool := range []string{"containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "ip", "docker"} {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool)
		}
	}
	if cniDir() == "" {
		missing = append(missing, "the CNI plugins bridge, host-local, portmap, firewall, loopback (Debian: containernetworking-plugins)")
	}
	if len(missing) > 0 {
		t.Skipf("this host cannot run the Kubernetes end-to-end test; missing: %s", strings.Join(missing, "; "))
	}
	return bin
}

// cniDir is the first directory holding every CNI plugin the network uses.
func cniDir() string {
	for _, dir := range []string{"/usr/lib/cni", "/opt/cni/bin"} {
		ok := true
		for _, p := range []string{"bridge", "host-local", "portmap", "firewall", "loopback"} {
			if _, err := os.Stat(filepath.Join(dir, p)); err != nil {
				ok = false
			}
		}
		if ok {
			return dir
		}
	}
	return ""
}

// startCluster brings the whole cluster up; t.Cleanup tears it down.
func startCluster(ctx context.Context, t *testing.T) *cluster {
	bin := requireHost(t)
	work := os.Getenv(envWork)
	if work == "" {
		// Unix socket paths must stay short: not t.TempDir().
		var err error
		if work, err = os.MkdirTemp("/tmp", "hk8s-"); err != nil {
			t.Fatal(err)
		}
	}
	c := &cluster{t: t, bin: bin, work: work, netnsBefore: netnsList()}
	if err := os.MkdirAll(work, 0o755); err != nil {
		t.Fatal(err)
	}
	// One cluster per host: the bridge and its addresses are fixed.
	lf, err := os.OpenFile("/tmp/handoff-k8s-e2e.lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(lf.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Skipf("another Kubernetes end-to-end run holds /tmp/handoff-k8s-e2e.lock: %v", err)
	}
	t.Cleanup(func() { lf.Close() })
	t.Cleanup(c.teardown)

	step := func(name string, f func() error) {
		t.Helper()
		start := time.Now()
		if err := f(); err != nil {
			c.dumpLogs()
			t.Fatalf("cluster: %s: %v", name, err)
		}
		t.Logf("cluster: %-28s %6.1fs", name, time.Since(start).Seconds())
	}
	step("bridge "+bridgeName+" "+nodeIP, c.bridge)
	step("certificates and kubeconfigs", c.pki)
	step("etcd", func() error { return c.startEtcd(ctx) })
	step("kube-apiserver", func() error { return c.startAPIServer(ctx) })
	step("controller-manager, scheduler", func() error { return c.startControllers() })
	step("containerd (CRI)", func() error { return c.startContainerd(ctx) })
	step("kubelet", func() error { return c.startKubelet(ctx) })
	step("kube-proxy, CoreDNS", func() error { return c.startProxyAndDNS(ctx) })
	return c
}

func (c *cluster) path(elem ...string) string {
	return filepath.Join(append([]string{c.work}, elem...)...)
}

// start runs bin/kube <component> or another binary, logging to logs/<name>.log.
func (c *cluster) start(name, exe string, args ...string) (*proc, error) {
	if err := os.MkdirAll(c.path("logs"), 0o755); err != nil {
		return nil, err
	}
	logf, err := os.Create(c.path("logs", name+".log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own process group: a stop signals the component and its helpers.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	c.mu.Lock()
	c.procs = append(c.procs, p)
	c.mu.Unlock()
	return p, nil
}

func (c *cluster) kube(name string, args ...string) (*proc, error) {
	return c.start(name, filepath.Join(c.bin, "kube"), append([]string{name}, args...)...)
}

// stop sends SIGTERM, then SIGKILL after grace.
func (p *proc) stop(grace time.Duration) {
	select {
	case <-p.done:
		return
	default:
	}
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
}

// waitFor polls f until it returns nil, the process p (if any) exits, or
// ctx or timeout end.
func waitFor(ctx context.Context, what string, timeout time.Duration, p *proc, f func() error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		last := f()
		if last == nil {
			return nil
		}
		var exited <-chan struct{}
		if p != nil {
			exited = p.done
		}
		select {
		case <-exited:
			return fmt.Errorf("%s: %s exited (%v) before it was ready; see %s.log", what, p.name, p.err, p.name)
		case <-ctx.Done():
			return fmt.Errorf("%s: not ready after %s: %w", what, timeout, last)
		case <-time.After(time.Second):
		}
	}
}

// freePort reserves a loopback port until the test ends
// (testport.Reserve): a component is told its ports before it starts, and
// a port only free a moment ago may be handed to an outgoing connection
// meanwhile. The components are Go programs, whose listeners set
// SO_REUSEADDR, so each binds the port its reservation holds.
func (c *cluster) freePort() (int, error) { return testport.Reserve(c.t), nil }

func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// bridge creates the node's bridge with the node address before any
// component binds it; the CNI bridge plugin then attaches pods to it. The
// Service range is routed onto it, so host-side clients reach ClusterIPs
// through kube-proxy's rules.
func (c *cluster) bridge() error {
	_ = exec.Command("ip", "link", "del", bridgeName).Run() // a previous run's
	for _, args := range [][]string{
		{"link", "add", bridgeName, "type", "bridge"},
		{"addr", "add", nodeIP + "/24", "dev", bridgeName},
		{"link", "set", bridgeName, "up"},
		{"route", "add", serviceCIDR, "dev", bridgeName, "src", nodeIP},
	} {
		if err := run("ip", args...); err != nil {
			return err
		}
	}
	// Bridged pod traffic must pass iptables for kube-proxy's rules.
	return os.WriteFile("/proc/sys/net/bridge/bridge-nf-call-iptables", []byte("1"), 0o644)
}

// pki writes a CA, the serving certificates, the service-account key, the
// static tokens and the kubeconfigs.
func (c *cluster) pki() error {
	dir := c.path("pki")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	var err error
	if c.etcdPort, err = c.freePort(); err != nil {
		return err
	}
	if c.apiPort, err = c.freePort(); err != nil {
		return err
	}
	if c.kubeletPort, err = c.freePort(); err != nil {
		return err
	}
	caKey, caCert, err := newCA()
	if err != nil {
		return err
	}
	if err := writePEM(filepath.Join(dir, "ca.crt"), "CERTIFICATE", caCert.Raw); err != nil {
		return err
	}
	certs := []struct {
		name string
		tmpl x509.Certificate
	}{
		{"apiserver", x509.Certificate{
			Subject:     pkix.Name{CommonName: "kube-apiserver"},
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
			DNSNames:    []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
			IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("198.19.0.1")},
		}},
		{"kubelet", x509.Certificate{
			Subject:     pkix.Name{CommonName: nodeName},
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
			DNSNames:    []string{nodeName},
			IPAddresses: []net.IP{net.ParseIP(nodeIP)},
		}},
		{"apiserver-kubelet-client", x509.Certificate{
			Subject:     pkix.Name{CommonName: "kube-apiserver-kubelet-client", Organization: []string{"system:masters"}},
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		}},
	}
	for _, cert := range certs {
		if err := issue(dir, cert.name, cert.tmpl, caCert, caKey); err != nil {
			return err
		}
	}
	// Service-account tokens are signed with this key (ES256).
	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	if err := writeKey(filepath.Join(dir, "sa.key"), saKey); err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return err
	}
	if err := writePEM(filepath.Join(dir, "sa.pub"), "PUBLIC KEY", pub); err != nil {
		return err
	}
	// Static bearer tokens, one identity per component.
	users := []struct{ name, groups string }{
		{"admin", "system:masters"},
		{"system:kube-controller-manager", ""},
		{"system:kube-scheduler", ""},
		{"system:kube-proxy", ""},
		{"system:node:" + nodeName, "system:nodes"},
		{"coredns", "system:masters"}, // reads Services and EndpointSlices cluster-wide
	}
	var csv strings.Builder
	for i, u := range users {
		tok := randomToken()
		fmt.Fprintf(&csv, "%s,%s,%d,%q\n", tok, u.name, i+1, u.groups)
		if err := c.writeKubeconfig(kubeconfigName(u.name), tok, caCert.Raw); err != nil {
			return err
		}
	}
	c.kubeconfig = c.path("pki", "admin.kubeconfig")
	return os.WriteFile(filepath.Join(dir, "tokens.csv"), []byte(csv.String()), 0o600)
}

func kubeconfigName(user string) string {
	switch {
	case strings.HasPrefix(user, "system:node:"):
		return "kubelet"
	case strings.HasPrefix(user, "system:kube-"):
		return strings.TrimPrefix(user, "system:kube-")
	}
	return user
}

func (c *cluster) writeKubeconfig(name, token string, ca []byte) error {
	caData := base64.StdEncoding.EncodeToString(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca}))
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: https://127.0.0.1:%d
    certificate-authority-data: %s
users:
- name: %s
  user:
    token: %s
contexts:
- name: e2e
  context: {cluster: e2e, user: %s}
current-context: e2e
`, c.apiPort, caData, name, token, name)
	return os.WriteFile(c.path("pki", name+".kubeconfig"), []byte(kc), 0o600)
}

func randomToken() string {
	b := make([]byte, 24)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)
}

func newCA() (*ecdsa.PrivateKey, *x509.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "handoff-e2e-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, err
	}
	cert, err := x509.ParseCertificate(der)
	return key, cert, err
}

func issue(dir, name string, tmpl x509.Certificate, ca *x509.Certificate, caKey *ecdsa.PrivateKey) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	if err != nil {
		return err
	}
	tmpl.SerialNumber = serial
	tmpl.NotBefore = time.Now().Add(-time.Hour)
	tmpl.NotAfter = time.Now().Add(24 * time.Hour)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, &tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return err
	}
	if err := writePEM(filepath.Join(dir, name+".crt"), "CERTIFICATE", der); err != nil {
		return err
	}
	return writeKey(filepath.Join(dir, name+".key"), key)
}

func writeKey(path string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	return writePEM(path, "EC PRIVATE KEY", der)
}

func writePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

func (c *cluster) startEtcd(ctx context.Context) error {
	peer, err := c.freePort()
	if err != nil {
		return err
	}
	client := fmt.Sprintf("http://127.0.0.1:%d", c.etcdPort)
	p, err := c.kube("etcd",
		"--name=e2e", "--data-dir="+c.path("etcd"),
		"--listen-client-urls="+client, "--advertise-client-urls="+client,
		fmt.Sprintf("--listen-peer-urls=http://127.0.0.1:%d", peer),
		fmt.Sprintf("--initial-advertise-peer-urls=http://127.0.0.1:%d", peer),
		fmt.Sprintf("--initial-cluster=e2e=http://127.0.0.1:%d", peer),
		"--unsafe-no-fsync", // a throwaway cluster; fsync on a loaded disk slows every write
		"--log-level=warn",
	)
	if err != nil {
		return err
	}
	return waitFor(ctx, "etcd", time.Minute, p, func() error { return httpOK(client + "/health") })
}

func (c *cluster) startAPIServer(ctx context.Context) error {
	pki := func(f string) string { return c.path("pki", f) }
	p, err := c.kube("apiserver",
		fmt.Sprintf("--etcd-servers=http://127.0.0.1:%d", c.etcdPort),
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
		fmt.Sprintf("--secure-port=%d", c.apiPort),
		// The advertised address is loopback, which pods cannot reach; the
		// kubernetes Service gets no endpoints and nothing here needs it.
		"--endpoint-reconciler-type=none",
		"--service-cluster-ip-range="+serviceCIDR,
		"--tls-cert-file="+pki("apiserver.crt"), "--tls-private-key-file="+pki("apiserver.key"),
		"--client-ca-file="+pki("ca.crt"),
		"--token-auth-file="+pki("tokens.csv"),
		"--authorization-mode=Node,RBAC",
		"--enable-admission-plugins=NodeRestriction",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+pki("sa.pub"),
		"--service-account-signing-key-file="+pki("sa.key"),
		"--kubelet-client-certificate="+pki("apiserver-kubelet-client.crt"),
		"--kubelet-client-key="+pki("apiserver-kubelet-client.key"),
		"--kubelet-preferred-address-types=InternalIP",
		"--allow-privileged=true",
		"--profiling=false",
	)
	if err != nil {
		return err
	}
	return waitFor(ctx, "kube-apiserver", 3*time.Minute, p, func() error {
		_, err := c.kubectl(ctx, "get", "--raw", "/readyz")
		return err
	})
}

func (c *cluster) startControllers() error {
	pki := func(f string) string { return c.path("pki", f) }
	cmPort, err := c.freePort()
	if err != nil {
		return err
	}
	schedPort, err := c.freePort()
	if err != nil {
		return err
	}
	if _, err := c.kube("controller-manager",
		"--kubeconfig="+pki("controller-manager.kubeconfig"),
		"--authentication-kubeconfig="+pki("controller-manager.kubeconfig"),
		"--authorization-kubeconfig="+pki("controller-manager.kubeconfig"),
		"--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", cmPort),
		"--leader-elect=false",
		"--use-service-account-credentials=true", // each controller with its RBAC role
		"--service-account-private-key-file="+pki("sa.key"),
		"--root-ca-file="+pki("ca.crt"),
		"--cluster-cidr="+podCIDR, "--service-cluster-ip-range="+serviceCIDR,
		"--allocate-node-cidrs=false",
		"--profiling=false",
	); err != nil {
		return err
	}
	_, err = c.kube("scheduler",
		"--kubeconfig="+pki("scheduler.kubeconfig"),
		"--authentication-kubeconfig="+pki("scheduler.kubeconfig"),
		"--authorization-kubeconfig="+pki("scheduler.kubeconfig"),
		"--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", schedPort),
		"--leader-elect=false",
		"--profiling=false",
	)
	return err
}

// startContainerd runs a containerd of the test's own (own root, state and
// socket) with the CRI plugin, the pause image built here and the CNI bridge.
//
// restrict_oom_score_adj: the kubelet asks for oom_score_adj -998 on pod
// sandboxes (and negative values for guaranteed pods). Lowering it needs
// CAP_SYS_RESOURCE, which root does not hold on some VMs and sandboxes; runc
// then dies in its init ("can't get final child's PID from pipe: EOF"). The
// option clamps a requested value to containerd's own, as for rootless
// containers.
func (c *cluster) startContainerd(ctx context.Context) error {
	dir := c.path("containerd")
	netd := c.path("cni", "net.d")
	for _, d := range []string{dir, netd} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	c.containerd = filepath.Join(dir, "sock")
	conf := fmt.Sprintf(`version = 2
root = %[1]q
state = %[2]q
[grpc]
  address = %[3]q
[ttrpc]
  address = "%[3]s.ttrpc"
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %[4]q
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = %[7]q
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %[5]q
    conf_dir = %[6]q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), c.containerd, pauseImage, cniDir(), netd, filepath.Join(dir, "runc"))
	if err := os.WriteFile(filepath.Join(dir, "config.toml"), []byte(conf), 0o644); err != nil {
		return err
	}
	cni := fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "handoff-e2e",
  "plugins": [
    {"type": "bridge", "bridge": %q, "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": %q, "gateway": %q}]],
              "routes": [{"dst": "0.0.0.0/0"}], "dataDir": %q}},
    {"type": "firewall"},
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "loopback"}
  ]
}
`, bridgeName, podCIDR, nodeIP, c.path("cni", "ipam"))
	if err := os.WriteFile(filepath.Join(netd, "10-handoff-e2e.conflist"), []byte(cni), 0o644); err != nil {
		return err
	}
	p, err := c.start("containerd", "containerd", "--config", filepath.Join(dir, "config.toml"))
	if err != nil {
		return err
	}
	if err := waitFor(ctx, "containerd", time.Minute, p, func() error {
		return run("ctr", "-a", c.containerd, "version")
	}); err != nil {
		return err
	}
	return c.importPause()
}

func (c *cluster) ctr(args ...string) *exec.Cmd {
	return exec.Command("ctr", append([]string{"-a", c.containerd, "-n", "k8s.io"}, args...)...)
}

// importPause builds the sandbox image FROM scratch around the pause binary
// and imports it: no registry is needed.
func (c *cluster) importPause() error {
	dir := c.path("pause-image")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b, err := os.ReadFile(filepath.Join(c.bin, "pause"))
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "pause"), b, 0o755); err != nil {
		return err
	}
	df := "FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT [\"/pause\"]\n"
	if err := os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte(df), 0o644); err != nil {
		return err
	}
	if err := run("docker", "build", "-q", "-t", pauseImage, dir); err != nil {
		return err
	}
	return c.importImages(pauseImage)
}

// importImages copies images from Docker into the cluster's containerd.
func (c *cluster) importImages(refs ...string) error {
	save := exec.Command("docker", append([]string{"save"}, refs...)...)
	imp := c.ctr("images", "import", "-")
	pipe, err := save.StdoutPipe()
	if err != nil {
		return err
	}
	imp.Stdin = pipe
	var saveErr, impOut strings.Builder
	save.Stderr = &saveErr
	imp.Stdout, imp.Stderr = &impOut, &impOut
	if err := save.Start(); err != nil {
		return err
	}
	if err := imp.Run(); err != nil {
		_ = save.Wait()
		return fmt.Errorf("ctr images import: %w: %s", err, impOut.String())
	}
	if err := save.Wait(); err != nil {
		return fmt.Errorf("docker save %v: %w: %s", refs, err, saveErr.String())
	}
	return nil
}

func (c *cluster) startKubelet(ctx context.Context) error {
	dir := c.path("kubelet")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	healthz, err := c.freePort()
	if err != nil {
		return err
	}
	pki := func(f string) string { return c.path("pki", f) }
	conf := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %[1]s
port: %[2]d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %[3]d
tlsCertFile: %[4]s
tlsPrivateKeyFile: %[5]s
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %[6]s}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://%[7]s
cgroupDriver: cgroupfs
# This host may have cgroup v1 only; the kubelet refuses it unless told.
failCgroupV1: false
failSwapOn: false
# Lowering oom_score_adj needs CAP_SYS_RESOURCE (see containerd's config).
oomScoreAdj: 0
clusterDNS: [%[8]s]
clusterDomain: cluster.local
resolvConf: %[9]s
podLogsDir: %[10]s
maxPods: 40
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%%, imagefs.available: 1%%, nodefs.inodesFree: 1%%}
localStorageCapacityIsolation: true
enableControllerAttachDetach: true
`, nodeIP, c.kubeletPort, healthz, pki("kubelet.crt"), pki("kubelet.key"), pki("ca.crt"), c.containerd,
		clusterDNSIP, c.resolvConf(), c.path("pod-logs"))
	if err := os.WriteFile(filepath.Join(dir, "config.yaml"), []byte(conf), 0o644); err != nil {
		return err
	}
	p, err := c.kube("kubelet",
		"--config="+filepath.Join(dir, "config.yaml"),
		"--kubeconfig="+pki("kubelet.kubeconfig"),
		"--root-dir="+filepath.Join(dir, "root"),
		"--hostname-override="+nodeName,
		"--node-ip="+nodeIP,
		"--v=1",
	)
	if err != nil {
		return err
	}
	return waitFor(ctx, "node "+nodeName+" Ready", 3*time.Minute, p, func() error {
		out, err := c.kubectl(ctx, "get", "node", nodeName, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
		if err != nil {
			return err
		}
		if strings.TrimSpace(out) != "True" {
			return fmt.Errorf("Ready=%q", out)
		}
		return nil
	})
}

// resolvConf gives pods' DNS nothing to forward to but the cluster's: the
// host's resolvers may be unreachable from pods, and the test resolves only
// cluster names.
func (c *cluster) resolvConf() string {
	path := c.path("resolv.conf")
	_ = os.WriteFile(path, []byte("nameserver "+nodeIP+"\n"), 0o644)
	return path
}

func (c *cluster) startProxyAndDNS(ctx context.Context) error {
	pki := func(f string) string { return c.path("pki", f) }
	healthz, err := c.freePort()
	if err != nil {
		return err
	}
	metrics, err := c.freePort()
	if err != nil {
		return err
	}
	conf := fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: %[1]s}
mode: iptables
hostnameOverride: %[2]s
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:%[3]d
metricsBindAddress: 127.0.0.1:%[4]d
clusterCIDR: %[5]s
nodePortAddresses: [%[6]s/32]
oomScoreAdj: 0
conntrack: {maxPerCore: 0, min: 0}
`, pki("proxy.kubeconfig"), nodeName, healthz, metrics, podCIDR, nodeIP)
	cfg := c.path("kube-proxy.yaml")
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		return err
	}
	p, err := c.kube("proxy", "--config="+cfg)
	if err != nil {
		return err
	}
	if err := waitFor(ctx, "kube-proxy", 2*time.Minute, p, func() error {
		return httpOK(fmt.Sprintf("http://127.0.0.1:%d/healthz", healthz))
	}); err != nil {
		return err
	}
	ready, err := c.freePort()
	if err != nil {
		return err
	}
	corefile := fmt.Sprintf(`.:53 {
    bind %[1]s
    errors
    ready 127.0.0.1:%[2]d
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig %[3]s
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 5
}
`, nodeIP, ready, pki("coredns.kubeconfig"))
	cf := c.path("Corefile")
	if err := os.WriteFile(cf, []byte(corefile), 0o644); err != nil {
		return err
	}
	d, err := c.start("coredns", filepath.Join(c.bin, "dns"), "-conf", cf)
	if err != nil {
		return err
	}
	return waitFor(ctx, "CoreDNS", 2*time.Minute, d, func() error {
		if err := httpOK(fmt.Sprintf("http://127.0.0.1:%d/ready", ready)); err != nil {
			return err
		}
		// An answer, found or not, is a DNS server serving the zone.
		r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "udp", net.JoinHostPort(nodeIP, "53"))
		}}
		_, err := r.LookupHost(ctx, "kubernetes.default.svc.cluster.local")
		if dnsErr, ok := errors.AsType[*net.DNSError](err); ok && dnsErr.IsNotFound {
			return nil
		}
		return err
	})
}

func httpOK(url string) error {
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, // a readiness probe of our own processes
	}}
	resp, err := client.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}

// kubectl runs the cluster's kubectl as admin.
func (c *cluster) kubectl(ctx context.Context, args ...string) (string, error) {
	return c.kubectlIn(ctx, nil, args...)
}

func (c *cluster) kubectlIn(ctx context.Context, stdin io.Reader, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(c.bin, "kube"), append([]string{"kubectl", "--kubeconfig=" + c.kubeconfig}, args...)...)
	cmd.Stdin = stdin
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}

// dumpLogs prints the last lines of every component's log.
func (c *cluster) dumpLogs() {
	c.mu.Lock()
	procs := slices.Clone(c.procs)
	c.mu.Unlock()
	for _, p := range procs {
		c.t.Logf("---- %s.log (last 25 lines)\n%s", p.name, tail(c.path("logs", p.name+".log"), 25))
	}
}

func tail(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > n {
			lines = lines[1:]
		}
	}
	return strings.Join(lines, "\n")
}

// teardown stops the pods' containers, every component, and removes what the
// cluster left on the host: containers, mounts, iptables chains, the bridge.
func (c *cluster) teardown() {
	if c.t.Failed() {
		c.dumpLogs()
	}
	c.mu.Lock()
	procs := slices.Clone(c.procs)
	c.mu.Unlock()
	byName := map[string]*proc{}
	for _, p := range procs {
		byName[p.name] = p
	}
	// The pods go first, through the kubelet, so that the CNI plugins
	// release their addresses and iptables rules; then the kubelet, so it
	// restarts nothing; then whatever containers are left, while containerd
	// still runs.
	if p := byName["kubelet"]; p != nil {
		c.deletePods()
		p.stop(10 * time.Second)
	}
	if c.containerd != "" {
		c.removeContainers()
	}
	for i := len(procs) - 1; i >= 0; i-- {
		procs[i].stop(10 * time.Second)
	}
	if _, err := os.Stat(filepath.Join(c.bin, "kube")); err == nil {
		_ = exec.Command(filepath.Join(c.bin, "kube"), "proxy", "--cleanup").Run()
	}
	c.unmountAll()
	_ = exec.Command("ip", "link", "del", bridgeName).Run()
	if os.Getenv(envWork) == "" && !c.t.Failed() {
		_ = os.RemoveAll(c.work)
	} else {
		c.t.Logf("cluster logs kept in %s", c.path("logs"))
	}
}

// deletePods deletes the test's namespace and its pods at once, and waits
// (a minute at most) for the kubelet to remove their sandboxes.
func (c *cluster) deletePods() {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	_, _ = c.kubectl(ctx, "delete", "namespace", ns, "--wait=false")
	_, _ = c.kubectl(ctx, "-n", ns, "delete", "pods", "--all", "--grace-period=1", "--wait=false")
	_ = waitFor(ctx, "pod sandboxes removed", time.Minute, nil, func() error {
		out, err := c.ctr("containers", "ls", "-q").Output()
		if err != nil {
			return err
		}
		if n := len(strings.Fields(string(out))); n > 0 {
			return fmt.Errorf("%d containers left", n)
		}
		return nil
	})
}

// removeContainers kills and removes every task and container of the
// cluster's containerd, the sandboxes through the CRI so that their network
// is released.
func (c *cluster) removeContainers() {
	out, _ := c.ctr("containers", "ls", "-q").Output()
	for _, id := range strings.Fields(string(out)) {
		_ = c.ctr("tasks", "kill", "-s", "SIGKILL", id).Run()
	}
	time.Sleep(time.Second)
	for _, id := range strings.Fields(string(out)) {
		_ = c.ctr("tasks", "delete", "-f", id).Run()
		_ = c.ctr("containers", "delete", id).Run()
	}
	// Network namespaces made for the sandboxes since the cluster started.
	for _, n := range netnsList() {
		if !slices.Contains(c.netnsBefore, n) && strings.HasPrefix(n, "cni-") {
			_ = exec.Command("ip", "netns", "del", n).Run()
		}
	}
}

func netnsList() []string {
	out, _ := exec.Command("ip", "netns", "list").Output()
	var names []string
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) > 0 {
			names = append(names, f[0])
		}
	}
	return names
}

// unmountAll lazily unmounts whatever is still mounted under the work
// directory, deepest first.
func (c *cluster) unmountAll() {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var mounts []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && (f[4] == c.work || strings.HasPrefix(f[4], c.work+"/")) {
			mounts = append(mounts, f[4])
		}
	}
	slices.SortFunc(mounts, func(a, b string) int { return len(b) - len(a) })
	for _, m := range mounts {
		_ = syscall.Unmount(m, syscall.MNT_DETACH)
	}
}
