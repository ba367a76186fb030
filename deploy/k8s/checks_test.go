package k8s

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	monv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/client_golang/prometheus"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/admin"
	"github.com/handoff-io/handoff/worker/config"
)

// natsMonitorPort is handoff-nats's default --http-port (the conventions'
// NATS monitoring port); HANDOFF_NATS_HTTP_PORT overrides it per container.
const natsMonitorPort = 8222

// Probe paths the workers' admin server must answer with 200 (livez) or with
// a readiness verdict (readyz), per the conventions.
const (
	livezPath   = "/livez"
	readyzPath  = "/readyz"
	metricsPath = "/metrics"
)

// checker collects every problem instead of stopping at the first.
type checker struct {
	errs  []error
	admin http.Handler
}

func newChecker() *checker {
	return &checker{admin: admin.New(prometheus.NewRegistry()).Handler()}
}

func (c *checker) errorf(format string, a ...any) {
	c.errs = append(c.errs, fmt.Errorf(format, a...))
}

// check runs every cross-object check on one rendered overlay.
func check(objs []object) []error {
	c := newChecker()
	c.uniqueNames(objs)
	c.workloadSelectors(objs)
	c.services(objs)
	c.pdbs(objs)
	c.workers(objs)
	c.nats(objs)
	c.podMonitors(objs)
	return c.errs
}

func (c *checker) uniqueNames(objs []object) {
	seen := map[string]bool{}
	for _, o := range objs {
		k := o.Kind + "/" + o.Name
		if seen[k] {
			c.errorf("%s rendered twice", k)
		}
		seen[k] = true
	}
}

func selectorMatches(sel *metav1.LabelSelector, l map[string]string) (bool, error) {
	if sel == nil {
		return false, fmt.Errorf("no selector")
	}
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		return false, err
	}
	if s.Empty() {
		return false, fmt.Errorf("empty selector selects everything")
	}
	return s.Matches(labels.Set(l)), nil
}

// workloadSelectors: a Deployment's or StatefulSet's selector must select its
// own pod template.
func (c *checker) workloadSelectors(objs []object) {
	for _, p := range podTemplates(objs) {
		if p.Selector == nil { // LWS manages its own selectors
			continue
		}
		ok, err := selectorMatches(p.Selector, p.Template.Labels)
		if err != nil {
			c.errorf("%s: selector: %v", p.Owner, err)
		} else if !ok {
			c.errorf("%s: selector %v does not match its template labels %v", p.Owner, p.Selector.MatchLabels, p.Template.Labels)
		}
	}
}

// matching returns the pod templates whose pods a label selector picks.
func matching(objs []object, sel *metav1.LabelSelector) ([]podTemplate, error) {
	var out []podTemplate
	for _, p := range podTemplates(objs) {
		ok, err := selectorMatches(sel, p.podLabels())
		if err != nil {
			return nil, err
		}
		if ok {
			out = append(out, p)
		}
	}
	return out, nil
}

// containerPort resolves a named or numbered port on a pod template.
func containerPort(p podTemplate, port intstr.IntOrString) (int32, bool) {
	for _, ctr := range p.Template.Spec.Containers {
		for _, cp := range ctr.Ports {
			if port.Type == intstr.String && cp.Name == port.StrVal {
				return cp.ContainerPort, true
			}
			if port.Type == intstr.Int && cp.ContainerPort == port.IntVal {
				return cp.ContainerPort, true
			}
		}
	}
	return 0, false
}

func (c *checker) services(objs []object) {
	for _, svc := range ofKind[*corev1.Service](objs) {
		if len(svc.Spec.Selector) == 0 {
			c.errorf("Service/%s: no selector", svc.Name)
			continue
		}
		pods, err := matching(objs, &metav1.LabelSelector{MatchLabels: svc.Spec.Selector})
		if err != nil {
			c.errorf("Service/%s: %v", svc.Name, err)
			continue
		}
		if len(pods) == 0 {
			c.errorf("Service/%s: selector %v matches no pod template", svc.Name, svc.Spec.Selector)
			continue
		}
		for _, sp := range svc.Spec.Ports {
			target := sp.TargetPort
			if target.Type == intstr.Int && target.IntVal == 0 {
				target = intstr.FromInt32(sp.Port)
			}
			for _, p := range pods {
				if _, ok := containerPort(p, target); !ok {
					c.errorf("Service/%s port %s: target %s is not a port of %s", svc.Name, sp.Name, target.String(), p.Owner)
				}
			}
		}
	}
}

