package k8s

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"

	monv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/config"
)

// kustomizations lists every directory a user may apply; each must render,
// decode strictly and pass every check.
var kustomizations = []struct {
	dir    string
	expect func(t *testing.T, objs []object)
}{
	{"base", expectBase},
	{"overlays/gpu", expectGPU},
	{"overlays/lws", expectLWS},
	{"overlays/podmonitor", expectPodMonitor},
}

func TestKustomizationsRenderAndValidate(t *testing.T) {
	for _, k := range kustomizations {
		t.Run(k.dir, func(t *testing.T) {
			objs, err := render(k.dir)
			require.NoError(t, err)
			require.NotEmpty(t, objs)
			require.Empty(t, errorStrings(check(objs)))
			k.expect(t, objs)
		})
	}
}

func errorStrings(errs []error) []string {
	out := make([]string, 0, len(errs))
	for _, e := range errs {
		out = append(out, e.Error())
	}
	return out
}

func find[T interface{ GetName() string }](objs []object, name string) T {
	var zero T
	for _, v := range ofKind[T](objs) {
		if v.GetName() == name {
			return v
		}
	}
	return zero
}

func workerContainers(t *testing.T, objs []object) map[string][]podAndContainer {
	t.Helper()
	out := map[string][]podAndContainer{}
	for _, p := range podTemplates(objs) {
		for _, c := range p.Template.Spec.Containers {
			if c.Name == "prefill" || c.Name == "decode" {
				out[c.Name] = append(out[c.Name], podAndContainer{p, c})
			}
		}
	}
	return out
}

type podAndContainer struct {
	pod podTemplate
	ctr corev1.Container
}

// parsed returns the configuration the binary would run with in this pod.
func (pc podAndContainer) parsed(t *testing.T, objs []object, pod fakePod) config.Config {
	t.Helper()
	env, err := containerEnv(pc.pod, pc.ctr, configMaps(objs), pod)
	require.NoError(t, err)
	cfg, err := config.Parse(worker.Role(pc.ctr.Name), pc.ctr.Args, func(k string) string { return env[k] }, io.Discard)
	require.NoError(t, err)
	return cfg
}

func expectBase(t *testing.T, objs []object) {
	require.NotNil(t, find[*appsv1.Deployment](objs, "prefill"))
	require.NotNil(t, find[*appsv1.Deployment](objs, "decode"))
	nats := find[*appsv1.StatefulSet](objs, "nats")
	require.NotNil(t, nats)
	require.EqualValues(t, 3, *nats.Spec.Replicas)
	for _, n := range []string{"prefill", "decode", "nats"} {
		require.NotNil(t, find[*policyv1.PodDisruptionBudget](objs, n), "PDB %s", n)
	}
	data := find[*corev1.Service](objs, "handoff-data")
	require.NotNil(t, data)
	require.Equal(t, corev1.ClusterIPNone, data.Spec.ClusterIP)
	pods, err := matching(objs, selectorOf(data.Spec.Selector))
	require.NoError(t, err)
	require.Len(t, pods, 2, "the data-plane Service selects prefill and decode pods")
	api := find[*corev1.Service](objs, "decode")
	require.NotNil(t, api)
	require.EqualValues(t, 8000, api.Spec.Ports[0].Port)

	ws := workerContainers(t, objs)
	require.Len(t, ws["prefill"], 1)
	require.Len(t, ws["decode"], 1)
	cfg := ws["prefill"][0].parsed(t, objs, fakePod{Name: "p", IP: "10.0.0.9"})
	require.Equal(t, "tcp", cfg.Transport, "the base runs on any cluster")
	// The part-of label reaches pod templates, not selectors.
	require.Equal(t, "handoff", ws["decode"][0].pod.Template.Labels["app.kubernetes.io/part-of"])
	require.NotContains(t, find[*appsv1.Deployment](objs, "decode").Spec.Selector.MatchLabels, "app.kubernetes.io/part-of")
}

