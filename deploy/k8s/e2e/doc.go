// Package e2e runs handoff on a real Kubernetes control plane and kubelet:
// etcd, kube-apiserver, kube-controller-manager, kube-scheduler, a kubelet on
// containerd's CRI with the CNI bridge plugin, kube-proxy and CoreDNS, all on
// this host, on loopback and on a bridge of its own (198.18.0.0/15, the
// benchmarking range). The manifests of deploy/k8s are applied server-side and
// the workers run as pods; completions go through the decode Service.
//
// The tests are behind the k8s build tag and need root, containerd, runc, the
// CNI plugins and the binaries that scripts/k8s-e2e builds (deploy/k8s/cluster);
// without them they skip and say what is missing. Run them with
//
//	scripts/k8s-e2e
//
// See docs/kubernetes-e2e.md.
package e2e