// pdbs: every PDB selects pods, all of one component.
func (c *checker) pdbs(objs []object) {
	for _, pdb := range ofKind[*policyv1.PodDisruptionBudget](objs) {
		pods, err := matching(objs, pdb.Spec.Selector)
		if err != nil {
			c.errorf("PodDisruptionBudget/%s: %v", pdb.Name, err)
			continue
		}
		if len(pods) == 0 {
			c.errorf("PodDisruptionBudget/%s: selector matches no pod template", pdb.Name)
			continue
		}
		comps := map[string]bool{}
		for _, p := range pods {
			comps[p.Template.Labels["app.kubernetes.io/component"]] = true
		}
		if len(comps) != 1 {
			c.errorf("PodDisruptionBudget/%s: selects pods of several components %v", pdb.Name, sortedKeys(comps))
		}
		if (pdb.Spec.MinAvailable == nil) == (pdb.Spec.MaxUnavailable == nil) {
			c.errorf("PodDisruptionBudget/%s: set exactly one of minAvailable and maxUnavailable", pdb.Name)
		}
	}
}

// served reports whether the workers' admin server answers path with a
// status a probe or scraper can use (not 404 or 405).
func (c *checker) served(path string) (int, bool) {
	u, err := url.Parse(path)
	if err != nil {
		return 0, false
	}
	req := httptest.NewRequest(http.MethodGet, u.String(), nil)
	rec := httptest.NewRecorder()
	c.admin.ServeHTTP(rec, req)
	code := rec.Result().StatusCode
	return code, code == http.StatusOK || code == http.StatusServiceUnavailable
}

func portOf(addr string) (int32, error) {
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, err
	}
	n, err := strconv.ParseInt(p, 10, 32)
	if err != nil {
		return 0, err
	}
	return int32(n), nil
}

// workers checks every prefill and decode container by parsing the
// configuration its pod would really get with the binaries' own parser.
func (c *checker) workers(objs []object) {
	cms := configMaps(objs)
	services := ofKind[*corev1.Service](objs)
	for _, p := range podTemplates(objs) {
		for _, ctr := range p.Template.Spec.Containers {
			role := worker.Role(ctr.Name)
			if role != worker.RolePrefill && role != worker.RoleDecode {
				continue
			}
			c.worker(p, ctr, role, cms, services)
		}
	}
}

