package rdma

import (
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// restartedPeer starts an engine as agent, closes it and starts another
// under the same agent: a worker restarted under its stable instance id.
// It returns the dead incarnation's descriptor and a ticket of its, and
// the live engine.
func restartedPeer(t *testing.T, agent AgentID, tr Transport, size uint64) (Descriptor, Ticket, *Engine) {
	t.Helper()
	cfg := Config{Agent: agent, Transports: []Transport{tr}, Logger: quietLogger()}
	rx1, err := New(cfg)
	require.NoError(t, err)
	_, err = rx1.Register("dst", int64(size))
	require.NoError(t, err)
	g, err := rx1.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{1, 0, size}}, Deadline: time.Now().Add(time.Minute)})
	require.NoError(t, err)
	old, oldTicket := rx1.Descriptor(), g.Ticket()
	require.NoError(t, rx1.Close())
	rx2, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { rx2.Close() })
	_, err = rx2.Register("dst", int64(size))
	require.NoError(t, err)
	require.Greater(t, rx2.Descriptor().Incarnation, old.Incarnation)
	return old, oldTicket, rx2
}

func newWriter(t *testing.T, tr Transport, size uint64) (*Engine, *Region) {
	t.Helper()
	tx, err := New(Config{Agent: "p1", Transports: []Transport{tr}, Logger: quietLogger()})
	require.NoError(t, err)
	t.Cleanup(func() { tx.Close() })
	src, err := tx.Register("src", int64(size))
	require.NoError(t, err)
	fill(src.Bytes(), 3)
	return tx, src
}

// Regression: a decode worker restarted under the same agent id (its
// instance id) has a new descriptor, while the prefill worker's tasks of the
// old incarnation still Connect, Write and OpenStream with the old one.
// peerFor used to let any changed descriptor replace the agent's link, so
// each such call closed the live link to the new incarnation, cutting its
// write in flight ("connection closed before commit"), and dialed the dead
// address; old and new tasks kept swapping the link. An older incarnation's
// descriptor must now fail with ErrStaleDescriptor and leave the link alone.
func TestStaleDescriptorKeepsLiveLink(t *testing.T) {
	const size = 16 << 20
	old, oldTicket, rx := restartedPeer(t, "d1", TransportTCP, size)
	tx, src := newWriter(t, TransportTCP, size)
	live := rx.Descriptor()
	_, err := tx.Connect(context.Background(), live)
	require.NoError(t, err)

	g, err := rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{1, 0, size}}, Deadline: time.Now().Add(time.Minute)})
	require.NoError(t, err)
	held, release := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	tx.hooks.Store(&hooks{writing: func(_ *Ticket, n uint64) {
		if n > 0 && first.CompareAndSwap(false, true) {
			close(held)
			<-release
		}
	}})
	var releaseOnce sync.Once
	letGo := func() { releaseOnce.Do(func() { close(release) }) }
	defer letGo() // before the writer's Close, which waits for the write
	done := make(chan error, 1)
	go func() {
		_, err := tx.Write(context.Background(), live, g.Ticket(), []Extent{{src.ID(), 0, size}})
		done <- err
	}()
	<-held

	// The old incarnation's tasks, while the live write is in flight.
	_, err = tx.Connect(context.Background(), old)
	require.ErrorIs(t, err, ErrStaleDescriptor)
	require.ErrorIs(t, err, ErrPeerClosed)
	_, err = tx.Write(context.Background(), old, oldTicket, []Extent{{src.ID(), 0, size}})
	require.ErrorIs(t, err, ErrStaleDescriptor)
	_, err = tx.OpenStream(context.Background(), old, oldTicket)
	require.ErrorIs(t, err, ErrStaleDescriptor)

	letGo()
	require.NoError(t, <-done, "the live incarnation's write was cut by a stale descriptor")
	tr, ok := tx.TransportFor("d1")
	require.True(t, ok)
	require.Equal(t, TransportTCP, tr)
}

// After a peer restarts, the first write with its new descriptor replaces
// the link to the dead incarnation and lands; the old descriptor is stale
// from then on, and the new link keeps serving.
func TestPeerRestartNewDescriptorReplacesLink(t *testing.T) {
	for _, tr := range []Transport{TransportTCP, TransportSHM, TransportUCX} {
		t.Run(string(tr), func(t *testing.T) {
			if err := tr.Supported(); err != nil {
				t.Skip(err)
			}
			const size = 1 << 20
			tx, src := newWriter(t, tr, size)
			// The writer links to the first incarnation and writes to it.
			cfg := Config{Agent: "d1", Transports: []Transport{tr}, Logger: quietLogger()}
			rx1, err := New(cfg)
			require.NoError(t, err)
			_, err = rx1.Register("dst", int64(size))
			require.NoError(t, err)
			write := func(rx *Engine, d Descriptor, id uint64) error {
				g, err := rx.OpenGrant(GrantSpec{RequestID: id, Extents: []Extent{{1, 0, size}}})
				require.NoError(t, err)
				_, err = tx.Write(context.Background(), d, g.Ticket(), []Extent{{src.ID(), 0, size}})
				return err
			}
			old := rx1.Descriptor()
			require.NoError(t, write(rx1, old, 1))
			oldTicket := func() Ticket {
				g, err := rx1.OpenGrant(GrantSpec{RequestID: 2, Extents: []Extent{{1, 0, size}}})
				require.NoError(t, err)
				return g.Ticket()
			}()
			require.NoError(t, rx1.Close())

			rx2, err := New(cfg)
			require.NoError(t, err)
			defer rx2.Close()
			_, err = rx2.Register("dst", int64(size))
			require.NoError(t, err)
			live := rx2.Descriptor()
			require.Greater(t, live.Incarnation, old.Incarnation)
			require.NoError(t, write(rx2, live, 3))
			_, err = tx.Write(context.Background(), old, oldTicket, []Extent{{src.ID(), 0, size}})
			require.ErrorIs(t, err, ErrStaleDescriptor)
			require.NoError(t, write(rx2, live, 4))
			got, ok := tx.TransportFor("d1")
			require.True(t, ok)
			require.Equal(t, tr, got)
		})
	}
}