func expectGPU(t *testing.T, objs []object) {
	ws := workerContainers(t, objs)
	for _, role := range []string{"prefill", "decode"} {
		require.Len(t, ws[role], 1, role)
		pc := ws[role][0]
		lim := pc.ctr.Resources.Limits
		gpu := lim[corev1.ResourceName("nvidia.com/gpu")]
		require.True(t, gpu.Cmp(resource.MustParse("1")) >= 0, "%s: nvidia.com/gpu limit", role)
		rdma := false
		for name := range lim {
			if strings.HasPrefix(string(name), "rdma/") || name == "nvidia.com/hostdev" {
				rdma = true
			}
		}
		require.True(t, rdma, "%s: an RDMA device request", role)
		var shm *corev1.Volume
		for _, m := range pc.ctr.VolumeMounts {
			if m.MountPath == "/dev/shm" {
				shm = volume(pc.pod, m.Name)
			}
		}
		require.NotNil(t, shm, "%s: /dev/shm volume", role)
		require.NotNil(t, shm.EmptyDir)
		require.Equal(t, corev1.StorageMediumMemory, shm.EmptyDir.Medium)
		cfg := pc.parsed(t, objs, fakePod{Name: "p", IP: "10.0.0.9"})
		require.Equal(t, "auto", cfg.Transport)
		// The base's hardening survives the patch.
		require.Contains(t, pc.ctr.SecurityContext.Capabilities.Drop, corev1.Capability("ALL"))
		require.Contains(t, pc.ctr.SecurityContext.Capabilities.Add, corev1.Capability("IPC_LOCK"))
		require.True(t, mounted(pc.ctr, "/tmp"))
	}
}

func expectLWS(t *testing.T, objs []object) {
	require.Nil(t, find[*appsv1.Deployment](objs, "prefill"), "the lws overlay replaces the Deployments")
	require.Nil(t, find[*appsv1.Deployment](objs, "decode"))
	lwss := ofKind[*leaderWorkerSet](objs)
	require.Len(t, lwss, 1)
	l := lwss[0]
	require.NotNil(t, l.Spec.LeaderWorkerTemplate.Size)
	require.GreaterOrEqual(t, *l.Spec.LeaderWorkerTemplate.Size, int32(2), "a slice is a decode leader and prefill workers")
	require.NotNil(t, l.Spec.LeaderWorkerTemplate.LeaderTemplate)

	ws := workerContainers(t, objs)
	require.Len(t, ws["decode"], 1)
	require.Len(t, ws["prefill"], 1)
	require.True(t, strings.HasSuffix(ws["decode"][0].pod.Owner, "/leader"))
	require.True(t, strings.HasSuffix(ws["prefill"][0].pod.Owner, "/worker"))

	// Leader and workers of one slice share a handoff namespace, and slices differ.
	nsOf := func(pc podAndContainer, group string) string {
		pc.pod.Injected = map[string]string{lwsGroupIndexLabel: group}
		return pc.parsed(t, objs, fakePod{Name: "x", IP: "10.0.0.9"}).Namespace
	}
	require.Equal(t, nsOf(ws["decode"][0], "0"), nsOf(ws["prefill"][0], "0"))
	require.NotEqual(t, nsOf(ws["decode"][0], "0"), nsOf(ws["decode"][0], "1"))

	// The API Service reaches the leaders only.
	api := find[*corev1.Service](objs, "decode")
	require.NotNil(t, api)
	pods, err := matching(objs, selectorOf(api.Spec.Selector))
	require.NoError(t, err)
	require.Len(t, pods, 1)
	require.True(t, strings.HasSuffix(pods[0].Owner, "/leader"))
}

func expectPodMonitor(t *testing.T, objs []object) {
	pms := ofKind[*monv1.PodMonitor](objs)
	require.Len(t, pms, 1)
	pods, err := matching(objs, &pms[0].Spec.Selector)
	require.NoError(t, err)
	roles := map[string]bool{}
	for _, p := range pods {
		roles[p.Template.Labels["app.kubernetes.io/component"]] = true
	}
	require.Equal(t, map[string]bool{"prefill": true, "decode": true}, roles)
}

// ---- strict decoding ----

