package transfer

import (
	"time"

	"github.com/handoff-io/handoff/rdma"
)

// watchWriters treats a prefill instance that closed its last data-path
// connection to this decoder (rdma.Engine.OnWriterGone: a worker killed
// with SIGKILL, an engine closed; a live engine never lets its last
// connection go) as dead, as a registry expiry does, but at once: a handoff
// addressed to it is fenced and re-granted to a live instance in
// milliseconds instead of after the registry TTL. Even a wrong report would
// cost a retry, never a wrong byte: the old grant is revoked first.
func (d *Decoder) watchWriters(eng *rdma.Engine) {
	d.unwatch = eng.OnWriterGone(func(a rdma.AgentID) {
		for _, id := range d.instancesOf(string(a)) {
			d.peerDied(id)
		}
	})
}

// instancesOf lists the prefill instances whose data-path agent is agent:
// the registry's entries that name it, and the agent itself (the workers use
// their instance id as agent id).
func (d *Decoder) instancesOf(agent string) []string {
	ids := []string{agent}
	if d.reg != nil {
		for _, inst := range d.reg.Instances(RolePrefill, time.Now()) {
			if inst.Peer.Agent == agent && inst.ID != agent {
				ids = append(ids, inst.ID)
			}
		}
	}
	return ids
}
