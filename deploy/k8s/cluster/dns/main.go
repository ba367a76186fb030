// Command dns is the end-to-end cluster's DNS server: CoreDNS with only the
// plugins the test's Corefile uses, so that the Services' names resolve
// (nats.<namespace>, nats-0.nats-headless, ...) without building CoreDNS's
// cloud and storage plugins. It is its own module so that CoreDNS's
// dependency versions stay apart from the control plane's.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() {
	coremain.Run()
}

// The plugins' order in a server block, as CoreDNS's plugin.cfg orders them.
func init() {
	dnsserver.Directives = []string{"bind", "errors", "log", "health", "ready", "cache", "kubernetes"}
}