func TestDecodeStrictRejects(t *testing.T) {
	deployment := `apiVersion: apps/v1
kind: Deployment
metadata:
  name: d
spec:
  %s
  selector:
    matchLabels: {a: b}
  template:
    metadata:
      labels: {a: b}
    spec:
      containers:
        - name: c
          image: i
          %s
`
	lws := `apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata:
  name: l
spec:
  %s
  leaderWorkerTemplate:
    size: 2
    %s
    workerTemplate:
      spec:
        containers:
          - name: c
            image: i
            %s
`
	tests := []struct {
		name string
		doc  string
		want string
	}{
		{"unknown field", fmt.Sprintf(deployment, "replicaz: 2", ""), "replicaz"},
		{"unknown container field", fmt.Sprintf(deployment, "replicas: 2", "imagee: x"), "imagee"},
		{"duplicate field", fmt.Sprintf(deployment, "replicas: 2\n  replicas: 3", ""), "replicas"},
		{"wrong type", fmt.Sprintf(deployment, "replicas: two", ""), "replicas"},
		{"unknown kind", "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\n", "Widget"},
		{"no name", "apiVersion: v1\nkind: ConfigMap\ndata: {}\n", "name"},
		{"lws unknown field", fmt.Sprintf(lws, "replicaz: 1", "", ""), "replicaz"},
		{"lws unknown pod field", fmt.Sprintf(lws, "replicas: 1", "", "imagee: x"), "imagee"},
		{"lws bad restart policy", fmt.Sprintf(lws, "replicas: 1", "restartPolicy: Sometimes", ""), "restartPolicy"},
		{"lws bad startup policy", fmt.Sprintf(lws, "startupPolicy: Eventually", "", ""), "startupPolicy"},
		{"lws no surge and no unavailability", fmt.Sprintf(lws, "rolloutStrategy:\n    type: RollingUpdate\n    rollingUpdateConfiguration:\n      maxUnavailable: 0\n      maxSurge: 0", "", ""), "maxSurge"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := decodeStrict([]byte(tt.doc))
			require.Error(t, err)
			require.Contains(t, err.Error(), tt.want)
		})
	}
	// The same documents without the mistakes decode.
	_, err := decodeStrict([]byte(fmt.Sprintf(deployment, "replicas: 2", "")))
	require.NoError(t, err)
	_, err = decodeStrict([]byte(fmt.Sprintf(lws, "replicas: 1", "restartPolicy: None", "")))
	require.NoError(t, err)
}

// ---- the checks find real mistakes ----

func mutateDeployment(name string, f func(*appsv1.Deployment)) func([]object) {
	return func(objs []object) { f(find[*appsv1.Deployment](objs, name)) }
}

func container(d *appsv1.Deployment) *corev1.Container { return &d.Spec.Template.Spec.Containers[0] }

func setEnv(c *corev1.Container, name, value string) {
	for i := range c.Env {
		if c.Env[i].Name == name {
			c.Env[i] = corev1.EnvVar{Name: name, Value: value}
			return
		}
	}
	c.Env = append(c.Env, corev1.EnvVar{Name: name, Value: value})
}

