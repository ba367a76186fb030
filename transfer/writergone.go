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
//
// New handoffs pass such an instance over (pick) until its registry entry
// shows a heartbeat after the report: its entry stays fresh for up to the
// TTL after a SIGKILL, and a request sent to it would spend an attempt on a
// no-responders.
func (d *Decoder) watchWriters(eng *rdma.Engine) {
	d.unwatch = eng.OnWriterGone(func(a rdma.AgentID) { d.writerGone(string(a)) })
}

func (d *Decoder) writerGone(agent string) {
	ids := []string{agent} // the workers use their instance id as agent id
	var entries []Instance // the registry's entries that name the agent
	if d.reg != nil {
		for _, inst := range d.reg.Instances(RolePrefill, time.Now()) {
			if inst.Peer.Agent == agent || inst.ID == agent {
				entries = append(entries, inst)
				if inst.ID != agent {
					ids = append(ids, inst.ID)
				}
			}
		}
	}
	d.mu.Lock()
	if d.gone == nil {
		d.gone = make(map[string]int64)
	}
	for _, inst := range entries {
		d.gone[inst.ID] = inst.Updated
	}
	d.mu.Unlock()
	for _, id := range ids {
		d.peerDied(id)
	}
}
