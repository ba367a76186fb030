// Command pause is the pod sandbox's process for the end-to-end cluster: it
// holds the pod's namespaces and waits for SIGTERM or SIGINT. It is built on
// the test's host, so the sandbox image needs no registry.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	// As PID 1 of the sandbox it also reaps orphans; SIGCHLD is ignored so
	// the kernel does it.
	signal.Ignore(syscall.SIGCHLD)
	<-sig
}
