// Package k8s holds the Kubernetes manifests of handoff (kustomize base and
// overlays) and the tests that render and validate them without a cluster.
package k8s
