package k8s

import (
	"fmt"
	"path/filepath"
	"regexp"
	"sort"

	monv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// scheme knows every built-in and operator kind the manifests may use; a kind
// outside it (and outside the local LeaderWorkerSet mirror) fails validation.
var scheme = func() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		corev1.AddToScheme, appsv1.AddToScheme, policyv1.AddToScheme, monv1.AddToScheme,
	} {
		if err := add(s); err != nil {
			panic(err)
		}
	}
	return s
}()

// strictDecoder rejects unknown and duplicate fields.
var strictDecoder = serializer.NewCodecFactory(scheme, serializer.EnableStrict).UniversalDeserializer()

// object is one rendered manifest, decoded into its API type.
type object struct {
	Kind string
	Name string
	Obj  any // *appsv1.Deployment, *corev1.Service, *leaderWorkerSet, ...
}

// render builds a kustomization directory with the kustomize Go API and
// decodes every resource strictly.
func render(dir string) ([]object, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	rm, err := k.Run(filesys.MakeFsOnDisk(), abs)
	if err != nil {
		return nil, fmt.Errorf("kustomize %s: %w", dir, err)
	}
	var out []object
	for _, r := range rm.Resources() {
		raw, err := r.AsYAML()
		if err != nil {
			return nil, fmt.Errorf("%s: %s/%s: %w", dir, r.GetKind(), r.GetName(), err)
		}
		o, err := decodeStrict(raw)
		if err != nil {
			return nil, fmt.Errorf("%s: %s/%s: %w", dir, r.GetKind(), r.GetName(), err)
		}
		out = append(out, o)
	}
	return out, nil
}

// decodeStrict decodes one manifest into its Kubernetes API type, failing on
// unknown kinds, unknown fields and duplicate fields.
func decodeStrict(raw []byte) (object, error) {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(raw, &tm); err != nil {
		return object{}, err
	}
	if tm.APIVersion == lwsAPIVersion && tm.Kind == "LeaderWorkerSet" {
		var l leaderWorkerSet
		if err := yaml.UnmarshalStrict(raw, &l); err != nil {
			return object{}, fmt.Errorf("strict decoding LeaderWorkerSet: %w", err)
		}
		if err := l.validate(); err != nil {
			return object{}, err
		}
		return object{Kind: tm.Kind, Name: l.Name, Obj: &l}, nil
	}
	obj, gvk, err := strictDecoder.Decode(raw, nil, nil)
	if err != nil {
		return object{}, fmt.Errorf("strict decoding %s %s: %w", tm.APIVersion, tm.Kind, err)
	}
	m, err := metaName(obj)
	if err != nil {
		return object{}, err
	}
	return object{Kind: gvk.Kind, Name: m, Obj: obj}, nil
}

func metaName(obj runtime.Object) (string, error) {
	a, ok := obj.(metav1.Object)
	if !ok {
		return "", fmt.Errorf("%T has no metadata", obj)
	}
	if a.GetName() == "" {
		return "", fmt.Errorf("%T without a name", obj)
	}
	return a.GetName(), nil
}

// ---- LeaderWorkerSet ----
//
// The LWS Go types (sigs.k8s.io/lws) are not a dependency of this module, so
// LeaderWorkerSets are decoded into this mirror of the fields of
// leaderworkerset.x-k8s.io/v1 that the manifests use. Decoding is strict, so a
// field the mirror lacks fails; pod templates are the real corev1 types.

const lwsAPIVersion = "leaderworkerset.x-k8s.io/v1"

type leaderWorkerSet struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              lwsSpec `json:"spec"`
}

type lwsSpec struct {
	Replicas             *int32      `json:"replicas,omitempty"`
	LeaderWorkerTemplate lwsTemplate `json:"leaderWorkerTemplate"`
	RolloutStrategy      *lwsRollout `json:"rolloutStrategy,omitempty"`
	StartupPolicy        string      `json:"startupPolicy,omitempty"`
	NetworkConfig        *lwsNetwork `json:"networkConfig,omitempty"`
}

type lwsTemplate struct {
	LeaderTemplate *corev1.PodTemplateSpec `json:"leaderTemplate,omitempty"`
	WorkerTemplate corev1.PodTemplateSpec  `json:"workerTemplate"`
	Size           *int32                  `json:"size,omitempty"`
	RestartPolicy  string                  `json:"restartPolicy,omitempty"`
}

