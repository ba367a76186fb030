package transfer

import (
	"bytes"
	"sync"

	"github.com/handoff-io/handoff/rdma"
)

// peerCache keeps the last Peer a prefill worker decoded, by its wire bytes,
// with its descriptor. Both are shared, read-only, by every request that
// names the same peer.
type peerCache struct {
	mu   sync.Mutex
	raw  []byte
	peer Peer
	desc *rdma.Descriptor
}

// decode reads a Peer into p, from the cache when its bytes are the last
// ones, and sets r.desc.
func (c *peerCache) decode(r *reader, p *Peer) error {
	start := r.b
	if err := r.skip(); err != nil {
		return err
	}
	raw := start[:len(start)-len(r.b)]
	c.mu.Lock()
	if bytes.Equal(raw, c.raw) {
		*p, r.desc = c.peer, c.desc
		c.mu.Unlock()
		return nil
	}
	c.mu.Unlock()
	if err := p.decode(&reader{b: raw}); err != nil {
		return err
	}
	desc := p.Descriptor()
	r.desc = &desc
	c.mu.Lock()
	c.raw, c.peer, c.desc = bytes.Clone(raw), *p, r.desc
	c.mu.Unlock()
	return nil
}
