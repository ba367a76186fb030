package wire

import (
	"bytes"
	"sync"

	"github.com/handoff-io/handoff/rdma"
)

// PeerCache keeps the last Peer a prefill worker decoded, by its wire bytes,
// with its descriptor. Both are shared, read-only, by every request that
// names the same peer. The zero value is ready; it is safe for concurrent
// use.
type PeerCache struct {
	mu   sync.Mutex
	raw  []byte
	peer Peer
	desc *rdma.Descriptor
}

// DecodePrefillRequest is DecodePrefillRequest returning the peer's
// descriptor too: a prefill worker hears from the same decoders over and
// over, and a peer whose wire bytes are those of the last one is not decoded
// again.
func (c *PeerCache) DecodePrefillRequest(b []byte) (PrefillRequest, rdma.Descriptor, error) {
	return decodePrefillRequest(b, c)
}

// decode reads a Peer into p, from the cache when its bytes are the last
// ones, and sets r.desc.
func (c *PeerCache) decode(r *reader, p *Peer) error {
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