type lwsRollout struct {
	Type                       string            `json:"type"`
	RollingUpdateConfiguration *lwsRollingUpdate `json:"rollingUpdateConfiguration,omitempty"`
}

type lwsRollingUpdate struct {
	Partition      *int32              `json:"partition,omitempty"`
	MaxUnavailable *intstr.IntOrString `json:"maxUnavailable,omitempty"`
	MaxSurge       *intstr.IntOrString `json:"maxSurge,omitempty"`
}

type lwsNetwork struct {
	SubdomainPolicy *string `json:"subdomainPolicy"`
}

// lwsGroupIndexLabel is the label LWS puts on every pod of a group.
const lwsGroupIndexLabel = "leaderworkerset.sigs.k8s.io/group-index"

func oneOf(field, v string, allowed ...string) error {
	for _, a := range allowed {
		if v == a {
			return nil
		}
	}
	return fmt.Errorf("LeaderWorkerSet %s %q: want one of %v", field, v, allowed)
}

// validate applies the enum and range rules of the LWS CRD schema to the
// fields used.
func (l *leaderWorkerSet) validate() error {
	if l.Name == "" {
		return fmt.Errorf("LeaderWorkerSet without a name")
	}
	s := l.Spec
	if s.Replicas != nil && *s.Replicas < 0 {
		return fmt.Errorf("LeaderWorkerSet %s: negative replicas", l.Name)
	}
	if t := s.LeaderWorkerTemplate; t.Size != nil && *t.Size < 1 {
		return fmt.Errorf("LeaderWorkerSet %s: size %d below 1", l.Name, *t.Size)
	}
	if s.StartupPolicy != "" {
		if err := oneOf("startupPolicy", s.StartupPolicy, "LeaderCreated", "LeaderReady"); err != nil {
			return err
		}
	}
	if p := s.LeaderWorkerTemplate.RestartPolicy; p != "" {
		if err := oneOf("restartPolicy", p, "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None", "Default"); err != nil {
			return err
		}
	}
	if n := s.NetworkConfig; n != nil && n.SubdomainPolicy != nil {
		if err := oneOf("subdomainPolicy", *n.SubdomainPolicy, "Shared", "UniquePerReplica"); err != nil {
			return err
		}
	}
	if r := s.RolloutStrategy; r != nil {
		if err := oneOf("rolloutStrategy.type", r.Type, "RollingUpdate"); err != nil {
			return err
		}
		if c := r.RollingUpdateConfiguration; c != nil {
			zero := func(v *intstr.IntOrString) bool {
				return v == nil || (v.Type == intstr.Int && v.IntVal == 0) || (v.Type == intstr.String && v.StrVal == "0%")
			}
			// maxUnavailable defaults to 1 when unset; it may be 0 only with a surge.
			if c.MaxUnavailable != nil && zero(c.MaxUnavailable) && zero(c.MaxSurge) {
				return fmt.Errorf("LeaderWorkerSet %s: maxUnavailable and maxSurge cannot both be 0", l.Name)
			}
		}
	}
	return nil
}

// ---- views over rendered objects ----

// podTemplate is a pod template together with where it came from.
type podTemplate struct {
	Owner    string // kind/name
	Selector *metav1.LabelSelector
	Template corev1.PodTemplateSpec
	// Extra labels the controller adds to its pods (LWS group index).
	Injected map[string]string
	// Volume claim templates whose volumes the controller adds (StatefulSet).
	Claims []string
}

func claimNames(vcts []corev1.PersistentVolumeClaim) []string {
	var out []string
	for _, v := range vcts {
		out = append(out, v.Name)
	}
	return out
}

func podTemplates(objs []object) []podTemplate {
	var out []podTemplate
	for _, o := range objs {
		switch v := o.Obj.(type) {
		case *appsv1.Deployment:
			out = append(out, podTemplate{Owner: "Deployment/" + v.Name, Selector: v.Spec.Selector, Template: v.Spec.Template})
		case *appsv1.StatefulSet:
			out = append(out, podTemplate{Owner: "StatefulSet/" + v.Name, Selector: v.Spec.Selector, Template: v.Spec.Template, Claims: claimNames(v.Spec.VolumeClaimTemplates)})
		case *leaderWorkerSet:
			inj := map[string]string{lwsGroupIndexLabel: "0"}
			if lt := v.Spec.LeaderWorkerTemplate.LeaderTemplate; lt != nil {
				out = append(out, podTemplate{Owner: "LeaderWorkerSet/" + v.Name + "/leader", Template: *lt, Injected: inj})
			}
			out = append(out, podTemplate{Owner: "LeaderWorkerSet/" + v.Name + "/worker", Template: v.Spec.LeaderWorkerTemplate.WorkerTemplate, Injected: inj})
		}
	}
	return out
}

