package rdma

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// cancelAfter is a context whose Err turns to Canceled after n calls: a
// cancel that lands at a chosen point of a write.
type cancelAfter struct {
	context.Context
	n atomic.Int32
}

func (c *cancelAfter) Err() error {
	if c.n.Add(-1) < 0 {
		return context.Canceled
	}
	return nil
}

// An inproc write cancelled after part of it landed fails the grant at
// once, as tcp (connection dropped) and shm (abort frame) do, instead of
// leaving it open with partial bytes until its deadline.
func TestInprocCancelledWriteFailsGrant(t *testing.T) {
	p := newPair(t, TransportInproc)
	exts := make([]Extent, 200) // the write checks ctx every 64 pieces
	for i := range exts {
		exts[i] = Extent{Region: 1, Offset: uint64(i) * 2048, Length: 1024}
	}
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 3, Extents: exts})
	require.NoError(t, err)
	ctx := &cancelAfter{Context: context.Background()}
	ctx.n.Store(2) // Write's own check and the first piece's pass; the next one cancels
	_, err = p.tx.Write(ctx, p.rx.Descriptor(), g.Ticket(), []Extent{{Region: 1, Offset: 0, Length: g.Ticket().Bytes}})
	require.ErrorIs(t, err, context.Canceled)
	select {
	case <-g.Failed():
	default:
		t.Fatal("the grant is still open after its writer cancelled mid-write")
	}
	require.ErrorIs(t, g.Err(), ErrPeerClosed)
}