func (c *checker) worker(p podTemplate, ctr corev1.Container, role worker.Role, cms map[string]*corev1.ConfigMap, services []*corev1.Service) {
	where := p.Owner + " container " + ctr.Name
	if len(ctr.Command) > 0 && (len(ctr.Command) != 1 || ctr.Command[0] != "/"+ctr.Name) {
		c.errorf("%s: command %v: the image's entrypoint is /%s", where, ctr.Command, ctr.Name)
	}
	pod := fakePod{Name: string(role) + "-7d9f8-abcde", Namespace: "handoff", IP: "10.1.2.3"}
	env, err := containerEnv(p, ctr, cms, pod)
	if err != nil {
		c.errorf("%s: %v", where, err)
		return
	}
	cfg, err := config.Parse(role, ctr.Args, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		c.errorf("%s: the %s binary rejects this configuration: %v", where, role, err)
		return
	}

	// Downward API: identity and advertise address.
	for name, path := range map[string]string{"POD_IP": "status.podIP", "POD_NAME": "metadata.name"} {
		found := false
		for _, e := range ctr.Env {
			if e.Name == name && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == path {
				found = true
			}
		}
		if !found {
			c.errorf("%s: %s must come from the downward API (%s)", where, name, path)
		}
	}
	if cfg.InstanceID != pod.Name {
		c.errorf("%s: instance id %q, want the pod name %q", where, cfg.InstanceID, pod.Name)
	}

	// Ports the binary listens on are the ports the pod declares.
	named := func(name, addr, what string) int32 {
		want, err := portOf(addr)
		if err != nil {
			c.errorf("%s: %s %q: %v", where, what, addr, err)
			return 0
		}
		got, ok := containerPort(p, intstr.FromString(name))
		if !ok {
			c.errorf("%s: no container port named %q for %s (:%d)", where, name, what, want)
		} else if got != want {
			c.errorf("%s: container port %q is %d but the binary's %s is %d", where, name, got, what, want)
		}
		return want
	}
	adminPort := named("admin", cfg.AdminAddr, "--admin-addr")
	dataPort := named("data", cfg.DataAddr, "--data-addr")
	if role == worker.RoleDecode {
		named("http", cfg.HTTPAddr, "--http-addr")
	}
	if want := net.JoinHostPort(pod.IP, strconv.Itoa(int(dataPort))); cfg.DataAdvertise != want {
		c.errorf("%s: data advertise %q, want %q (POD_IP and the data port)", where, cfg.DataAdvertise, want)
	}

	// Probes: startup and liveness on /livez, readiness on /readyz, all on the
	// admin port, all paths really served.
	probes := []struct {
		kind  string
		probe *corev1.Probe
		path  string
	}{
		{"startupProbe", ctr.StartupProbe, livezPath},
		{"livenessProbe", ctr.LivenessProbe, livezPath},
		{"readinessProbe", ctr.ReadinessProbe, readyzPath},
	}
	for _, pr := range probes {
		if pr.probe == nil || pr.probe.HTTPGet == nil {
			c.errorf("%s: %s must be an httpGet probe", where, pr.kind)
			continue
		}
		g := pr.probe.HTTPGet
		if g.Path != pr.path {
			c.errorf("%s: %s path %q, want %q", where, pr.kind, g.Path, pr.path)
		}
		if code, ok := c.served(g.Path); !ok {
			c.errorf("%s: %s path %q is not served by the admin server (status %d)", where, pr.kind, g.Path, code)
		}
		if got, ok := containerPort(p, g.Port); !ok || got != adminPort {
			c.errorf("%s: %s port %s is not the admin port %d", where, pr.kind, g.Port.String(), adminPort)
		}
	}
	if sp := ctr.StartupProbe; sp != nil {
		// The startup allowance must cover a cold start (model load, NATS).
		if allowance := time.Duration(sp.PeriodSeconds*sp.FailureThreshold) * time.Second; allowance < 2*time.Minute {
			c.errorf("%s: startup allowance %v, want at least 2m", where, allowance)
		}
	}

	// Termination: the grace period outlasts the preStop sleep and the
	// drain.
	grace := p.Template.Spec.TerminationGracePeriodSeconds
	var sleep time.Duration
	if l := ctr.Lifecycle; l != nil && l.PreStop != nil && l.PreStop.Sleep != nil {
		sleep = time.Duration(l.PreStop.Sleep.Seconds) * time.Second
	}
	if grace == nil || time.Duration(*grace)*time.Second <= sleep+cfg.DrainTimeout {
		c.errorf("%s: terminationGracePeriodSeconds %v must exceed the preStop sleep %v plus the drain timeout %v",
			where, ptrVal(grace), sleep, cfg.DrainTimeout)
	}

	// NATS: every URL names a rendered Service and one of its ports.
	for _, raw := range strings.Split(cfg.NATS.URL, ",") {
		u, err := url.Parse(strings.TrimSpace(raw))
		if err != nil {
			c.errorf("%s: NATS URL %q: %v", where, raw, err)
			continue
		}
		if !serviceHasPort(services, u.Hostname(), u.Port()) {
			c.errorf("%s: NATS URL %q does not name a rendered Service and port", where, raw)
		}
	}

	// Scrape annotations point at the admin port and a served path.
	if a := p.Template.Annotations; a["prometheus.io/scrape"] == "true" {
		if a["prometheus.io/port"] != strconv.Itoa(int(adminPort)) {
			c.errorf("%s: prometheus.io/port %q, want the admin port %d", where, a["prometheus.io/port"], adminPort)
		}
		if code, ok := c.served(a["prometheus.io/path"]); !ok || code != http.StatusOK {
			c.errorf("%s: prometheus.io/path %q is not served", where, a["prometheus.io/path"])
		}
	}

	c.podHygiene(p, ctr, where)
}