func TestChecksCatchMistakes(t *testing.T) {
	tests := []struct {
		name   string
		dir    string
		mutate func([]object)
		want   string
	}{
		{"readiness on the wrong port", "base", mutateDeployment("decode", func(d *appsv1.Deployment) {
			container(d).ReadinessProbe.HTTPGet.Port = intstr.FromInt32(9090)
		}), "readinessProbe port"},
		{"liveness on a path nobody serves", "base", mutateDeployment("prefill", func(d *appsv1.Deployment) {
			container(d).LivenessProbe.HTTPGet.Path = "/health/live"
		}), "not served"},
		{"readiness on the liveness path", "base", mutateDeployment("prefill", func(d *appsv1.Deployment) {
			container(d).ReadinessProbe.HTTPGet.Path = "/livez"
		}), `want "/readyz"`},
		{"admin address moved but not the port", "base", mutateDeployment("prefill", func(d *appsv1.Deployment) {
			setEnv(container(d), "HANDOFF_ADMIN_ADDR", ":9555")
		}), "admin"},
		{"grace shorter than the drain", "base", mutateDeployment("decode", func(d *appsv1.Deployment) {
			g := int64(20)
			d.Spec.Template.Spec.TerminationGracePeriodSeconds = &g
		}), "terminationGracePeriodSeconds"},
		{"drain longer than the grace", "base", func(objs []object) {
			configMaps(objs)["handoff-config"].Data["HANDOFF_DRAIN_TIMEOUT"] = "2m"
		}, "drain timeout"},
		{"bad value the binary rejects", "base", func(objs []object) {
			configMaps(objs)["handoff-config"].Data["HANDOFF_TRANSPORT"] = "carrier-pigeon"
		}, "rejects"},
		{"advertise address not from POD_IP", "base", mutateDeployment("prefill", func(d *appsv1.Deployment) {
			setEnv(container(d), "HANDOFF_DATA_ADVERTISE", "prefill:7400")
		}), "advertise"},
		{"POD_IP not from the downward API", "base", mutateDeployment("decode", func(d *appsv1.Deployment) {
			setEnv(container(d), "POD_IP", "10.1.2.3")
		}), "downward API"},
		{"selector misses its template", "base", mutateDeployment("prefill", func(d *appsv1.Deployment) {
			d.Spec.Selector.MatchLabels["app.kubernetes.io/component"] = "prefil"
		}), "does not match its template"},
		{"service selects nothing", "base", func(objs []object) {
			find[*corev1.Service](objs, "decode").Spec.Selector["app.kubernetes.io/component"] = "decoder"
		}, "matches no pod template"},
		{"service targets a missing port", "base", func(objs []object) {
			find[*corev1.Service](objs, "decode").Spec.Ports[0].TargetPort = intstr.FromString("api")
		}, "target api"},
		{"pdb selects nothing", "base", func(objs []object) {
			find[*policyv1.PodDisruptionBudget](objs, "decode").Spec.Selector.MatchLabels["app.kubernetes.io/name"] = "other"
		}, "PodDisruptionBudget/decode"},
		{"pdb across components", "base", func(objs []object) {
			delete(find[*policyv1.PodDisruptionBudget](objs, "decode").Spec.Selector.MatchLabels, "app.kubernetes.io/component")
		}, "several components"},
		{"NATS URL names no service", "base", func(objs []object) {
			configMaps(objs)["handoff-config"].Data["NATS_URL"] = "nats://nats-client:4222"
		}, "NATS URL"},
		{"scrape annotation on the wrong port", "base", mutateDeployment("decode", func(d *appsv1.Deployment) {
			d.Spec.Template.Annotations["prometheus.io/port"] = "8000"
		}), "prometheus.io/port"},
		{"no resource requests", "base", mutateDeployment("decode", func(d *appsv1.Deployment) {
			container(d).Resources.Requests = nil
		}), "requests"},
		{"short startup allowance", "base", mutateDeployment("decode", func(d *appsv1.Deployment) {
			container(d).StartupProbe.FailureThreshold = 3
		}), "startup allowance"},
		{"NATS routes miss a replica", "base", func(objs []object) {
			sts := find[*appsv1.StatefulSet](objs, "nats")
			r := int32(4)
			sts.Spec.Replicas = &r
		}, "routes"},
		{"NATS probe off the monitoring port", "base", func(objs []object) {
			sts := find[*appsv1.StatefulSet](objs, "nats")
			sts.Spec.Template.Spec.Containers[0].ReadinessProbe.HTTPGet.Port = intstr.FromString("client")
		}, "monitoring port"},
		{"JetStream store not on the claim", "base", func(objs []object) {
			sts := find[*appsv1.StatefulSet](objs, "nats")
			setEnv(&sts.Spec.Template.Spec.Containers[0], "HANDOFF_NATS_STORE_DIR", "/var/lib/nats")
		}, "JetStream store"},
		{"podmonitor on a missing port", "overlays/podmonitor", func(objs []object) {
			p := "metrics"
			ofKind[*monv1.PodMonitor](objs)[0].Spec.PodMetricsEndpoints[0].Port = &p
		}, `port "metrics"`},
		{"lws leader probe on the prefill admin port", "overlays/lws", func(objs []object) {
			l := ofKind[*leaderWorkerSet](objs)[0]
			l.Spec.LeaderWorkerTemplate.LeaderTemplate.Spec.Containers[0].LivenessProbe.HTTPGet.Port = intstr.FromInt32(9090)
		}, "livenessProbe port"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			objs, err := render(tt.dir)
			require.NoError(t, err)
			require.Empty(t, errorStrings(check(objs)), "clean before the mutation")
			tt.mutate(objs)
			errs := check(objs)
			require.NotEmpty(t, errs, "the mistake went unnoticed")
			require.Contains(t, errors.Join(errs...).Error(), tt.want)
		})
	}
}

func TestExpand(t *testing.T) {
	env := map[string]string{"POD_IP": "10.0.0.1", "G": "3"}
	tests := []struct{ in, want string }{
		{"$(POD_IP):7400", "10.0.0.1:7400"},
		{"slice-$(G)", "slice-3"},
		{"$(MISSING)", "$(MISSING)"},
		{"$$(POD_IP)", "$(POD_IP)"},
		{"plain", "plain"},
		{"$(POD_IP)$(G)", "10.0.0.13"},
	}
	for _, tt := range tests {
		require.Equal(t, tt.want, expand(tt.in, env), tt.in)
	}
}

func selectorOf(m map[string]string) *metav1.LabelSelector {
	return &metav1.LabelSelector{MatchLabels: m}
}
