package service

import (
	"fmt"
	"net"

	"github.com/handoff-io/handoff/topology"
)

// nicAddr picks the data plane's listen address for caches in the memory
// of the GPU with the given UUID: on the NIC closest to that GPU (topology:
// the same PCIe switch first), when the configured address names no host
// and nothing is advertised instead. Peers then dial that NIC, so the
// staged tcp path's bytes cross the GPU's own switch rather than the
// system's. It returns addr unchanged, and why, when it does not move it:
// a host given, no GPU or NIC known, or the NIC without an address.
// addrsOf lists an interface's addresses (net.InterfaceByName's, in use).
func nicAddr(addr, advertise string, host topology.Host, uuid string, addrsOf func(iface string) ([]net.Addr, error)) (string, string) {
	if advertise != "" {
		return addr, "--data-advertise is set"
	}
	h, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr, fmt.Sprintf("listen address %q: %v", addr, err)
	}
	if ip := net.ParseIP(h); h != "" && (ip == nil || !ip.IsUnspecified()) {
		return addr, "the listen address names its host"
	}
	a, ok := host.BestNICForUUID(uuid, false)
	if !ok {
		return addr, "no NIC known for GPU " + uuid
	}
	as, err := addrsOf(a.NIC.Name)
	if err != nil {
		return addr, fmt.Sprintf("NIC %s: %v", a.NIC.Name, err)
	}
	var pick net.IP
	for _, x := range as {
		n, ok := x.(*net.IPNet)
		if !ok || !n.IP.IsGlobalUnicast() {
			continue
		}
		if n.IP.To4() != nil { // IPv4 first: what peers most often route
			pick = n.IP
			break
		}
		if pick == nil {
			pick = n.IP
		}
	}
	if pick == nil {
		return addr, "NIC " + a.NIC.Name + " has no unicast address"
	}
	return net.JoinHostPort(pick.String(), port), fmt.Sprintf("NIC %s, %s from the GPU", a.NIC.Name, a.Level)
}

// interfaceAddrs lists the addresses of the network interface name.
func interfaceAddrs(name string) ([]net.Addr, error) {
	ifc, err := net.InterfaceByName(name)
	if err != nil {
		return nil, err
	}
	return ifc.Addrs()
}