func (c *checker) podHygiene(p podTemplate, ctr corev1.Container, where string) {
	req := ctr.Resources.Requests
	if req.Cpu().IsZero() || req.Memory().IsZero() {
		c.errorf("%s: requests for cpu and memory are required", where)
	}
	sc := p.Template.Spec.SecurityContext
	if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot {
		c.errorf("%s: pod must set runAsNonRoot", where)
	}
	if cs := ctr.SecurityContext; cs != nil && cs.ReadOnlyRootFilesystem != nil && *cs.ReadOnlyRootFilesystem {
		if !mounted(ctr, "/tmp") {
			c.errorf("%s: read-only root filesystem without a /tmp volume", where)
		}
	}
	for _, m := range ctr.VolumeMounts {
		if volume(p, m.Name) == nil && !slices.Contains(p.Claims, m.Name) {
			c.errorf("%s: volumeMount %q names no volume of the pod", where, m.Name)
		}
	}
}

func mounted(ctr corev1.Container, path string) bool {
	for _, m := range ctr.VolumeMounts {
		if m.MountPath == path {
			return true
		}
	}
	return false
}

func volume(p podTemplate, name string) *corev1.Volume {
	for i, v := range p.Template.Spec.Volumes {
		if v.Name == name {
			return &p.Template.Spec.Volumes[i]
		}
	}
	return nil
}

func ptrVal[T any](p *T) any {
	if p == nil {
		return "unset"
	}
	return *p
}

func serviceHasPort(services []*corev1.Service, host, port string) bool {
	name, _, _ := strings.Cut(host, ".")
	for _, s := range services {
		if s.Name != name {
			continue
		}
		for _, sp := range s.Spec.Ports {
			if strconv.Itoa(int(sp.Port)) == port {
				return true
			}
		}
	}
	return false
}

// flagValue returns the value of --name=v or --name v in args.
func flagValue(args []string, name string) (string, bool) {
	for i, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
		if a == "--"+name && i+1 < len(args) {
			return args[i+1], true
		}
	}
	return "", false
}

