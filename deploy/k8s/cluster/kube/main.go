// Command kube is the Kubernetes control plane and node of the end-to-end
// test in one binary: etcd, kube-apiserver, kube-controller-manager,
// kube-scheduler, kubelet, kube-proxy and kubectl, built from their Go modules
// at the versions pinned in this module's go.mod. One binary links once, which
// on a small build machine saves minutes over seven.
//
// The component is the first argument, or the name the binary was called by
// (a symlink named kube-apiserver runs the API server):
//
//	kube apiserver --etcd-servers=... ...
//	kube kubectl get pods
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	_ "time/tzdata" // CronJob time zones, as kube-apiserver's own main

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectlcmd "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

// components maps each name (and its kube- prefixed alias) to its command.
var components = map[string]func() *cobra.Command{
	"apiserver":          apiserver.NewAPIServerCommand,
	"controller-manager": controllermanager.NewControllerManagerCommand,
	"scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
	"kubelet":            func() *cobra.Command { return kubelet.NewKubeletCommand(context.Background()) },
	"proxy":              proxy.NewProxyCommand,
}

func main() {
	name, args := component(os.Args)
	switch name {
	case "etcd":
		etcdmain.Main(append([]string{"etcd"}, args...))
		return
	case "kubectl":
		os.Args = append([]string{"kubectl"}, args...)
		command := kubectlcmd.NewDefaultKubectlCommand()
		if err := cli.RunNoErrOutput(command); err != nil {
			kubectlutil.CheckErr(err)
		}
		return
	}
	newCommand, ok := components[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "kube: unknown component %q; want one of %s\n", name, strings.Join(names(), ", "))
		os.Exit(2)
	}
	command := newCommand()
	command.SetArgs(args)
	os.Exit(cli.Run(command))
}

// component picks the component from the program name or, when the binary
// is called as kube, from the first argument.
func component(argv []string) (string, []string) {
	base := strings.TrimPrefix(filepath.Base(argv[0]), "kube-")
	if base != "kube" {
		return base, argv[1:]
	}
	if len(argv) < 2 {
		return "", nil
	}
	return strings.TrimPrefix(argv[1], "kube-"), argv[2:]
}

func names() []string {
	out := []string{"etcd", "kubectl"}
	for n := range components {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}
