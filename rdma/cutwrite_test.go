package rdma

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A write cut by its context after some of its bytes landed fails its
// grant at once, not at the grant's deadline: the receiver learns the
// writer gave up the bytes it sent (tcp: the connection closes; ucx: the
// link resets), so the receiver's side can retry elsewhere now. The
// writer's link stays usable: a second write into a fresh grant lands.
func TestCutWriteFailsItsGrant(t *testing.T) {
	for _, tr := range append([]Transport{TransportTCP, TransportSHM}, ucxTestTransports()...) {
		if tr == TransportSHM && !shmSupported {
			continue
		}
		t.Run(string(tr), func(t *testing.T) {
			const size = 16 << 20
			rx, err := New(Config{Agent: "cut-rx", Transports: []Transport{tr}, Logger: quietLogger()})
			require.NoError(t, err)
			defer rx.Close()
			_, err = rx.Register("dst", size)
			require.NoError(t, err)
			tx, err := New(Config{Agent: "cut-tx", Transports: []Transport{tr}, Logger: quietLogger()})
			require.NoError(t, err)
			defer tx.Close()
			src, err := tx.Register("src", size)
			require.NoError(t, err)
			fill(src.Bytes(), 7)
			_, err = tx.Connect(context.Background(), rx.Descriptor())
			require.NoError(t, err)

			g, err := rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{1, 0, size}}, Deadline: time.Now().Add(time.Minute)})
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var once sync.Once
			tx.hooks.Store(&hooks{writing: func(_ *Ticket, n uint64) {
				if n > 0 { // bytes of this write went out before this step
					once.Do(cancel)
				}
			}})
			_, err = tx.Write(ctx, rx.Descriptor(), g.Ticket(), []Extent{{src.ID(), 0, size}})
			require.ErrorIs(t, err, context.Canceled)
			tx.hooks.Store(nil)

			wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer wcancel()
			start := time.Now()
			_, err = g.Wait(wctx)
			require.Error(t, err)
			require.NoError(t, wctx.Err(), "the grant was still open 10 s after its write was cut")
			t.Logf("grant failed %v after the cut: %v", time.Since(start), err)

			g2, err := rx.OpenGrant(GrantSpec{RequestID: 2, Extents: []Extent{{1, 0, 1 << 20}}, Deadline: time.Now().Add(time.Minute)})
			require.NoError(t, err)
			_, err = tx.Write(context.Background(), rx.Descriptor(), g2.Ticket(), []Extent{{src.ID(), 0, 1 << 20}})
			require.NoError(t, err)
			_, err = g2.Wait(wctx)
			require.NoError(t, err)
		})
	}
}

// A write cut by its context fails its own grant only: another write to
// the same peer, with bytes landed and more to send when the cut comes,
// commits (ucx: both go over one link, which the cut must not reset).
func TestCutWriteSparesOtherWrites(t *testing.T) {
	for _, tr := range append([]Transport{TransportTCP, TransportSHM}, ucxTestTransports()...) {
		if tr == TransportSHM && !shmSupported {
			continue
		}
		t.Run(string(tr), func(t *testing.T) {
			const size = 32 << 20
			rx, err := New(Config{Agent: "spare-rx", Transports: []Transport{tr}, Logger: quietLogger()})
			require.NoError(t, err)
			defer rx.Close()
			_, err = rx.Register("dst", 2*size)
			require.NoError(t, err)
			tx, err := New(Config{Agent: "spare-tx", Transports: []Transport{tr}, Logger: quietLogger()})
			require.NoError(t, err)
			defer tx.Close()
			src, err := tx.Register("src", size)
			require.NoError(t, err)
			fill(src.Bytes(), 9)
			_, err = tx.Connect(context.Background(), rx.Descriptor())
			require.NoError(t, err)

			deadline := time.Now().Add(time.Minute)
			ga, err := rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{1, 0, size}}, Deadline: deadline})
			require.NoError(t, err)
			gb, err := rx.OpenGrant(GrantSpec{RequestID: 2, Extents: []Extent{{1, size, size}}, Deadline: deadline})
			require.NoError(t, err)

			// b sends some bytes, then waits while a is cut (up to a
			// bound: a transport that serialises writes to a peer must
			// not deadlock the test); a is cut once b's bytes went out.
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			bSent, aDone := make(chan struct{}), make(chan struct{})
			var bOnce, aOnce sync.Once
			tx.hooks.Store(&hooks{writing: func(tk *Ticket, n uint64) {
				switch {
				case tk.Grant == gb.ID() && n > 0:
					bOnce.Do(func() {
						close(bSent)
						select {
						case <-aDone:
						case <-time.After(5 * time.Second):
						}
					})
				case tk.Grant == ga.ID() && n > 0:
					aOnce.Do(func() {
						select {
						case <-bSent:
						case <-time.After(5 * time.Second):
						}
						cancel()
					})
				}
			}})
			bErr := make(chan error, 1)
			go func() {
				_, err := tx.Write(context.Background(), rx.Descriptor(), gb.Ticket(), []Extent{{src.ID(), 0, size}})
				bErr <- err
			}()
			_, err = tx.Write(ctx, rx.Descriptor(), ga.Ticket(), []Extent{{src.ID(), 0, size}})
			close(aDone)
			require.ErrorIs(t, err, context.Canceled)
			require.NoError(t, <-bErr, "a write was failed by another write's cut")
			tx.hooks.Store(nil)

			wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer wcancel()
			_, err = gb.Wait(wctx)
			require.NoError(t, err)
			_, err = ga.Wait(wctx)
			require.Error(t, err)
			require.NoError(t, wctx.Err(), "the cut write's grant was still open 10 s after the cut")
		})
	}
}