// nats checks the NATS StatefulSet: probes on the monitoring port, routes that
// name exactly the set's own pods through its headless Service, and a store
// directory on a volume.
func (c *checker) nats(objs []object) {
	services := ofKind[*corev1.Service](objs)
	for _, sts := range ofKind[*appsv1.StatefulSet](objs) {
		for _, ctr := range sts.Spec.Template.Spec.Containers {
			if ctr.Name != "nats" {
				continue
			}
			where := "StatefulSet/" + sts.Name
			p := podTemplate{Owner: where, Selector: sts.Spec.Selector, Template: sts.Spec.Template, Claims: claimNames(sts.Spec.VolumeClaimTemplates)}
			env, err := containerEnv(p, ctr, configMaps(objs), fakePod{Name: sts.Name + "-0", Namespace: "handoff", IP: "10.1.2.4"})
			if err != nil {
				c.errorf("%s: %v", where, err)
				continue
			}
			monitor := int32(natsMonitorPort)
			if v := env["HANDOFF_NATS_HTTP_PORT"]; v != "" {
				n, err := strconv.Atoi(v)
				if err != nil {
					c.errorf("%s: HANDOFF_NATS_HTTP_PORT %q: %v", where, v, err)
				}
				monitor = int32(n)
			}
			for kind, pr := range map[string]*corev1.Probe{"startupProbe": ctr.StartupProbe, "livenessProbe": ctr.LivenessProbe, "readinessProbe": ctr.ReadinessProbe} {
				if pr == nil || pr.HTTPGet == nil {
					c.errorf("%s: %s must be an httpGet probe", where, kind)
					continue
				}
				if !strings.HasPrefix(pr.HTTPGet.Path, "/healthz") {
					c.errorf("%s: %s path %q, want /healthz", where, kind, pr.HTTPGet.Path)
				}
				if got, ok := containerPort(p, pr.HTTPGet.Port); !ok || got != monitor {
					c.errorf("%s: %s port %s is not the monitoring port %d", where, kind, pr.HTTPGet.Port.String(), monitor)
				}
			}

			replicas := int32(1)
			if sts.Spec.Replicas != nil {
				replicas = *sts.Spec.Replicas
			}
			headless := false
			for _, s := range services {
				if s.Name == sts.Spec.ServiceName && s.Spec.ClusterIP == corev1.ClusterIPNone {
					if ok, _ := selectorMatches(&metav1.LabelSelector{MatchLabels: s.Spec.Selector}, sts.Spec.Template.Labels); ok {
						headless = true
					}
				}
			}
			if !headless {
				c.errorf("%s: serviceName %q is not a headless Service selecting its pods", where, sts.Spec.ServiceName)
			}
			routes, hasRoutes := flagValue(ctr.Args, "routes")
			if replicas > 1 && !hasRoutes {
				c.errorf("%s: %d replicas but no --routes: the servers would not form a cluster", where, replicas)
			}
			if hasRoutes {
				if _, ok := flagValue(ctr.Args, "cluster-name"); !ok {
					c.errorf("%s: --routes without --cluster-name", where)
				}
				clusterPort, ok := containerPort(p, intstr.FromString("cluster"))
				if !ok {
					c.errorf("%s: no container port named cluster", where)
				}
				want := map[string]bool{}
				for i := range replicas {
					want[fmt.Sprintf("%s-%d.%s:%d", sts.Name, i, sts.Spec.ServiceName, clusterPort)] = true
				}
				got := map[string]bool{}
				for _, r := range strings.Split(routes, ",") {
					u, err := url.Parse(r)
					if err != nil || u.Scheme != "nats" {
						c.errorf("%s: route %q: want nats://host:port", where, r)
						continue
					}
					got[u.Host] = true
				}
				if fmt.Sprint(sortedKeys(got)) != fmt.Sprint(sortedKeys(want)) {
					c.errorf("%s: routes %v, want the set's own pods %v", where, sortedKeys(got), sortedKeys(want))
				}
			}
			store := env["HANDOFF_NATS_STORE_DIR"]
			if v, ok := flagValue(ctr.Args, "store-dir"); ok {
				store = v
			}
			onVolume := false
			for _, m := range ctr.VolumeMounts {
				if store != "" && (store == m.MountPath || strings.HasPrefix(store, m.MountPath+"/")) {
					for _, vct := range sts.Spec.VolumeClaimTemplates {
						if vct.Name == m.Name {
							onVolume = true
						}
					}
				}
			}
			if !onVolume {
				c.errorf("%s: JetStream store %q is not on a volume claim", where, store)
			}
			if d, ok := flagValue(ctr.Args, "lame-duck-duration"); ok {
				ld, err := time.ParseDuration(d)
				grace := sts.Spec.Template.Spec.TerminationGracePeriodSeconds
				if err != nil || grace == nil || time.Duration(*grace)*time.Second <= ld {
					c.errorf("%s: terminationGracePeriodSeconds %v must exceed --lame-duck-duration %s", where, ptrVal(grace), d)
				}
			}
			c.podHygiene(p, ctr, where)
		}
	}
}

// podMonitors: each PodMonitor selects worker pods and scrapes a named port
// they all have, on a path the admin server serves.
func (c *checker) podMonitors(objs []object) {
	for _, pm := range ofKind[*monv1.PodMonitor](objs) {
		where := "PodMonitor/" + pm.Name
		pods, err := matching(objs, &pm.Spec.Selector)
		if err != nil {
			c.errorf("%s: %v", where, err)
			continue
		}
		if len(pods) == 0 {
			c.errorf("%s: selector matches no pod template", where)
			continue
		}
		if len(pm.Spec.PodMetricsEndpoints) == 0 {
			c.errorf("%s: no podMetricsEndpoints", where)
		}
		for _, ep := range pm.Spec.PodMetricsEndpoints {
			if ep.Port == nil || *ep.Port == "" {
				c.errorf("%s: endpoint without a named port", where)
				continue
			}
			for _, p := range pods {
				if _, ok := containerPort(p, intstr.FromString(*ep.Port)); !ok {
					c.errorf("%s: port %q is not a port of %s", where, *ep.Port, p.Owner)
				}
			}
			path := metricsPath
			if ep.Path != "" {
				path = ep.Path
			}
			if code, ok := c.served(path); !ok || code != http.StatusOK {
				c.errorf("%s: path %q is not served by the admin server", where, path)
			}
		}
	}
}