func ofKind[T any](objs []object) []T {
	var out []T
	for _, o := range objs {
		if v, ok := o.Obj.(T); ok {
			out = append(out, v)
		}
	}
	return out
}

func configMaps(objs []object) map[string]*corev1.ConfigMap {
	m := map[string]*corev1.ConfigMap{}
	for _, cm := range ofKind[*corev1.ConfigMap](objs) {
		m[cm.Name] = cm
	}
	return m
}

// podLabels is what the pods of a template carry: template labels plus what
// the controller injects.
func (p podTemplate) podLabels() map[string]string {
	l := map[string]string{}
	for k, v := range p.Template.Labels {
		l[k] = v
	}
	for k, v := range p.Injected {
		l[k] = v
	}
	return l
}

// ---- container environment as the kubelet builds it ----

var envRef = regexp.MustCompile(`\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)`)

// expand resolves $(VAR) references against the variables defined so far, the
// way the kubelet does: unknown references stay as written, $$ escapes.
func expand(s string, env map[string]string) string {
	return envRef.ReplaceAllStringFunc(s, func(m string) string {
		if m == "$$" {
			return "$"
		}
		name := m[2 : len(m)-1]
		if v, ok := env[name]; ok {
			return v
		}
		return m
	})
}

// fakePod stands for the values the downward API would give one pod.
type fakePod struct {
	Name      string
	Namespace string
	IP        string
}

// containerEnv builds the environment of container c in pod template p:
// envFrom ConfigMaps first, then env in order, with downward-API fields
// filled from pod.
func containerEnv(p podTemplate, c corev1.Container, cms map[string]*corev1.ConfigMap, pod fakePod) (map[string]string, error) {
	env := map[string]string{}
	for _, ef := range c.EnvFrom {
		if ef.ConfigMapRef == nil {
			return nil, fmt.Errorf("%s: envFrom other than a ConfigMap is not checked", p.Owner)
		}
		cm, ok := cms[ef.ConfigMapRef.Name]
		if !ok {
			if ef.ConfigMapRef.Optional != nil && *ef.ConfigMapRef.Optional {
				continue
			}
			return nil, fmt.Errorf("%s: envFrom names ConfigMap %q, which is not rendered", p.Owner, ef.ConfigMapRef.Name)
		}
		for k, v := range cm.Data {
			env[ef.Prefix+k] = v
		}
	}
	labels := p.podLabels()
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = expand(e.Value, env)
		case e.ValueFrom.FieldRef != nil:
			v, err := fieldRef(e.ValueFrom.FieldRef.FieldPath, pod, labels)
			if err != nil {
				return nil, fmt.Errorf("%s: env %s: %w", p.Owner, e.Name, err)
			}
			env[e.Name] = v
		case e.ValueFrom.ConfigMapKeyRef != nil:
			ref := e.ValueFrom.ConfigMapKeyRef
			cm, ok := cms[ref.Name]
			if !ok {
				return nil, fmt.Errorf("%s: env %s: ConfigMap %q not rendered", p.Owner, e.Name, ref.Name)
			}
			v, ok := cm.Data[ref.Key]
			if !ok {
				return nil, fmt.Errorf("%s: env %s: ConfigMap %q has no key %q", p.Owner, e.Name, ref.Name, ref.Key)
			}
			env[e.Name] = v
		default:
			return nil, fmt.Errorf("%s: env %s: source not checked", p.Owner, e.Name)
		}
	}
	return env, nil
}

var labelPath = regexp.MustCompile(`^metadata\.labels\['([^']+)'\]$`)

func fieldRef(path string, pod fakePod, labels map[string]string) (string, error) {
	switch path {
	case "metadata.name":
		return pod.Name, nil
	case "metadata.namespace":
		return pod.Namespace, nil
	case "status.podIP":
		return pod.IP, nil
	}
	if m := labelPath.FindStringSubmatch(path); m != nil {
		v, ok := labels[m[1]]
		if !ok {
			return "", fmt.Errorf("pods carry no label %q", m[1])
		}
		return v, nil
	}
	return "", fmt.Errorf("field path %q not checked", path)
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