func TestDescriptorIncarnation(t *testing.T) {
	a, err := New(Config{Agent: "x", Transports: []Transport{TransportTCP}, Logger: quietLogger()})
	require.NoError(t, err)
	defer a.Close()
	b, err := New(Config{Agent: "x", Transports: []Transport{TransportTCP}, Logger: quietLogger()})
	require.NoError(t, err)
	defer b.Close()
	require.NotZero(t, a.cfg.incarnation)
	require.Greater(t, b.cfg.incarnation, a.cfg.incarnation, "a later engine is a later incarnation")
	require.InDelta(t, time.Now().UnixNano(), int64(b.cfg.incarnation), float64(time.Minute))

	d := b.Descriptor()
	raw, err := json.Marshal(d)
	require.NoError(t, err)
	var back Descriptor
	require.NoError(t, json.Unmarshal(raw, &back))
	require.Equal(t, d.Incarnation, back.Incarnation)
	// A descriptor from before the field decodes as unknown.
	var legacy Descriptor
	require.NoError(t, json.Unmarshal([]byte(`{"agent":"x","tcp_addr":"127.0.0.1:1"}`), &legacy))
	require.Zero(t, legacy.Incarnation)
	require.Equal(t, b.cfg.incarnation, b.Descriptor().Incarnation)
}

func TestStaleDescriptorJudge(t *testing.T) {
	at := func(inc uint64, addr string) Descriptor {
		return Descriptor{Agent: "d", TCPAddr: addr, Transports: []Transport{TransportTCP}, Incarnation: inc}
	}
	for _, c := range []struct {
		name      string
		cur, peer Descriptor
		failed    bool
		want      verdict
	}{
		{"same", at(5, "a"), at(5, "a"), false, reuse},
		{"older", at(5, "a"), at(4, "b"), false, stale},
		{"older at the same address", at(5, "a"), at(4, "a"), false, stale},
		{"newer", at(5, "a"), at(6, "b"), false, replace},
		{"newer at the same address", at(5, "a"), at(6, "a"), false, replace},
		{"same incarnation elsewhere", at(5, "a"), at(5, "b"), false, replace},
		{"unknown", at(0, "a"), at(0, "a"), false, reuse},
		{"unknown elsewhere", at(0, "a"), at(0, "b"), false, replace},
		{"unknown link", at(0, "a"), at(4, "b"), false, replace},
		{"unknown peer", at(5, "a"), at(0, "b"), false, replace},
		{"unknown peer, same address", at(5, "a"), at(0, "a"), false, reuse},
		// The link's peer failed: an older incarnation may be a restart
		// on a host whose clock is behind, and replaces it.
		{"older, the link's peer failed", at(5, "a"), at(4, "b"), true, replace},
		{"same, the link's peer failed", at(5, "a"), at(5, "a"), true, reuse},
	} {
		require.Equal(t, c.want, judge(c.cur, c.failed, c.peer), c.name)
	}
}

// A restart on a host whose clock is behind the last one's gets an older
// incarnation: refused as stale while the link to the last one serves,
// it replaces the link once a write found that peer gone, so it is never
// unreachable for good.
func TestRestartWithAClockBehindReachedOnceThePeerFailed(t *testing.T) {
	const size = 1 << 20
	tx, src := newWriter(t, TransportTCP, size)
	cfg := Config{Agent: "d1", Transports: []Transport{TransportTCP}, Logger: quietLogger()}
	rx1, err := New(cfg)
	require.NoError(t, err)
	_, err = rx1.Register("dst", int64(size))
	require.NoError(t, err)
	write := func(rx *Engine, d Descriptor, id uint64) error {
		g, err := rx.OpenGrant(GrantSpec{RequestID: id, Extents: []Extent{{1, 0, size}}, Deadline: time.Now().Add(time.Minute)})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err = tx.Write(ctx, d, g.Ticket(), []Extent{{src.ID(), 0, size}})
		if err != nil {
			g.Revoke()
		}
		return err
	}
	last := rx1.Descriptor()
	require.NoError(t, write(rx1, last, 1))

	rx2, err := New(cfg)
	require.NoError(t, err)
	defer rx2.Close()
	_, err = rx2.Register("dst", int64(size))
	require.NoError(t, err)
	behind := rx2.Descriptor()
	behind.Incarnation = last.Incarnation - uint64(time.Hour) // its host's clock an hour behind
	require.ErrorIs(t, write(rx2, behind, 2), ErrStaleDescriptor, "refused while the last incarnation is linked and well")

	g, err := rx1.OpenGrant(GrantSpec{RequestID: 3, Extents: []Extent{{1, 0, size}}, Deadline: time.Now().Add(time.Minute)})
	require.NoError(t, err)
	require.NoError(t, rx1.Close())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = tx.Write(ctx, last, g.Ticket(), []Extent{{src.ID(), 0, size}})
	require.Error(t, err) // the write finds the last incarnation gone
	require.NoError(t, write(rx2, behind, 4))
	require.NoError(t, write(rx2, behind, 5))
}
