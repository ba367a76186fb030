package service

import (
	"fmt"
	"log/slog"
	"net"

	"github.com/handoff-io/handoff/internal/topology"
	"github.com/handoff-io/handoff/rdma"
)

// nicAdvertise picks the address peers dial for a data plane whose caches
// are in the memory of the GPU with the given UUID: the address of the NIC
// closest to that GPU (topology: the same PCIe switch first), with the
// listen address's port, when the listen address names no host (a
// wildcard: ":7400", "0.0.0.0:7400", "[::]:7400") and nothing is advertised
// instead. Peers then dial that NIC, so the staged tcp path's bytes cross
// the GPU's own switch rather than the system's.
//
// Only the advertised address moves. The listener stays as configured: a
// wildcard still accepts on every interface, so a peer that routes to
// this host through another one (or is told another address) still
// connects, and a listen or advertised address the operator gave is
// honoured as given. A listen port of 0 is advertised as 0, which
// rdma.Config.Advertise takes for the listener's port.
//
// It returns advertise unchanged, and why, when it does not move it: an
// address given, no GPU or NIC known, or the NIC without a unicast
// address. addrsOf lists an interface's addresses (net.InterfaceByName's,
// in use).
func nicAdvertise(addr, advertise string, host topology.Host, uuid string, addrsOf func(iface string) ([]net.Addr, error)) (string, string) {
	if advertise != "" {
		return advertise, "an advertised address is set (--data-advertise, or $POD_IP)"
	}
	h, port, err := net.SplitHostPort(addr)
	if err != nil {
		return advertise, fmt.Sprintf("listen address %q: %v", addr, err)
	}
	if ip := net.ParseIP(h); h != "" && (ip == nil || !ip.IsUnspecified()) {
		return advertise, "the listen address names its host"
	}
	a, ok := host.BestNICForUUID(uuid, false)
	if !ok {
		return advertise, "no NIC known for GPU " + uuid
	}
	as, err := addrsOf(a.NIC.Name)
	if err != nil {
		return advertise, fmt.Sprintf("NIC %s: %v", a.NIC.Name, err)
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
		return advertise, "NIC " + a.NIC.Name + " has no unicast address"
	}
	return net.JoinHostPort(pick.String(), port), fmt.Sprintf("NIC %s, %s from the GPU", a.NIC.Name, a.Level)
}

// gpuDataPath points the peers of a data plane whose caches are on the GPU
// uuid at that GPU's NIC (nicAdvertise: rc.Advertise may change, never
// rc.TCPAddr), and logs what it listens on, what peers dial and why.
func gpuDataPath(rc *rdma.Config, host topology.Host, uuid string, addrsOf func(iface string) ([]net.Addr, error), log *slog.Logger) {
	adv, why := nicAdvertise(rc.TCPAddr, rc.Advertise, host, uuid, addrsOf)
	if adv == rc.Advertise {
		shown := adv
		if shown == "" {
			shown = "the listener's (for a wildcard, the host name)"
		}
		log.Info("data path for the GPU's caches: advertised address not moved to the GPU's NIC",
			"listen", rc.TCPAddr, "advertise", shown, "why", why)
		return
	}
	log.Info("data path for the GPU's caches: peers dial the GPU's NIC; the listener keeps every interface",
		"listen", rc.TCPAddr, "advertise", adv, "why", why)
	rc.Advertise = adv
}

// interfaceAddrs lists the addresses of the network interface name.
func interfaceAddrs(name string) ([]net.Addr, error) {
	ifc, err := net.InterfaceByName(name)
	if err != nil {
		return nil, err
	}
	return ifc.Addrs()
}
